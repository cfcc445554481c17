"""The worker that owns the loaded models and answers queued requests, several at once.

A worker thread loads the Runtime, takes jobs from a bounded FIFO queue and closes the Runtime
when the server stops. The asyncio side submits a `Job` and reads its events (`Started`,
`Piece`, `Finished`, `Failed`) from an asyncio.Queue that the worker fills through
`loop.call_soon_threadsafe`.

With --parallel N (by default as many as fit, runtime.plan.DEFAULT_PARALLEL at most) up to N jobs
are answered at once, each in a thread of its own with a decoder of its own: its lane of the
target's context and of the draft's. Their passes of each model meet in one gate and run as one
batch (decoding.batching), so four requests cost little more than one; everything else a request
does (its prompt, grammar, drafting, sampling, streaming) is its own. A job takes the idle decoder
whose cache holds most of its prompt (runtime.pool: a conversation's next turn finds its previous
turns), and the tokens of the latest conversations are remembered, two per lane (chat.session:
a next turn tokenizes only its new message).

A job's cancel flag is checked after every decoder step. Closing the text stream between steps
leaves the KV cache consistent, so the cache is kept and the next request prefills only what it
does not share with it (the next turn of a conversation: just the new message; a greedy request
that parts from an earlier prompt: also the rest of that prompt's last batch, so that it is
evaluated as in an empty cache, see decoding.kv). Only an error inside a step, which may leave
half a step behind, empties the caches.

Fairness: /health and /v1/models never touch the worker, a job records when it was queued and
how many were ahead (X-Queue-Position, timings.queue_ms); a cancelled job leaves its lane at its
next step, and the others' passes go on without it. A job's prompt is rendered, tokenized and
checked against the context when it arrives (`admit`, in a thread beside the answers decoding:
llama.cpp tokenizes from any thread), so a prompt that cannot fit is a 400 at once, not when its
turn comes behind the answers before it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from specrun import ui
from specrun.chat import reasoning
from specrun.chat.reasoning import ChatSettings, ReasoningParser
from specrun.chat.session import ConversationMemory
from specrun.chat.tools import tool_format
from specrun.core.sampling import SamplingParams
from specrun.decoding.steps import GenerationStats
from specrun.decoding.stream import stream
from specrun.engine import grammar, rpc
from specrun.errors import GrammarError, SpecrunError, UsageError
from specrun.runtime.plan import RunOptions
from specrun.runtime.pool import DecoderPool, Lease
from specrun.runtime.request import ToolUse, logprob_json
from specrun.runtime.runtime import Runtime
from specrun.server.jobs import (
    POLL_S,
    ChatPrompt,
    Failed,
    Finished,
    Job,
    Piece,
    ReadPrompt,
    Started,
    TextPrompt,
    shutting_down,
    worker_gone,
)
from specrun.server.prompts import refuse_what_cannot_fit, token_budget
from specrun.server.schemas import APIError

log = logging.getLogger("specrun.server")

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
    n_ctx_train: int = 0  # the target's trained context (0: unknown)
    ctx_why: str = ""  # why n_ctx: --ctx-size, or the trained context as far as memory holds it
    architecture: str = ""
    file_name: str = ""
    file_bytes: int = 0
    chat_template: str | None = None  # the template chats are rendered with (None: ChatML fallback)
    size_label: str = ""  # the GGUF's general.size_label ("135M", "30B-A3B"), as Ollama's parameter_size
    modified: float = 0.0  # the target file's modification time (seconds since the epoch; 0: unknown)
    throughput: bool = False  # serve --throughput: prompts in the passes of the other requests' steps


class QueueWorker:
    """Loads the models in its own thread, then answers queued jobs one at a time until stopped.

    The queue, the 503s that say when to retry and the stop are here; a subclass says how the
    models load (`_load`, returning the line that says what is served), how one job is answered
    (`_serve`) and how the models are let go (`_unload`).
    """

    def __init__(self, queue_size: int, on_ready: Callable[[QueueWorker, str], None],
                 on_load_error: Callable[[BaseException], None], reproducible: bool = False):
        self.state = "loading"  # loading, ready, failed, stopping
        # serve --reproducible: every job is decoded as a --reproducible request, whatever it asked.
        self.reproducible = reproducible
        self.model: ModelInfo | None = None
        self.load_error: BaseException | None = None
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._active: dict[int, Job] = {}  # the jobs being answered, by id()
        self.parallel = 1  # jobs answered at once (a subclass sets it when its models are loaded)
        self._stopping = threading.Event()
        self._on_ready, self._on_load_error = on_ready, on_load_error
        self._mean_job_s = 5.0  # for Retry-After; follows the recent jobs
        self._thread = threading.Thread(target=self._run, name="specrun-worker", daemon=True)

    # -- called from the event loop --
    def start(self) -> None:
        self._thread.start()

    async def admit(self, job: Job) -> None:
        """Read the job's prompt and queue the job; raise what refuses it at once: a 503 as submit
        does, or the 400 of a prompt that cannot be answered (one that does not fit the context)."""
        self._refuse_now()
        if self.reproducible:
            job.request = replace(job.request, reproducible=True)
        await self._read_on_arrival(job)
        job.queued_at = time.perf_counter()  # its wait for its turn starts now
        self.submit(job)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 503 (loading, stopping, queue full) that says when to retry."""
        self._refuse_now()
        try:
            job.ahead = self._jobs.qsize() + (len(self._active) >= self.parallel)
            self._jobs.put_nowait(job)
        except queue.Full:
            raise self._busy() from None

    def _refuse_now(self) -> None:
        """Raise the 503 a new job gets now (loading, stopping, the worker gone, the queue full), if any."""
        if self.state == "loading":
            raise loading()
        if self.state != "ready":
            raise shutting_down()
        if not self.alive:
            raise worker_gone()
        if self._jobs.full():
            raise self._busy()

    def _busy(self) -> APIError:
        wait = self.retry_after_s()
        return APIError(503, f"the server is busy ({self._jobs.maxsize} requests waiting); retry in {wait} s",
                        code="queue_full", headers={"Retry-After": str(wait)})

    async def _read_on_arrival(self, job: Job) -> None:
        """Read and check the job's prompt before it is queued (here: not at all; _serve reads it at
        the job's turn; a subclass reads it where its models live, in this process or its child)."""

    def ready_model(self) -> ModelInfo:
        """Return what is loaded, or raise a 503 while it is still loading."""
        if self.model is None or self.state == "loading":
            raise loading()
        return self.model

    @property
    def alive(self) -> bool:
        """Whether the worker thread still runs (it ends only when the server stops)."""
        return self._thread.is_alive()

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
        for job in list(self._active.values()):
            job.cancel.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- the worker thread --
    def _run(self) -> None:
        try:
            description = self._load()
        except BaseException as e:  # reported by the main thread, which then exits
            self.state, self.load_error = "failed", e
            self._on_load_error(e)
            return
        try:
            if not self._stopping.is_set():
                self.state = "ready"
                if self.reproducible:
                    passes = "greedy in chains that verify as one-token passes" if self._chains_exact() else "one token each"
                    description += f", every request reproducible (passes of its own, {passes})"
                self._on_ready(self, description)
            self._serve_until_stopped()
        finally:
            self._refuse_queued()
            self._unload()

    def _load(self) -> str:
        raise NotImplementedError

    def _chains_exact(self) -> bool:  # whether greedy chains verify as one-token passes (kv.chains_exact)
        return False

    def _serve(self, job: Job) -> None:
        raise NotImplementedError

    def _unload(self) -> None:
        raise NotImplementedError

    def _serve_until_stopped(self) -> None:
        """Take queued jobs in order and answer up to `parallel` at once (one at a time in this
        thread; several each in a thread of its own)."""
        free = threading.Semaphore(self.parallel)
        threads: list[threading.Thread] = []
        while not self._stopping.is_set():
            if not free.acquire(timeout=POLL_S):
                continue
            try:
                job = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                free.release()
                continue
            if job.cancel.is_set():
                free.release()
                continue  # the client left while waiting
            job.started_at = time.perf_counter()
            self._active[id(job)] = job
            if self.parallel == 1:
                self._answer_job(job, free)
                continue
            thread = threading.Thread(target=self._answer_job, args=(job, free), name=f"specrun-{job.id}", daemon=True)
            threads = [t for t in threads if t.is_alive()] + [thread]
            thread.start()
        for thread in threads:
            thread.join()

    def _answer_job(self, job: Job, free: threading.Semaphore) -> None:
        try:
            self._serve(job)
        finally:
            self._active.pop(id(job), None)
            free.release()
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - job.started_at)

    def _refuse_queued(self) -> None:
        while True:
            try:
                self._jobs.get_nowait().emit(Failed(shutting_down()))
            except queue.Empty:
                return


# Conversations the server remembers the tokens of, per lane (see GenerationWorker._load).
MEMORY_PER_LANE = 2


class GenerationWorker(QueueWorker):
    """The worker that owns the Runtime in this process."""

    def __init__(self, opts: RunOptions, queue_size: int, on_ready: Callable[[QueueWorker, str], None],
                 on_load_error: Callable[[BaseException], None], chat: ChatSettings = ChatSettings(),
                 reproducible: bool = False):
        super().__init__(queue_size, on_ready, on_load_error, reproducible)
        self.opts = opts
        self.chat = chat
        self._memory = ConversationMemory()
        self._lock = threading.Lock()  # the conversation memory, between jobs' threads
        self._pool: DecoderPool | None = None  # the decoders no job is using
        # Prompts being read on arrival, in the event loop's threads: the models stay loaded until
        # they are read (_unload waits for them), and none starts once they are being let go.
        self._reading = threading.Condition()
        self._n_reading = 0
        self._unloading = False

    def _chains_exact(self) -> bool:
        return self.runtime.chains_exact

    def _load(self) -> str:
        rt = Runtime(self.opts)
        try:
            if self.chat.template is not None:
                rt.chat_format.template = self.chat.template
            self.model = _model_info(rt)
            # What the first requests would read of the vocabulary is read before the server is
            # ready: its longest token (the limit on a message's size), its control tokens and
            # llguidance's tokenizer (Gemma 3's 262k tokens: 0.5, 0.5 and 2.2 s, which were the
            # first chat's and the first schema's time to first token).
            rt.target.max_token_bytes
            rt.chat_format.control
            grammar.prepare(rt.target)
            # And whether a prompt that parts from a cached one inside a batch may resume there
            # (decoding.kv.resumes_alike: 0.7 s on the demo target, the second request's otherwise).
            for decoder in rt.decoders:
                decoder.cache.measure_resumes()
        except BaseException:
            rt.close()
            raise
        self.runtime = rt
        self._pool = DecoderPool(rt.decoders)
        self.parallel = len(rt.decoders)
        # Conversations whose tokens are remembered: more than the lanes, whose caches hold the
        # latest ones (a client that comes back after others finds its lane taken, but its
        # tokens as they were generated still match what any lane kept of them).
        self._memory = ConversationMemory(MEMORY_PER_LANE * self.parallel)
        return describe(rt)

    def _unload(self) -> None:
        with self._reading:
            self._unloading = True
            self._reading.wait_for(lambda: self._n_reading == 0)
        self.runtime.close()

    async def _read_on_arrival(self, job: Job) -> None:
        # In a thread: rendering and tokenizing a long prompt takes a while, and the event loop
        # answers every other request meanwhile.
        job.read = await asyncio.to_thread(self.read_arriving, job)

    def read_arriving(self, job: Job) -> ReadPrompt:
        with self._reading:
            if self._unloading:
                raise shutting_down()
            self._n_reading += 1
        try:
            return self._read(job)
        except SpecrunError as e:  # (a template that refuses the conversation, ...)
            raise _refusal(e) from None
        finally:
            with self._reading:
                self._n_reading -= 1
                self._reading.notify_all()

    def _read(self, job: Job) -> ReadPrompt:
        """Return the job's prompt as the model reads it, with the limit on its answer; raise the 400
        of a prompt that cannot be answered (tools the template cannot take, a prompt that does not
        fit the context)."""
        tools = self._tools(job.prompt)
        tokens, rendered = self._prompt_tokens(job.prompt)
        param = "messages" if isinstance(job.prompt, ChatPrompt) else "prompt"
        limit = token_budget(len(tokens), self.runtime.n_ctx, job.request.max_tokens, param)
        return ReadPrompt(tokens, rendered, limit, tools)

    def _serve(self, job: Job) -> None:
        """Answer one job; whatever goes wrong becomes a Failed event, and the worker goes on."""
        lease = Lease(self._pool)
        try:
            self._answer(job, lease)
        except APIError as e:
            job.emit(Failed(e))
        except BaseException as e:  # nothing one request does may end the worker (SystemExit included)
            # The failure may have hit inside a decoder step: start its caches afresh.
            self._reset(lease.decoder)
            if isinstance(e, SpecrunError):
                job.emit(Failed(_refusal(e)))
            else:
                log.exception("request %s failed", job.id)
                job.emit(Failed(APIError(500, f"internal error ({type(e).__name__}); the server logged it")))

        finally:
            lease.give_back()

    def _reset(self, decoder=None) -> None:
        """Empty a decoder's caches (none before the job took one) and the conversation memory."""
        try:
            if decoder is not None:
                decoder.reset()
        finally:
            with self._lock:
                self._memory.forget()

    def _answer(self, job: Job, lease: Lease) -> None:
        rt = self.runtime
        read = job.read or self._read(job)  # read on arrival, or now (a job relayed from another process)
        prompt, rendered, limit, tools = read.tokens, read.rendered, read.max_tokens, read.tools
        parser = None
        if rendered is not None:
            parser = reasoning.parser_for(rt.chat_format.template, rendered,
                                          job.prompt.reasoning_format or self.chat.reasoning_format)
        asked = job.request.max_tokens
        params, shaped_by = self._params(job, tools)
        # Last: from here on the other requests' passes wait for this one's first (runtime.pool).
        decoder = lease.take(prompt)
        reused = decoder.cache.reused(prompt, params)
        started = Started(len(prompt), reused, limit, asked, queue_s=job.started_at - job.queued_at)
        if started.capped:
            ui.dim(f"{job.id}: max_tokens {asked} lowered to {limit} to fit the {rt.n_ctx}-token context")
        job.emit(started)
        try:
            generated, finish, stats = self._decode(job, decoder, prompt, limit, params, parser,
                                                    hold_text=tools is not None)
        except GrammarError as e:  # llguidance gave up mid-answer: the answer is no answer
            self._reset(decoder)  # raised inside a step, which may have left half of it behind
            raise APIError(400, str(e), param=shaped_by, code="grammar_failed") from None
        eog = decoder.eog
        lease.give_back()  # decoding is over: the next request may take this decoder now
        if job.cancel.is_set():  # (nothing to remember: the client never saw the whole answer)
            if self._stopping.is_set():
                job.emit(Failed(shutting_down()))
            else:
                job.emit(Finished("cancelled", len(generated), stats))
            _log_job(job, started, stats, "cancelled")
            return
        self._remember(rendered, finish, prompt, generated)
        reason = FINISH_REASONS.get(finish or "length", "length")
        content, calls = None, None
        if tools is not None:  # the answer was held back: its calls become tool_calls
            answer = rt.target.detokenize([t for t in generated if t not in eog], special=True)
            content, calls = tools.format.parse(answer)
            if calls:
                reason = "tool_calls"
            else:
                content = rt.target.detokenize([t for t in generated if t not in eog])
            if parser is not None and content:  # thinking before the call (or the answer) goes apart
                content = _split_thinking(job, parser, content)
        # The log line first: a client holding its answer finds the line written (a server
        # stopped right after the answer lost it once, under a busy machine).
        _log_job(job, started, stats, finish or "length")
        job.emit(Finished(reason, len(generated), stats, content, calls or None))

    def _tools(self, prompt: ChatPrompt | TextPrompt) -> ToolUse | None:
        """Return the tools this request's answer may call, as the model writes calls (None: it
        calls none)."""
        if not isinstance(prompt, ChatPrompt) or not prompt.tools:
            return None
        fmt = tool_format(self.runtime.chat_format.template)
        if fmt is None:
            raise APIError(400, "the model's chat template has no tool support, so it cannot be given tools",
                           param="tools", code="unsupported_parameter")
        if prompt.tool_choice == "none":
            return None
        functions = [t["function"] for t in prompt.tools]
        if prompt.tool_choice.startswith("function:"):
            functions = [f for f in functions if f["name"] == prompt.tool_choice.removeprefix("function:")]
        return ToolUse(fmt, tuple(functions), forced=prompt.tool_choice != "auto")

    def _params(self, job: Job, tools: ToolUse | None) -> tuple[SamplingParams, str]:
        """Return the job's sampling settings with its grammar compiled for the target's vocabulary,
        and the request field that asked for the grammar (named if it fails)."""
        model = self.runtime.target
        for token, _ in job.request.logit_bias:
            if token >= model.n_vocab:
                raise APIError(400, f"logit_bias: token id {token} is not below the vocabulary size {model.n_vocab}",
                               param="logit_bias", code="invalid_value")
        field = "tool_choice" if tools is not None and tools.forced else job.constraint_field
        try:
            compiled = job.request.compile_grammar(model, tools)
        except UsageError as e:
            raise APIError(400, str(e), param=field, code="invalid_value") from None
        return job.request.sampling(compiled), field

    def _prompt_tokens(self, prompt: ChatPrompt | TextPrompt) -> tuple[list[int], str | None]:
        """Return the prompt's tokens, and for a chat the rendered text they spell."""
        rt = self.runtime
        if isinstance(prompt, ChatPrompt):
            refuse_what_cannot_fit(prompt.messages, rt.n_ctx, rt.target.max_token_bytes)
            fmt = rt.chat_format
            extra = {"tools": prompt.tools} if prompt.tools else {}
            rendered = fmt.render(prompt.messages, add_generation_prompt=True, **prompt.template_kwargs, **extra)
            with self._lock:
                return self._memory.tokens_for(fmt, rendered), rendered.text
        if prompt.token_ids is not None:
            n_vocab = rt.target.n_vocab
            if any(t >= n_vocab for t in prompt.token_ids):
                raise APIError(400, f"token ids must be below the vocabulary size {n_vocab}", param="prompt")
            return list(prompt.token_ids), None
        return rt.target.tokenize(prompt.text, add_special=True, parse_special=prompt.parse_special), None

    def _decode(self, job: Job, decoder, prompt: list[int], limit: int, params, parser: ReasoningParser | None,
                hold_text: bool = False) -> tuple[list[int], str | None, GenerationStats]:
        """Stream the answer's text to the job (thinking apart when a parser splits it; nothing
        while it is held back for tool calls); return the
        generated tokens, the finish reason and the stream's figures."""
        rt = self.runtime
        generated: list[int] = []
        finish = None
        stats = GenerationStats(n_prompt=len(prompt))  # the stream's, from its first chunk on
        eog = decoder.eog
        chunks = stream(decoder, rt.target, prompt, params, limit, job.request.stop)
        try:
            for chunk in chunks:
                stats = chunk.stats
                generated.extend(chunk.tokens)
                logprobs = None
                if chunk.logprobs:  # the end-of-turn token is no part of the answer
                    logprobs = logprob_json(rt.target, [lp for lp in chunk.logprobs if lp.token not in eog]) or None
                if (chunk.text or logprobs) and not hold_text:
                    _emit_text(job, chunk.text, parser, logprobs)
                elif logprobs:  # the text is held back (it may be a tool call); its log-probs are not
                    job.emit(Piece("", logprobs=logprobs))
                finish = chunk.finish_reason or finish
                if job.cancel.is_set():
                    break
        finally:
            chunks.close()  # between steps: the caches hold exactly the committed tokens
        if parser is not None and not hold_text:
            split = parser.finish()
            if split:
                job.emit(Piece(split.content, split.reasoning))
        return generated, finish, stats

    def _remember(self, rendered: str | None, finish: str | None, prompt: list[int], generated: list[int]) -> None:
        """Keep a finished chat's text and tokens for its next turn (not after a stop string: the
        client never saw the text after it, so its next turn will not start with it)."""
        if rendered is None or finish == "stop":
            return
        answer = self.runtime.target.detokenize(generated, special=True)
        with self._lock:
            self._memory.remember(rendered + answer, prompt + generated)


def describe(rt: Runtime) -> str:
    """Return the line that says what is being served, as `specrun chat` says it."""
    at_once = f", {len(rt.decoders)} requests at once" if len(rt.decoders) > 1 else ""
    at_once += ", a KV cache each (--kv-split)" if rt.plan.target_ctx.split else ""
    at_once += ", prompts in the passes of their steps (--throughput)" if rt.prompts_join else ""
    at_once += ", the output layer on this machine (--head)" if rt.plan.head_here else ""
    ctx = rt.plan.target_ctx
    at_once += f", flash attention {ctx.flash_attn} ({'as timed on this CPU' if rt.plan.attention_why else '--flash-attn'})" if ctx.flash_attn is not None else ""
    at_once += f", {ctx.kv_type} KV cache (--kv-type)" if ctx.kv_type is not None else ""
    return f"specrun serve: {rt.models.target_name} {rt.drafting()}, {rt.n_ctx}-token context ({rt.plan.ctx_why}){at_once}"


def _refusal(error: SpecrunError) -> APIError:
    """Return a request's error as its answer: a 400 for what the request asked (a usage error), a 500 otherwise."""
    return APIError(400 if getattr(error, "exit_code", 1) == 2 else 500, str(error))


def loading() -> APIError:
    return APIError(503, "the model is still loading", code="model_loading", headers={"Retry-After": "5"})


def _emit_text(job: Job, text: str, parser: ReasoningParser | None, logprobs: list[dict] | None = None) -> None:
    if parser is None:
        job.emit(Piece(text, logprobs=logprobs))
        return
    split = parser.feed(text)
    if split or logprobs:
        job.emit(Piece(split.content if split else "", split.reasoning if split else "", logprobs))


def _split_thinking(job: Job, parser: ReasoningParser, text: str) -> str:
    """Emit a held-back answer's thinking as a piece of its own; return the rest of the text."""
    parts = [parser.feed(text), parser.finish()]
    reasoning_text = "".join(p.reasoning for p in parts if p)
    if reasoning_text:
        job.emit(Piece("", reasoning_text))
    return "".join(p.content for p in parts if p)


def _model_info(rt: Runtime) -> ModelInfo:
    path = rt.models.target_path
    return ModelInfo(
        rt.models.target_name, rt.models.draft_name if rt.draft is not None else None, rt.plan.drafter,
        rt.n_ctx, rt.shape.budget if rt.speculative else None, n_ctx_train=rt.target.n_ctx_train,
        ctx_why=rt.plan.ctx_why, architecture=rt.target.architecture, file_name=path.name if path else "",
        file_bytes=rt.target.file_size, chat_template=rt.chat_format.template,
        size_label=rt.target.meta("general.size_label") or "", modified=path.stat().st_mtime if path else 0.0,
        throughput=rt.prompts_join,
    )


def _log_job(job: Job, started: Started, stats: GenerationStats, finish: str) -> None:
    """One stderr line per answered request: prompt reuse, speed, acceptance, how it ended."""
    line = f"{job.id}: prompt {started.n_prompt} tokens ({started.n_cached} cached) · {stats.n_generated} tokens"
    if stats.tokens_per_s is not None:  # (none for one token: no decoding pass to time)
        line += f" · {stats.tokens_per_s:.1f} tok/s"
    if stats.n_passes:
        line += f" · {stats.accepted_per_pass:.2f} accepted/pass"
    ui.dim(f"{line} · {finish}")
    if ties := stats.near_ties:
        ui.dim(f"{job.id}: {len(ties)} near-tie{'s' if len(ties) > 1 else ''}, the closest by "
               f"{min(tie.gap for tie in ties):.4f} nats: greedy tokens a pass of another shape may choose otherwise")
    if log.isEnabledFor(logging.INFO) and (network := rpc.round_trips_now()):
        log.info("%s: %s", job.id, network)  # a slow worker's link shows here
