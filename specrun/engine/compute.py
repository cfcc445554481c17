"""Every llama.cpp pass of this process runs in one thread of its own, one pass at a time.

Two reasons, both measured on a 2-core CPU:
- Two passes at once on the same cores run many times slower than one after the other
  (llama.cpp's CPU threads spin while they wait for work), so passes take turns.
- ggml runs a pass's CPU work in an OpenMP team, and libgomp keeps one team for each thread that
  ever started one. Once a second thread has run a pass (the server's requests each decode in a
  thread of their own; generate loads and checks in the main thread), libgomp manages more threads
  than there are cores and shortens its spin-waits at every barrier: each pass then sleeps and
  wakes at every one of its ops. The demo pair's 5-token target pass took 60 ms from a thread
  other than the first against 40 ms from the first, and a request served beside seven idle lanes
  decoded at 24 tokens/s against 44 with one lane. One thread for all passes keeps one team.

`run(fn, *args)` hands a pass to that thread and waits for it. `start_beside(fn, *args)` runs a
pass of a context whose work is elsewhere (a target wholly on a GPU or on RPC workers: this
machine's cores wait for it) in a second thread, so that the compute thread runs other passes
meanwhile (the draft model's next nodes while the target verifies: SpecExec's regime); its
context runs one CPU thread (Context.use_one_thread), which starts no OpenMP team there.

A Ctrl-C that lands while a pass runs is raised once the pass has ended, as when the pass ran in
the caller's own thread (the caches are never edited under a pass that is still running). The
threads are daemons, not a ThreadPoolExecutor's workers, which interpreter exit joins: a pass
that never returns (an RPC worker that stopped answering) must not keep the process from exiting.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Job:
    __slots__ = ("fn", "args", "result", "error", "done")

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()


_jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start = threading.Lock()
_beside_jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
_beside_thread: threading.Thread | None = None


def _serve(jobs: queue.SimpleQueue[Job]) -> None:
    while True:
        job = jobs.get()
        try:
            job.result = job.fn(*job.args)
        except BaseException as e:  # handed back to the caller, raised there
            job.error = e
        job.done.set()


def _compute_thread() -> threading.Thread:
    global _thread
    with _start:
        if _thread is None:
            _thread = threading.Thread(target=_serve, args=(_jobs,), name="specrun-compute", daemon=True)
            _thread.start()
        return _thread


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it starts a compute thread of its own."""
    global _jobs, _thread, _start, _beside_jobs, _beside_thread
    _jobs, _thread, _start = queue.SimpleQueue(), None, threading.Lock()
    _beside_jobs, _beside_thread = queue.SimpleQueue(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def run(fn: Callable[..., T], *args: Any) -> T:
    """Return fn(*args), called in the process's compute thread (see the module doc)."""
    thread = _compute_thread()
    if threading.current_thread() is thread:
        return fn(*args)
    job = Job(fn, args)
    _jobs.put(job)
    return finish(job)


def start_beside(fn: Callable[..., Any], *args: Any) -> Job:
    """Start fn(*args) in the thread for passes whose work runs elsewhere (see the module doc) and
    return at once; `finish` waits for it, its `done` event says when it has ended."""
    global _beside_thread
    with _start:
        if _beside_thread is None:
            _beside_thread = threading.Thread(target=_serve, args=(_beside_jobs,), name="specrun-beside", daemon=True)
            _beside_thread.start()
    job = Job(fn, args)
    _beside_jobs.put(job)
    return job


def finish(job: Job) -> Any:
    """Wait for a job handed to a pass thread; return its result or raise its error."""
    interrupted = False
    while True:
        try:
            job.done.wait()
            break
        except KeyboardInterrupt:  # raised once the pass has ended (see the module doc)
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    if job.error is not None:
        raise job.error
    return job.result
