"""llama.cpp's process-wide state: one-time backend setup, its log lines, version, file checks.

Also the base of every owner object: each C pointer is freed exactly once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import deque
import sys
from pathlib import Path


def _cxx_runtime_first() -> None:
    """Put the system's C++ runtime in the process's global symbol scope before llama.cpp's
    libraries: llama-cpp-python loads them with RTLD_GLOBAL, and a CUDA build's libggml-cuda
    exports copies of libstdc++'s stream templates. Loaded first, those copies serve every
    library's calls, with static locale ids of their own: llama.cpp's model summary then
    formats a number through the wrong locale facet and the load segfaults (seen on an H200
    with the pinned llama-cpp-python built with -DGGML_CUDA=on; LD_PRELOAD of libstdc++ cured it).
    Python itself does not link libstdc++, so without this nothing puts the real one first."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
        except OSError:  # no libstdc++ here: llama.cpp's libraries bring the one they need
            pass


_cxx_runtime_first()

import llama_cpp as C  # noqa: E402  (after the C++ runtime: see _cxx_runtime_first)

from specrun.errors import ModelFileError

log = logging.getLogger("specrun.llama")

GGUF_MAGIC = b"GGUF"

# --------------------------------------------------------------------------------------------
# Logging: llama.cpp prints through one global callback. We keep the recent error lines so a
# failed load can say *why* in its exception message.

_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
recent_errors: deque[str] = deque(maxlen=8)
_last_level = [logging.INFO]
_backend_lock = threading.Lock()
_backend_ready = False
# Lists collecting every log line while captured_log() blocks run (engine.memory reads them).
_captures: list[list[str]] = []
_quiet = 0  # captures that keep llama.cpp's lines out of `logging`


# A Ctrl-C that lands while llama.cpp runs our callback cannot cross the C code back to Python
# (ctypes prints and drops it), so the callback keeps it here and raise_if_interrupted() raises
# it once the C call has returned.
_interrupted = threading.Event()


@C.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    try:
        _log(level, text)
    except KeyboardInterrupt:
        _interrupted.set()


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt that arrived inside a llama.cpp callback, if one did."""
    if _interrupted.is_set():
        _interrupted.clear()
        raise KeyboardInterrupt


def _log(level: int, text: bytes) -> None:
    if level == 5:  # GGML_LOG_LEVEL_CONT continues the previous line at its level
        py_level = _last_level[0]
    else:
        py_level = _LEVELS.get(level, logging.DEBUG)
        _last_level[0] = py_level
    message = text.decode("utf-8", errors="replace").rstrip("\n")
    if not message.strip():
        return
    for lines in _captures:
        lines.append(message)
    if _quiet:
        return
    if py_level >= logging.WARNING:
        recent_errors.append(message.strip())
    if log.isEnabledFor(py_level):
        log.log(py_level, "%s", message)


@contextlib.contextmanager
def captured_log(quiet: bool = False):
    """Collect every llama.cpp log line (all levels) written while the block runs, in a list;
    `quiet` keeps them out of `logging` meanwhile (a simulated load is not the run's).

    llama.cpp states what it allocates (model, KV, recurrent state, compute and output buffers)
    only in its log: engine.memory reads the figures from these lines.
    """
    global _quiet
    lines: list[str] = []
    with _backend_lock:
        _captures.append(lines)
        _quiet += quiet
    try:
        yield lines
    finally:
        with _backend_lock:
            # (by identity: a capture nested in another, their lines alike, must not take its place)
            del _captures[next(i for i, other in enumerate(_captures) if other is lines)]
            _quiet -= quiet


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and route its logs into `logging`."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        C.llama_log_set(_log_callback, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def last_llama_error(default: str) -> str:
    lines = [line for line in recent_errors if line]
    recent_errors.clear()
    return lines[-1] if lines else default


def llama_version_info() -> str:
    """Return a string identifying the llama.cpp build (package version + system info)."""
    return f"llama-cpp-python {C.__version__}"


# --------------------------------------------------------------------------------------------
# Model


def check_gguf_file(path: Path) -> Path:
    """Return the path if it looks like a readable GGUF file; raise ModelFileError otherwise."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFileError(f"model path is a directory, not a GGUF file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF model file (bad magic {magic!r}): {path}")
    return path



class Owner:
    """Frees its C pointer exactly once: on close(), leaving a with-block, or garbage collection."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass
