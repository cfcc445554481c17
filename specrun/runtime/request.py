"""One generation request (sampling settings, limits and what the answer must follow) and running
it on a loaded Runtime. Every front end builds one: `generate` and `chat` from their options, the
server's OpenAI and Ollama APIs from a request's fields (server/schemas.py, server/ollama.py); its
sampling settings and its grammar (a schema's, a grammar's, the tool calls the server allows) are
made here and nowhere else."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specrun.chat.tools import ToolFormat
from specrun.core.sampling import SamplingParams, TokenLogprob
from specrun.decoding.stream import collect, stream
from specrun.engine.grammar import Grammar, schema_grammar, text_grammar
from specrun.errors import UsageError


@dataclass(frozen=True)
class ToolUse:
    """The tools an answer may call, written as the model's chat template writes calls."""

    format: ToolFormat
    functions: tuple[dict, ...]  # OpenAI function objects (name, description, parameters)
    forced: bool = False  # the answer is one call of one of them, whatever it would say in words


@dataclass(frozen=True)
class Request:
    """One generation request: sampling settings, limits, and the JSON schema or grammar its answer
    follows."""

    max_tokens: int | None = 256  # None: until the context is full (the server's limit, applied there)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool | None = None  # None: chat mode when the model has a chat template
    system: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # report log-probs with this many alternatives (None: off)
    json_schema: str | None = None  # JSON text of a schema the answer must satisfy
    grammar: str | None = None  # a GBNF or Lark grammar the answer must follow
    parse_special: bool = True  # raw prompts: special-token text becomes special tokens (chat messages: never)
    # A whole conversation, (role, content) per message, in place of one prompt text: rendered by
    # the model's chat template (a `--jsonl` line's "messages").
    messages: tuple[tuple[str, str], ...] | None = None
    # --reproducible: the same answer whatever the load (SamplingParams.reproducible).
    reproducible: bool = False

    def sampling(self, grammar: Grammar | None = None) -> SamplingParams:
        """Return the sampling settings (raises UsageError naming a bad one)."""
        return SamplingParams(
            self.temperature, self.top_k, self.top_p, self.min_p, self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repeat_penalty=self.repeat_penalty, logit_bias=self.logit_bias, grammar=grammar,
            logprobs=self.logprobs, pinned=self.reproducible,
        )

    def check(self) -> None:
        """Raise UsageError for a bad setting, before any model loads (grammars compile later)."""
        self.sampling()
        if self.json_schema is not None and self.grammar is not None:
            raise UsageError("give a JSON schema or a grammar, not both")
        if self.json_schema is not None:
            schema_grammar(json.loads(self.json_schema))
        if self.grammar is not None:
            text_grammar(self.grammar)

    def schema(self) -> dict | None:
        """Return the JSON schema the answer must satisfy (None: none)."""
        return None if self.json_schema is None else json.loads(self.json_schema)

    def compile_grammar(self, model, tools: ToolUse | None = None) -> Grammar | None:
        """Return the grammar the answer follows, compiled for `model`'s vocabulary (None:
        unconstrained). With `tools`: a forced call's grammar (the answer is that call, whatever
        a schema asks of an answer in words, as with the OpenAI API), or a call allowed in place
        of the schema's answer."""
        def marker(text: str) -> str:  # a fixed piece of a call: the special token it is, if any
            return Grammar.literal(model, text)

        if tools is not None and tools.forced:
            return Grammar.from_lark(model, tools.format.grammar(list(tools.functions), marker))
        if self.json_schema is not None:
            if tools is not None:
                return Grammar.from_lark(model, tools.format.call_or_answer(list(tools.functions), marker,
                                                                            self.schema()))
            return Grammar.from_schema(model, self.schema())
        if self.grammar is not None:
            return Grammar.from_text(model, self.grammar)
        return None


def run_request(rt, request: Request, text: str | None, on_text=None, lease=None):
    """Generate for one prompt text (or the request's messages); call on_text(chunk) as text
    streams; return the Result.
    `lease`: where several requests decode at once, each with a decoder of its own, the
    runtime.pool.Lease that takes this one's once its prompt is known; by default the runtime's
    first decoder."""
    if request.messages is not None:
        prompt = rt.tokenize_messages([{"role": role, "content": content} for role, content in request.messages])
    else:
        prompt = rt.tokenize_prompt(text, request.chat, request.system, request.parse_special)
    params = request.sampling(request.compile_grammar(rt.target))
    decoder = lease.take(prompt) if lease is not None else rt.decoder  # (its grammar compiled first)
    chunks = stream(decoder, rt.target, prompt, params, request.max_tokens, request.stop)
    return collect(chunks, params, on_text)


def logprob_json(model, logprobs: list[TokenLogprob]) -> list[dict]:
    """Return log-probs as the OpenAI API's chat `logprobs.content` entries (token text, bytes,
    logprob, top_logprobs), with the token id added."""
    def entry(token: int, logprob: float) -> dict:
        piece = model.token_to_piece(token, special=True)
        return {"token": piece.decode("utf-8", errors="replace"), "id": token, "bytes": list(piece),
                "logprob": logprob}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]
