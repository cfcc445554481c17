"""The JSON objects the server answers with: whole completions, stream chunks, usage and timings.

`timings` follows llama.cpp's server (prompt_n, prompt_ms, predicted_n, draft_n, ...) so tools
written for it read specrun's figures too, and adds specrun's own: target passes and tokens
accepted per pass.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from specrun.decoding.steps import GenerationStats
from specrun.server.jobs import Started

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    """Return one server-sent event carrying obj as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(started: Started, n_generated: int) -> dict:
    return {
        "prompt_tokens": started.n_prompt,
        "completion_tokens": n_generated,
        "total_tokens": started.n_prompt + n_generated,
        # The OpenAI API's own field for prompt tokens served from a cache.
        "prompt_tokens_details": {"cached_tokens": started.n_cached},
    }


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 2) if seconds > 0 else 0.0


def _per_token_ms(n: int, seconds: float) -> float:
    return round(seconds * 1000 / n, 3) if n else 0.0


def timings(started: Started, stats: GenerationStats) -> dict:
    """Return the request's timings, as llama.cpp's server names them, plus specrun's acceptance figures."""
    prompt_n = started.n_prompt - started.n_cached  # tokens that had to be evaluated
    predicted_n = stats.n_generated
    rate = stats.tokens_per_s
    return {
        "queue_ms": round(started.queue_s * 1000, 3),  # waiting for the turn, before the prompt
        "cache_n": started.n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": round(stats.prefill_s * 1000, 3),
        "prompt_per_token_ms": _per_token_ms(prompt_n, stats.prefill_s),
        "prompt_per_second": _rate(prompt_n, stats.prefill_s),
        "predicted_n": predicted_n,
        "predicted_ms": round(stats.decode_s * 1000, 3),
        # The decoding speed, over the tokens after the first (whose pass is the prompt's); null
        # for an answer of fewer than two tokens, whose speed no decoding pass measured.
        "predicted_per_token_ms": None if rate is None else round(1000 / rate, 3),
        "predicted_per_second": None if rate is None else round(rate, 2),
        # Proposed tokens the target checked, and those it kept (tree nodes on the accepted paths);
        # of the kept ones, how many came from text lookup rather than the draft model.
        "draft_n": sum(step.tree_nodes for step in stats.steps),
        "draft_n_accepted": sum(step.accepted for step in stats.steps),
        "lookup_n_accepted": sum(step.lookup_tokens for step in stats.steps),
        "n_passes": stats.n_passes,
        "accepted_per_pass": round(stats.accepted_per_pass, 3),
        # Of the passes, those whose batch also held other requests' tokens (--parallel), and the
        # most requests one of them held.
        "shared_passes": sum(1 for step in stats.steps if step.shared > 1),
        "most_shared": max((step.shared for step in stats.steps), default=1),
    }


def _chat_entry(entry: dict) -> dict:
    top = [{k: t[k] for k in ("token", "logprob", "bytes")} for t in entry["top_logprobs"]]
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"], "top_logprobs": top}


def _tool_call(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class Envelope:
    """What every object of one response shares: id, creation time, model, and chat vs text shape."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.chat else "cmpl")

    def _object(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, finish_reason: str, started: Started, n_generated: int, stats: GenerationStats,
              reasoning: str = "", logprobs: list[dict] | None = None, tool_calls: list | None = None) -> dict:
        """Return a complete (non-streamed) answer; a chat's thinking, if split out, as reasoning_content."""
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [_tool_call(call) for call in tool_calls]}
            if reasoning:
                message["reasoning_content"] = reasoning.strip()
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._object("chat.completion", [choice])
        else:
            body = self._object("text_completion", [{"index": 0, "text": text, "logprobs": self._logprobs(logprobs),
                                                     "finish_reason": finish_reason}])
        body["usage"] = usage(started, n_generated)
        body["timings"] = timings(started, stats)
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              reasoning: str = "", logprobs: list[dict] | None = None) -> dict:
        """Return one stream chunk: a piece of text (and of thinking), the opening role, or the finish reason."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return self._object("text_completion", [choice])

    def tool_call_deltas(self, index: int, call) -> list[dict]:
        """Return the stream chunks of one tool call: its id and name, then its arguments."""
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        args = {"index": index, "function": {"arguments": call.arguments}}
        return [self._object("chat.completion.chunk", [{"index": 0, "delta": {"tool_calls": [part]}, "logprobs": None,
                                                        "finish_reason": None}]) for part in (head, args)]

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        """Return a choice's logprobs object: the chat API's content list, or the legacy
        completions arrays."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries], "refusal": None}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        }

    def final_chunk(self, finish_reason: str, started: Started, stats: GenerationStats) -> dict:
        """Return the chunk that ends a stream, with timings as llama.cpp's server sends them."""
        body = self.chunk(finish_reason=finish_reason)
        body["timings"] = timings(started, stats)
        return body

    def usage_chunk(self, started: Started, n_generated: int, stats: GenerationStats) -> dict:
        """Return the chunk stream_options.include_usage asks for: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._object(kind, [])
        body["usage"] = usage(started, n_generated)
        body["timings"] = timings(started, stats)
        return body
