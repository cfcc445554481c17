"""A request on its way to the generation worker, and the events the worker sends back.

The asyncio side creates a `Job` and reads its events from `Job.events`; the worker thread puts
them there with `loop.call_soon_threadsafe`. A job gets `Started` when its turn comes and its
prompt fits, then `Piece`s of text, then `Finished`; or `Failed` at any point.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from specrun.core.sampling import SamplingParams
from specrun.decoding.steps import GenerationStats
from specrun.server.schemas import APIError


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered with the model's own chat template."""

    messages: list[dict]


@dataclass(frozen=True)
class TextPrompt:
    """Raw text (tokenized as `specrun generate --raw` does: special tokens parsed unless
    parse_special is False), or token ids as sent."""

    text: str | None = None
    token_ids: list[int] | None = None
    parse_special: bool = True


@dataclass(frozen=True)
class Started:
    """The job's turn came and its prompt fits: generation begins."""

    n_prompt: int  # tokens in the prompt
    n_cached: int  # of those, reused from the KV cache
    max_tokens: int  # the limit in force
    requested_max_tokens: int | None  # the client's limit (None: none given)

    @property
    def capped(self) -> bool:
        return self.requested_max_tokens is not None and self.max_tokens < self.requested_max_tokens


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop, length, or cancelled (nobody is listening then)
    n_generated: int
    stats: GenerationStats


@dataclass(frozen=True)
class Failed:
    error: APIError


@dataclass
class Job:
    """One request on its way through the queue."""

    id: str
    prompt: ChatPrompt | TextPrompt
    params: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, event) -> None:
        """Hand an event to the request's coroutine (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the event loop has closed: the server is gone and nobody is listening


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down")
