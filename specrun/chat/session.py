"""A chat session: the model's own template, the conversation, and KV reuse between turns.

The session keeps the exact tokens the target has seen (every prompt and every generated token)
and the text they spell (ConversationMemory, which the server keeps for several conversations).
A new turn renders the whole conversation with the template; when the result starts with that
text, only the rest is tokenized and appended, so the decoder's cache
(CachedSequence.sync keeps the longest common prefix) prefills just the new message. Templates
that re-render earlier turns differently fall back to tokenizing the whole conversation, and the
common-prefix reuse still saves everything before the first difference.

Terminal I/O (prompt, Ctrl-C, status lines) is not here; see commands.chat.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator

from specrun import files
from specrun.chat import templates
from specrun.chat.control import ControlTokens, Marked
from specrun.decoding.steps import GenerationStats
from specrun.decoding.stream import stream
from specrun.errors import ContextFullError, SpecrunError, UsageError


class ChatFormat:
    """How one model writes a conversation: its chat template and special tokens."""

    def __init__(self, model):
        self.model = model
        # Some GGUFs (Gemma 3 270M) ship without a template although their turn format is known.
        self.template = model.chat_template or templates.builtin_template(model.architecture)
        self.bos_text = _piece(model, model.bos)
        self.eos_text = _piece(model, model.eos)

    @property
    def has_template(self) -> bool:
        """Whether the model is an instruct model with a known turn format."""
        return self.template is not None

    @functools.cached_property
    def control(self) -> ControlTokens:
        """The vocabulary's control tokens (read once, on the first chat prompt)."""
        return ControlTokens.of(self.model)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> Marked:
        """Return the conversation rendered, with the control tokens that the template itself wrote;
        `variables` (e.g. enable_thinking) go to the template.

        Control-token text inside the messages stays text: see chat.control."""
        # Template variables from a request (chat_template_kwargs) are text like the messages.
        (shielded, shielded_variables), shield = self.control.shield([messages, variables])
        text = templates.render_chat(
            self.template, shielded, add_generation_prompt, bos_token=self.bos_text, eos_token=self.eos_text,
            **shielded_variables,
        )
        return self.control.marked(text, shield)

    def tokenize_start(self, prompt: Marked) -> list[int]:
        """Return the tokens of a conversation's first rendered text (BOS included once)."""
        model = self.model
        tokens = self.control.tokenize(model, prompt, add_special=True)
        # Templates usually write BOS themselves and the tokenizer adds one too: never start with two.
        if len(tokens) > 1 and tokens[0] == tokens[1] == model.bos:
            tokens = tokens[1:]
        return tokens

    def tokenize_more(self, prompt: Marked, start: int) -> list[int]:
        """Return the tokens of the text from `start` on, which continues a conversation (no BOS)."""
        return self.control.tokenize(self.model, prompt, start=start, add_special=False)

    def prompt_tokens(self, text: str, chat: bool | None = None, system: str | None = None,
                      parse_special: bool = True) -> list[int]:
        """Return a one-message prompt's tokens, wrapped in the chat template in chat mode.

        chat=None means: chat mode when the model has a chat template (an instruct model), raw
        text otherwise. A chat message loses surrounding whitespace (the newline `echo` adds);
        raw text is kept exactly as given.
        """
        if chat is None:
            chat = self.has_template
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text.strip()}]
            return self.tokenize_start(self.render(messages, add_generation_prompt=True))
        if system:
            raise UsageError("a system prompt needs chat mode, and this prompt is raw text "
                             "(chat mode is off, or the model has no chat template)")
        return self.model.tokenize(text, add_special=True, parse_special=parse_special)


def _piece(model, token: int) -> str:
    return model.token_to_piece(token, True).decode("utf-8", "replace") if token >= 0 else ""


class ConversationMemory:
    """The text and tokens of the latest chats (prompt + answer), so a conversation's next turn
    tokenizes only its new part.

    Re-tokenizing the whole conversation could split an earlier answer into other tokens than the
    model generated, and the cache would then be reused only up to that point: a rendered
    conversation that starts with a remembered text reuses its tokens, and only the rest is
    tokenized. `specrun chat` remembers its one conversation; the server several (it answers
    several clients, each in a lane of the cache of its own), the least recently used forgotten
    first.
    """

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, capacity)
        self._chats: list[tuple[str, list[int]]] = []  # (text, tokens), the most recently used last

    def tokens_for(self, fmt, rendered) -> list[int]:
        """Return the tokens of `rendered` (a chat.control.Marked), reusing those of the longest
        remembered chat it continues."""
        found = [i for i, (known, _) in enumerate(self._chats)
                 if len(rendered.text) > len(known) and rendered.continues(known)]
        if not found:
            return fmt.tokenize_start(rendered)
        best = max(found, key=lambda i: len(self._chats[i][0]))
        known, tokens = self._chats[best]
        self._chats.append(self._chats.pop(best))
        return tokens + fmt.tokenize_more(rendered, len(known))

    def remember(self, text: str, tokens: list[int]) -> None:
        """Keep a chat's text and tokens, in place of the turns before it (a text it continues)."""
        self._chats = [(known, t) for known, t in self._chats if not text.startswith(known)]
        self._chats.append((text, list(tokens)))
        del self._chats[: -self.capacity]

    def forget(self) -> None:
        self._chats = []


@dataclass
class TurnStats:
    """What one answer cost: prompt reuse, generation speed, acceptance."""

    n_prompt: int = 0  # tokens of the whole conversation given to the decoder
    n_reused: int = 0  # of those, already in the KV cache from earlier turns
    n_tokens: int = 0  # generated
    n_passes: int = 0  # target forward passes while generating
    lookup_tokens: int = 0  # draft tokens accepted that came from text lookup
    draft_tokens: int = 0  # draft tokens accepted that came from the draft model
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None  # eog, length, context, stopped

    @property
    def n_prefilled(self) -> int:
        """Prompt tokens that had to be decoded for this turn (the new message, ideally)."""
        return self.n_prompt - self.n_reused

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def accepted_per_pass(self) -> float:
        return self.n_tokens / self.n_passes if self.n_passes else 0.0


@dataclass
class SessionTotals:
    turns: int = 0
    n_tokens: int = 0
    n_prefilled: int = 0
    decode_s: float = 0.0
    n_passes: int = 0
    lookup_tokens: int = 0
    draft_tokens: int = 0


class ChatSession:
    """One conversation with a loaded runner.Runtime (its target, decoder and contexts)."""

    def __init__(self, rt, system: str | None = None):
        self.rt = rt
        self.system = system
        self.format = rt.chat_format
        self.started = datetime.now()
        self.last: TurnStats | None = None
        self.totals = SessionTotals()
        self.reset()

    # -- conversation state --
    def reset(self) -> None:
        """Forget the conversation (the system prompt stays; its cached tokens are reused)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens: list[int] = []  # the tokens the target has seen
        self.memory = ConversationMemory()  # and the text they spell

    @property
    def n_ctx(self) -> int:
        return self.rt.target_ctx.n_ctx

    @property
    def n_used(self) -> int:
        """Tokens the conversation occupies in the context."""
        return len(self.tokens)

    def prompt_for(self, user_text: str) -> tuple[list[int], str]:
        """Return the conversation + the new user message + the generation prompt, as tokens and text."""
        full = self.format.render(self.messages + [{"role": "user", "content": user_text}])
        return self.memory.tokens_for(self.format, full), full.text

    # -- one turn --
    def ask(self, user_text: str, params, max_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text as it streams; the turn is recorded when the answer ends or is stopped.

        Raises ContextFullError before decoding anything when the conversation leaves no room.
        Closing the generator early (Ctrl-C) stops between decoder steps, which leaves the KV
        cache consistent; the partial answer stays in the conversation.
        """

        if not user_text.strip():
            raise UsageError("empty message")
        prompt, prompt_text = self.prompt_for(user_text)
        room = self.n_ctx - len(prompt)
        if room < 2:
            raise ContextFullError(
                f"the conversation fills the context ({len(prompt)} of {self.n_ctx} tokens): "
                "/reset starts a new one (or restart with a larger --ctx-size)"
            )
        limit = min(max_tokens or room, room - 1)
        context_bound = limit < (max_tokens or room)  # stopping at the limit means: the context is full
        decoder = self.rt.decoder
        stats = TurnStats(n_prompt=len(prompt), n_reused=decoder.cache.reused(prompt, params))
        generated: list[int] = []
        parts: list[str] = []
        finished = False
        figures = GenerationStats(n_prompt=len(prompt))  # the stream's, from its first chunk on
        t0 = time.perf_counter()
        try:
            for chunk in stream(decoder, self.rt.target, prompt, params, limit):
                figures = chunk.stats
                generated.extend(chunk.tokens)
                parts.append(chunk.text)
                if chunk.text:
                    yield chunk.text
            finished = True
        except GeneratorExit:
            raise
        except BaseException:
            # Interrupted inside a step (a second Ctrl-C, an engine error): the caches may hold
            # half a step. Start them afresh; the next turn prefills the whole conversation.
            self.rt.reset_cache()
            raise
        finally:
            stats.finish_reason = (figures.finish_reason or "length") if finished else "stopped"
            if stats.finish_reason == "length" and context_bound:
                stats.finish_reason = "context"
            self._record(user_text, prompt, prompt_text, generated, "".join(parts), stats, figures, t0)

    def _record(self, user_text, prompt, prompt_text, generated, reply, stats: TurnStats, ds: GenerationStats,
                t0) -> None:
        stats.n_tokens = len(generated)
        stats.n_passes = ds.n_passes
        counts = ds.as_dict()
        stats.lookup_tokens, stats.draft_tokens = counts["lookup_tokens"], counts["draft_tokens"]
        stats.prefill_s = ds.prefill_s
        stats.decode_s = ds.decode_s if ds.decode_s else max(0.0, time.perf_counter() - t0 - ds.prefill_s)
        self.last = stats
        t = self.totals
        t.turns += 1
        t.n_tokens += stats.n_tokens
        t.n_prefilled += stats.n_prefilled
        t.decode_s += stats.decode_s
        t.n_passes += stats.n_passes
        t.lookup_tokens += stats.lookup_tokens
        t.draft_tokens += stats.draft_tokens
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
        self.tokens = list(prompt) + generated
        # The generated tokens spell the reply plus, when the model ended its turn, the
        # end-of-turn token (which the stream does not show).
        ended = generated and generated[-1] in self.rt.decoder.eog
        self.memory.remember(prompt_text + reply + (_piece(self.rt.target, generated[-1]) if ended else ""), self.tokens)

    # -- saving --
    def transcript(self) -> dict:
        """Return the conversation as a JSON-ready dict."""
        models = getattr(self.rt, "models", None)
        return {
            "model": getattr(models, "target_name", None),
            "draft": getattr(models, "draft_name", None),
            "started": self.started.isoformat(timespec="seconds"),
            "messages": list(self.messages),
        }

    def save(self, path: Path) -> str:
        """Write the transcript (JSON for .json, Markdown otherwise) atomically; return the format used."""
        path = path.expanduser()
        if path.suffix.lower() == ".json":
            kind, body = "JSON", json.dumps(self.transcript(), ensure_ascii=False, indent=2) + "\n"
        else:
            kind, body = "Markdown", self._markdown()
        try:
            files.atomic_write_text(path, body)
        except OSError as e:
            raise SpecrunError(f"cannot write {path}: {e.strerror or e}") from None
        return kind

    def _markdown(self) -> str:
        data = self.transcript()
        title = f"# Chat with {data['model']}" if data["model"] else "# Chat"
        lines = [title, "", f"_{data['started'].replace('T', ' ')}"
                 + (f", draft {data['draft']}" if data["draft"] else "") + "_", ""]
        headings = {"system": "System", "user": "User", "assistant": "Assistant"}
        for message in self.messages:
            lines += [f"## {headings.get(message['role'], message['role'].title())}", "", message["content"].rstrip(), ""]
        return "\n".join(lines)



