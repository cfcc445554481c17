"""The one thread that owns the loaded models and answers requests one at a time, in arrival order.

llama.cpp contexts are not thread-safe, so a single worker thread loads the Runtime, serves every
job from a bounded FIFO queue and closes the Runtime when the server stops. The asyncio side
submits a `Job` and reads its events (`Started`, `Piece`, `Finished`, `Failed`) from an
asyncio.Queue that the worker fills through `loop.call_soon_threadsafe`.

A job's cancel flag is checked after every decoder step. Closing the text stream between steps
leaves the KV cache consistent, so the cache is kept and the next request prefills only what it
does not share with it (the next turn of a conversation: just the new message). Only an error
inside a step, which may leave half a step behind, empties the caches.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specrun import ui
from specrun.decoding.steps import GenerationStats
from specrun.decoding.stream import stream
from specrun.errors import SpecrunError
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime
from specrun.server.jobs import (
    ChatPrompt,
    Failed,
    Finished,
    Job,
    Piece,
    Started,
    TextPrompt,
    shutting_down,
)
from specrun.server.prompts import ConversationMemory, token_budget
from specrun.server.schemas import APIError

log = logging.getLogger("specrun.server")

# A request waiting for its turn (or the worker waiting for one) looks at the stop flag this often.
POLL_S = 0.25
# Retry-After bounds, in seconds, for a client told that the queue is full.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 120

# The decoders' finish reasons, as the OpenAI API names them: the end of the model's turn and a
# stop string are both "stop"; a full context is reported as "length" (the API has no other word
# for "ran out of room"), and the response's X-Specrun-Max-Tokens header says how much room there was.
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}


# ---------------------------------------------------------------------------------------------
# The worker


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models says about the loaded pair."""

    target: str
    draft: str | None  # the draft model, if one is loaded
    drafter: str  # what proposes trees (see runtime.plan.Plan.drafter): "none" for plain decoding
    n_ctx: int
    tree_budget: int | None


class GenerationWorker:
    """Loads the Runtime in its own thread, then answers queued jobs one at a time until stopped."""

    def __init__(self, opts: RunOptions, queue_size: int, on_ready: Callable[["GenerationWorker", Runtime], None],
                 on_load_error: Callable[[BaseException], None]):
        self.opts = opts
        self.state = "loading"  # loading, ready, failed, stopping
        self.model: ModelInfo | None = None
        self.load_error: BaseException | None = None
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._current: Job | None = None
        self._stopping = threading.Event()
        self._on_ready, self._on_load_error = on_ready, on_load_error
        self._memory = ConversationMemory()
        self._mean_job_s = 5.0  # for Retry-After; follows the recent jobs
        self._thread = threading.Thread(target=self._run, name="specrun-worker", daemon=True)

    # -- called from the event loop --
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 503 (loading, stopping, queue full) that says when to retry."""
        if self.state == "loading":
            raise APIError(503, "the model is still loading", code="model_loading", headers={"Retry-After": "5"})
        if self.state != "ready":
            raise shutting_down()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            wait = self.retry_after_s()
            raise APIError(503, f"the server is busy ({self._jobs.maxsize} requests waiting); retry in {wait} s",
                           code="queue_full", headers={"Retry-After": str(wait)}) from None

    @property
    def queued(self) -> int:
        """Requests waiting for their turn (not counting the one being answered)."""
        return self._jobs.qsize()

    def retry_after_s(self) -> int:
        estimate = math.ceil(self._mean_job_s * (self._jobs.qsize() + 1))
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, estimate))

    def stop(self) -> None:
        """End the answer in progress (at its next step) and refuse everything queued."""
        if self.state in ("loading", "ready"):
            self.state = "stopping"
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- the worker thread --
    def _run(self) -> None:
        try:
            rt = Runtime(self.opts)
        except BaseException as e:  # reported by the main thread, which then exits
            self.state, self.load_error = "failed", e
            self._on_load_error(e)
            return
        try:
            self.model = ModelInfo(rt.models.target_name, rt.models.draft_name if rt.draft is not None else None,
                                   rt.plan.drafter, rt.target_ctx.n_ctx, rt.shape.budget if rt.speculative else None)
            self.runtime = rt
            if not self._stopping.is_set():
                self.state = "ready"
                self._on_ready(self, rt)
            self._serve_until_stopped()
        finally:
            self._refuse_queued()
            rt.close()

    def _serve_until_stopped(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if job.cancel.is_set():
                continue  # the client left while waiting
            self._current = job
            t0 = time.perf_counter()
            try:
                self._serve(job)
            finally:
                self._current = None
                self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - t0)

    def _refuse_queued(self) -> None:
        while True:
            try:
                self._jobs.get_nowait().emit(Failed(shutting_down()))
            except queue.Empty:
                return

    def _serve(self, job: Job) -> None:
        """Answer one job; whatever goes wrong becomes a Failed event, and the worker goes on."""
        try:
            self._answer(job)
        except APIError as e:
            job.emit(Failed(e))
        except Exception as e:
            # The failure may have hit inside a decoder step: start the caches afresh.
            self._reset()
            if isinstance(e, SpecrunError):
                job.emit(Failed(APIError(400 if getattr(e, "exit_code", 1) == 2 else 500, str(e))))
            else:
                log.exception("request %s failed", job.id)
                job.emit(Failed(APIError(500, f"internal error ({type(e).__name__}); the server logged it")))

    def _reset(self) -> None:
        try:
            self.runtime.reset_cache()
        finally:
            self._memory.forget()

    def _answer(self, job: Job) -> None:
        rt = self.runtime
        prompt, rendered = self._prompt_tokens(job.prompt)
        param = "messages" if isinstance(job.prompt, ChatPrompt) else "prompt"
        limit = token_budget(len(prompt), rt.target_ctx.n_ctx, job.max_tokens, param)
        started = Started(len(prompt), rt.decoder.cache.reusable(prompt), limit, job.max_tokens)
        if started.capped:
            ui.dim(f"{job.id}: max_tokens {job.max_tokens} lowered to {limit} to fit the {rt.target_ctx.n_ctx}-token context")
        job.emit(started)
        generated, finish = self._decode(job, prompt, limit)
        stats = rt.decoder.stats
        if job.cancel.is_set():
            self._memory.forget()
            if self._stopping.is_set():
                job.emit(Failed(shutting_down()))
            else:
                job.emit(Finished("cancelled", len(generated), stats))
            _log_job(job, started, stats, "cancelled")
            return
        self._remember(rendered, finish, prompt, generated)
        reason = FINISH_REASONS.get(finish or "length", "length")
        job.emit(Finished(reason, len(generated), stats))
        _log_job(job, started, stats, finish or "length")

    def _prompt_tokens(self, prompt: ChatPrompt | TextPrompt) -> tuple[list[int], str | None]:
        """Return the prompt's tokens, and for a chat the rendered text they spell."""
        rt = self.runtime
        if isinstance(prompt, ChatPrompt):
            fmt = rt.chat_format
            rendered = fmt.render(prompt.messages, add_generation_prompt=True)
            return self._memory.tokens_for(fmt, rendered), rendered.text
        if prompt.token_ids is not None:
            n_vocab = rt.target.n_vocab
            if any(t >= n_vocab for t in prompt.token_ids):
                raise APIError(400, f"token ids must be below the vocabulary size {n_vocab}", param="prompt")
            return list(prompt.token_ids), None
        return rt.target.tokenize(prompt.text, add_special=True, parse_special=prompt.parse_special), None

    def _decode(self, job: Job, prompt: list[int], limit: int) -> tuple[list[int], str | None]:
        """Stream the answer's text to the job; return the generated tokens and the finish reason."""
        rt = self.runtime
        generated: list[int] = []
        finish = None
        chunks = stream(rt.decoder, rt.target, prompt, job.params, limit, job.stop)
        try:
            for chunk in chunks:
                generated.extend(chunk.tokens)
                if chunk.text:
                    job.emit(Piece(chunk.text))
                finish = chunk.finish_reason or finish
                if job.cancel.is_set():
                    break
        finally:
            chunks.close()  # between steps: the caches hold exactly the committed tokens
        return generated, finish

    def _remember(self, rendered: str | None, finish: str | None, prompt: list[int], generated: list[int]) -> None:
        """Keep a finished chat's text and tokens for its next turn (not after a stop string: the
        client never saw the text after it, so its next turn will not start with it)."""
        if rendered is None or finish == "stop":
            return
        answer = self.runtime.target.detokenize(generated, special=True)
        self._memory.remember(rendered + answer, prompt + generated)


def _log_job(job: Job, started: Started, stats: GenerationStats, finish: str) -> None:
    """One stderr line per answered request: prompt reuse, speed, acceptance, how it ended."""
    line = (f"{job.id}: prompt {started.n_prompt} tokens ({started.n_cached} cached) · "
            f"{stats.n_generated} tokens · {stats.tokens_per_s:.1f} tok/s")
    if stats.n_passes:
        line += f" · {stats.accepted_per_pass:.2f} accepted/pass"
    ui.dim(f"{line} · {finish}")
