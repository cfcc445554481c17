"""A request on its way to the generation worker, and the events the worker sends back.

The asyncio side creates a `Job` and reads its events from `Job.events`; the worker thread puts
them there with `loop.call_soon_threadsafe`. A job's prompt is read (`ReadPrompt`) and checked
when it arrives; it gets `Started` when its turn comes, then `Piece`s of text, then `Finished`;
or `Failed` at any point.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from specrun.decoding.steps import GenerationStats
from specrun.runtime.request import Request, ToolUse
from specrun.server.schemas import APIError

# A request waiting for its turn (or the worker waiting for one) looks at the stop flag this often.
POLL_S = 0.25


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered with the model's own chat template (with `tools`, if any)."""

    messages: list[dict]
    template_kwargs: dict = field(default_factory=dict)  # extra template variables (enable_thinking...)
    reasoning_format: str | None = None  # auto, none, or None: the server's default
    tools: list[dict] | None = None  # OpenAI tool objects, as the template's `tools` variable
    tool_choice: str = "auto"  # auto, none, required, or "function:NAME" (a named call)


@dataclass(frozen=True)
class TextPrompt:
    """Raw text (tokenized as `specrun generate --raw` does: special tokens parsed unless
    parse_special is False), or token ids as sent."""

    text: str | None = None
    token_ids: list[int] | None = None
    parse_special: bool = True


@dataclass(frozen=True)
class ReadPrompt:
    """A job's prompt as the model reads it, checked against the context (by the worker, when the
    job arrives: server.worker)."""

    tokens: list[int]
    rendered: str | None  # a chat's text as the template rendered it (None: a raw prompt)
    max_tokens: int  # the limit in force: the request's, capped by the room the prompt leaves
    tools: ToolUse | None = None  # the tools the answer may call, as the model writes calls


@dataclass(frozen=True)
class Started:
    """The job's turn came and its prompt fits: generation begins."""

    n_prompt: int  # tokens in the prompt
    n_cached: int  # of those, reused from the KV cache
    max_tokens: int  # the limit in force
    requested_max_tokens: int | None  # the client's limit (None: none given)
    queue_s: float = 0.0  # how long the request waited for its turn

    @property
    def capped(self) -> bool:
        return self.requested_max_tokens is not None and self.max_tokens < self.requested_max_tokens


@dataclass(frozen=True)
class Piece:
    text: str  # the answer's text
    reasoning: str = ""  # thinking text (reasoning models, when split out)
    logprobs: list[dict] | None = None  # its tokens' log-probs (chat API entries), when asked for


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop, length, tool_calls, or cancelled (nobody is listening then)
    n_generated: int
    stats: GenerationStats
    # With tools the answer is held back and parsed at the end: its text and calls come here.
    content: str | None = None
    tool_calls: list | None = None  # chat.tools.ParsedCall


@dataclass(frozen=True)
class Failed:
    error: APIError


@dataclass
class Job:
    """One request on its way through the queue."""

    id: str
    prompt: ChatPrompt | TextPrompt
    request: Request  # sampling, limits (max_tokens None: until the context is full), schema or grammar
    loop: asyncio.AbstractEventLoop
    constraint_field: str = "response_format"  # the request field that asked for a schema or grammar (named in errors)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    ahead: int = 0  # requests before it when it arrived (the one being answered included)
    started_at: float = 0.0  # when its turn came (perf_counter)
    read: ReadPrompt | None = None  # its prompt, read on arrival (None: read when its turn comes)

    def emit(self, event) -> None:
        """Hand an event to the request's coroutine (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the event loop has closed: the server is gone and nobody is listening


@dataclass(frozen=True)
class Answer:
    """A whole (non-streamed) answer, as EventReader.rest collects it."""

    text: str
    reasoning: str
    logprobs: list[dict] | None
    finished: Finished


class ClientGone(Exception):
    """The client disconnected; its job has been cancelled."""


class EventReader:
    """Reads a job's events, watching for the client going away while it waits."""

    def __init__(self, request, job: Job):
        # request: the ASGI request (anything with an async is_disconnected()).
        self.request = request
        self.job = job
        self._getter: asyncio.Task | None = None
        self._asked_at = time.monotonic()  # when the connection was last asked whether the client is there

    async def next(self) -> Started | Piece | Finished:
        """Return the next event; raise a Failed event's error, or ClientGone."""
        # One pending get() survives the polls, so an event can never be lost to a timeout.
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({self._getter}, timeout=POLL_S)
                # Asked also while events keep coming: a whole answer read without a pause would
                # otherwise run to its end for a client that left at its start.
                if await self._client_gone():
                    self.job.cancel.set()
                    raise ClientGone()
                if done:
                    break
        except BaseException:
            self._getter.cancel()
            self._getter = None
            raise
        event, self._getter = self._getter.result(), None
        if isinstance(event, Failed):
            raise event.error
        return event

    async def _client_gone(self) -> bool:
        """Return whether the client has disconnected, asking the connection at most every POLL_S."""
        now = time.monotonic()
        if now - self._asked_at < POLL_S:
            return False
        self._asked_at = now
        return await self.request.is_disconnected()

    async def rest(self, logprobs: bool = False) -> "Answer":
        """Return the rest of the answer (raise as next()); with `logprobs`, its tokens' log-probs."""
        texts: list[str] = []
        thoughts: list[str] = []
        entries: list[dict] | None = [] if logprobs else None
        try:
            while True:
                event = await self.next()
                if isinstance(event, Piece):
                    texts.append(event.text)
                    thoughts.append(event.reasoning)
                    if entries is not None and event.logprobs:
                        entries.extend(event.logprobs)
                elif isinstance(event, Finished):
                    # With tools the text was held back and comes whole with the Finished event.
                    text = event.content if event.content is not None else "".join(texts)
                    return Answer(text, "".join(thoughts), entries, event)
        finally:
            self.job.cancel.set()  # a no-op once finished; stops the worker when the caller is cancelled


def disconnected() -> APIError:
    """Return the error a request whose client left before its answer ends with (nobody reads it:
    the status and message are for the log)."""
    return APIError(499, "client disconnected before the answer was sent", code="client_disconnected")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down")


def worker_gone() -> APIError:
    return APIError(503, "the generation worker has stopped; restart the server (its log says why)",
                    code="worker_stopped")
