"""The generation worker in a child process, for a target spread over RPC workers (--rpc).

llama.cpp's RPC client ends the whole process when a worker's connection breaks mid-pass
(engine.rpc). Served in a child, that ends only the child: the answer in progress gets an error
naming the worker that went away (the child says which before it ends), the HTTP server stays up,
and the next request waits while a new child loads the models again, reconnecting to the workers.

The parent keeps GenerationWorker's queue (QueueWorker) and relays as many jobs at once as the
child decodes (its `--parallel` lanes) to the child's GenerationWorker over one pipe: each job's
prompt there as the job arrives, read and checked at once (a prompt that cannot fit is refused
then, not at its turn), the job at its turn, its events back by the job's id (one thread reads the
pipe and hands each event to its job's relay), a cancel when the client leaves. A lost worker
ends every answer in flight, each with the error that names it; the first relay to see it loads
the models again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection

from specrun import ui
from specrun.chat.reasoning import ChatSettings
from specrun.engine import rpc
from specrun.errors import SpecrunError
from specrun.runtime.options import RunOptions
from specrun.server.heap import bound_malloc_arenas
from specrun.server.jobs import POLL_S, Failed, Finished, Job, ReadPrompt, shutting_down
from specrun.server.schemas import APIError
from specrun.server.worker import GenerationWorker, QueueWorker

log = logging.getLogger("specrun.server")

# How long a child has to end after it was told to stop, before it is killed.
CHILD_STOP_S = 30.0
# Seconds the parent waits for the child to say what its memory of answers holds (/v1/models).
MEMORY_WAIT_S = 2.0
# Jobs the child's worker may hold waiting (the parent admits no more than its lanes at once).
_CHILD_QUEUE = 64
# A job's fields that stay with the parent's event loop; the others travel to the child.
_LOOP_FIELDS = ("loop", "events", "cancel")


class IsolatedWorker(QueueWorker):
    """QueueWorker whose models live in a child process, loaded again after the child is lost."""

    def __init__(self, opts: RunOptions, queue_size: int, on_ready, on_load_error, chat: ChatSettings,
                 verbose: bool = False, reproducible: bool = False):
        super().__init__(queue_size, on_ready, on_load_error, reproducible)
        self.opts, self.chat, self.verbose = opts, chat, verbose
        self._child: _Child | None = None
        self._child_lock = threading.Lock()  # held while a child is replaced: the relays wait for it

    def _load(self) -> str:
        self._child = _Child.start(self.opts, self.chat, self.verbose, self._stopping)
        if self._child is None:  # stopped while loading
            return ""
        self.model, self.parallel = self._child.model, self._child.parallel
        return self._child.description

    def _unload(self) -> None:
        if self._child is not None:
            self._child.stop()

    async def _read_on_arrival(self, job: Job) -> None:
        """Have the child read the job's prompt as it arrives: one that cannot be answered (it does
        not fit the context, ...) is refused at once, not at its turn, after the answers before
        it. Where there is no child now (loading again), at its turn."""
        child = self._child
        if child is not None:
            job.read = await asyncio.to_thread(child.read, job)

    def answers_memory(self) -> dict | None:
        """The child's memory of earlier answers (decoding.memory.OutputMemory.stats), or None
        where there is no child to ask (loading again) or it does not answer in time."""
        child = self._child
        return child.memory() if child is not None else None

    def _serve(self, job: Job) -> None:
        with self._child_lock:
            if self._child is None and not self._reload(job):
                return
            child = self._child
        try:
            lost = child.answer(job, self._stopping)
        except Exception:  # nothing one request does may end the relay (a job that cannot travel, ...)
            log.exception("request %s failed", job.id)
            job.emit(Failed(APIError(500, "internal error; the server logged it")))
            return
        if lost is None:
            return
        job.emit(Failed(APIError(502, lost, code="rpc_worker_lost")))
        with self._child_lock:
            if self._child is not child:  # another answer in flight saw it first and reloaded
                return
            ui.warn(f"{job.id}: {lost}; loading the model again for the next request")
            child.stop()
            self._child = None
            self._reload(None)  # now, so that the next request need not wait for it

    def _reload(self, job: Job | None) -> bool:
        """Load the models in a new child; where that fails, say why to the job waiting for it
        (or on stderr) and return False: the next request tries again."""
        try:
            self._child = _Child.start(self.opts, self.chat, self.verbose, self._stopping)
        except SpecrunError as e:
            if job is None:
                ui.warn(f"the model could not be loaded again ({e}): the next request tries again")
            else:
                job.emit(Failed(APIError(503, f"the model could not be loaded again: {e}", code="rpc_worker_lost",
                                         headers={"Retry-After": "10"})))
            return False
        if self._child is None and job is not None:
            job.emit(Failed(shutting_down()))
        return self._child is not None


@dataclass
class _Child:
    """One child process with its loaded models, and the thread that reads its pipe."""

    process: multiprocessing.Process
    conn: Connection
    model: object  # worker.ModelInfo
    description: str
    parallel: int = 1  # jobs its worker answers at once
    lost: str | None = None  # why it was lost, once it is (a worker gone, the process ended)

    def __post_init__(self):
        self._send_lock = threading.Lock()
        self._routes: dict[str, queue.SimpleQueue] = {}  # a job in flight's events, by its id
        self._routes_lock = threading.Lock()
        self._asked = itertools.count()  # (each question for the memory's figures, a route of its own)

    @classmethod
    def start(cls, opts: RunOptions, chat: ChatSettings, verbose: bool, stopping: threading.Event) -> _Child | None:
        """Start a child and return it once its models are loaded (None: the server stopped
        meanwhile); raise its load error."""
        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_child_main, args=(child_end, opts, chat, verbose),
                                  name="specrun-generation", daemon=True)
        process.start()
        child_end.close()
        child = cls(process, parent_end, None, "")
        while True:
            message = child._receive(stopping)
            if message is None:
                child.stop()
                if stopping.is_set():
                    return None
                raise SpecrunError(f"the generation process ended while loading (exit {process.exitcode})")
            kind, reason, *rest = message
            if kind == "ready":
                child.model, (child.description, child.parallel) = reason, rest
                threading.Thread(target=child._pump, name="specrun-relay", daemon=True).start()
                return child
            child.stop()
            raise reason if kind == "load_error" else SpecrunError(reason)  # "lost": a worker went away

    @contextlib.contextmanager
    def _route(self, key: str):
        """For the while: the queue the pump hands the child's messages for `key` to (it puts
        None there once the child is lost), or None where the child is lost already."""
        route: queue.SimpleQueue = queue.SimpleQueue()
        with self._routes_lock:
            if self.lost is not None:
                yield None
                return
            self._routes[key] = route
        try:
            yield route
        finally:
            with self._routes_lock:
                self._routes.pop(key, None)

    def answer(self, job: Job, stopping: threading.Event) -> str | None:
        """Relay one job to the child and its events back; return why the child was lost, or None."""
        with self._route(job.id) as route:
            if route is None:
                return self.lost
            if not self._send(("job", _travelling(job))):
                return self._ended()
            cancel_sent = False
            while True:
                if job.cancel.is_set() and not cancel_sent:
                    self._send(("cancel", job.id))  # (gone: the pump says so)
                    cancel_sent = True
                try:
                    event = route.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if event is None:  # the child was lost
                    return self.lost
                if stopping.is_set() and isinstance(event, Finished) and event.finish_reason == "cancelled":
                    event = Failed(shutting_down())
                job.emit(event)
                if isinstance(event, (Finished, Failed)):
                    return None

    def read(self, job: Job) -> ReadPrompt | None:
        """The job's prompt as the child's worker reads it (GenerationWorker.read_arriving); raise
        its refusal; None where the child is lost meanwhile (the prompt is read at its turn)."""
        with self._route(f"read:{job.id}") as route:
            if route is None or not self._send(("read", _travelling(job))):
                return None
            read = route.get()  # (the pump puts None there once the child is lost)
        if isinstance(read, APIError):
            raise read
        return read

    def memory(self) -> dict | None:
        """What the child's memory of answers holds (None: it is lost, or does not say within
        MEMORY_WAIT_S)."""
        key = f"memory:{next(self._asked)}"
        with self._route(key) as route:
            if route is None or not self._send(("memory", key)):
                return None
            try:
                return route.get(timeout=MEMORY_WAIT_S)
            except queue.Empty:
                return None

    def _send(self, message) -> bool:
        """Send a message to the child; False where it is gone."""
        try:
            with self._send_lock:
                self.conn.send(message)
            return True
        except OSError:
            return False

    def _pump(self) -> None:
        """Hand each event the child sends to its job's relay (an event of a job nobody relays any
        more, the rest of a cancelled answer, is dropped); once the child is lost, tell them all."""
        while True:
            message = self._receive(None)
            if message is None:
                lost = self._ended()
                break
            kind, *payload = message
            if kind == "lost":
                lost = payload[0]
                break
            job_id, event = payload
            with self._routes_lock:
                route = self._routes.get(job_id)
            if route is not None:
                route.put(event)
        with self._routes_lock:
            self.lost = lost
            for route in self._routes.values():
                route.put(None)

    def _ended(self) -> str:
        """Return why a job got no answer from a child that is gone (without a word)."""
        self.process.join(CHILD_STOP_S)
        return f"the generation process ended (exit {self.process.exitcode}) in the middle of the answer"

    def _receive(self, stopping: threading.Event | None):
        """Return the child's next message; None once the child is gone (or, while loading, once
        the server stops)."""
        while True:
            try:
                if self.conn.poll(POLL_S):
                    return self.conn.recv()
            except (EOFError, OSError):
                return None
            if not self.process.is_alive() and not self.conn.poll(0):
                return None
            if stopping is not None and stopping.is_set():
                return None

    def stop(self) -> None:
        """Tell the child to let its models go and end; kill it if it does not."""
        self._send(("stop",))
        self.process.join(CHILD_STOP_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


# ---------------------------------------------------------------------------------------------
# The child


class _PipedJob(Job):
    """A job in the child: its events go back through the pipe."""

    def __init__(self, conn: Connection, lock: threading.Lock, jobs: dict, **job_fields):
        super().__init__(loop=None, **job_fields)
        self._conn, self._lock, self._jobs = conn, lock, jobs

    def emit(self, event) -> None:
        with self._lock:
            self._conn.send(("event", self.id, event))
        if isinstance(event, (Finished, Failed)):
            self._jobs.pop(self.id, None)


def _travelling(job: Job) -> dict:
    """The job's fields that travel to the child."""
    return {f.name: getattr(job, f.name) for f in fields(Job) if f.name not in _LOOP_FIELDS}


def _read_arriving(worker: GenerationWorker, send, job_fields: dict) -> None:
    """Read an arriving job's prompt (in a thread of its own: the pipe's reader goes on) and send
    back what it reads as, or its refusal; None where reading it failed otherwise (read again at
    its turn, where the failure is answered as any)."""
    job = Job(loop=None, **job_fields)
    try:
        read = worker.read_arriving(job)
    except APIError as e:
        read = e
    except Exception:
        log.exception("reading the prompt of %s failed", job.id)
        read = None
    send(("event", f"read:{job.id}", read))


def _child_main(conn: Connection, opts: RunOptions, chat: ChatSettings, verbose: bool) -> None:
    """Load the models, answer the jobs the parent sends, end when it says stop (or is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    bound_malloc_arenas()  # the answers decode in this process's threads
    ui.setup_logging(verbose)
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    rpc.on_lost_worker(lambda message: send(("lost", message)))
    # (The parent sends no more jobs at once than the worker answers at once: the queue holds a
    # job whose predecessor's answer has ended but whose lane is not yet free.)
    worker = GenerationWorker(opts, _CHILD_QUEUE, lambda w, description: send(("ready", w.model, description, w.parallel)),
                              lambda error: send(("load_error", _portable(error))), chat)
    worker.start()
    jobs: dict[str, _PipedJob] = {}
    try:
        while True:
            kind, *rest = conn.recv()
            if kind == "stop":
                break
            if kind == "job":
                job = _PipedJob(conn, lock, jobs, **rest[0])
                jobs[job.id] = job
                try:
                    worker.submit(job)
                except APIError as e:
                    job.emit(Failed(e))
            elif kind == "read":
                threading.Thread(target=_read_arriving, args=(worker, send, rest[0]), daemon=True).start()
            elif kind == "memory":  # (the route's key: the parent's question)
                memory = getattr(worker.runtime, "memory", None)  # (loaded: the parent asks only once it is ready)
                send(("event", rest[0], memory.stats() if memory is not None else None))
            elif kind == "cancel" and rest[0] in jobs:
                jobs[rest[0]].cancel.set()
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        worker.stop()
        worker.join()


def _portable(error: BaseException) -> SpecrunError:
    """Return a load error that survives the pipe (a SpecrunError as it is; anything else as one line)."""
    if isinstance(error, SpecrunError):
        return error
    return SpecrunError(f"unexpected {type(error).__name__} while loading: {error}")

