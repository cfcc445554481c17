"""Is a GGUF file whole? Its header says where every tensor's data ends; the file must reach there.

llama.cpp refuses a truncated file with a generic "failed to load model"; reading the header with
ggml's own GGUF reader (metadata only, no tensor data) lets specrun say what is wrong. libggml
ships beside libllama; llama-cpp-python does not bind these functions, so a few ctypes
declarations do.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path

from specrun.engine.backend import check_gguf_file, recent_errors
from specrun.engine.devices import ggml_lib
from specrun.errors import EngineError, ModelFileError
from specrun.files import human_size, once_per_version


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_declared = None


def _gguf_lib():
    """Return libggml with the GGUF reader's functions declared, or None where it is not found."""
    global _declared
    if _declared is None:
        try:
            lib = ggml_lib()
            ptr, size_t, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
            for name, argtypes, restype in (
                ("gguf_init_from_file", [ctypes.c_char_p, _InitParams], ptr),
                ("gguf_free", [ptr], None),
                ("gguf_get_n_tensors", [ptr], i64),
                ("gguf_get_data_offset", [ptr], size_t),
                ("gguf_get_tensor_offset", [ptr, i64], size_t),
                ("gguf_get_tensor_size", [ptr, i64], size_t),
                ("gguf_get_tensor_name", [ptr, i64], ctypes.c_char_p),
                ("gguf_find_key", [ptr, ctypes.c_char_p], i64),
                ("gguf_get_val_str", [ptr, i64], ctypes.c_char_p),
            ):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            _declared = lib
        except (EngineError, AttributeError, OSError):
            _declared = False
    return _declared or None


def data_end(path: Path) -> int | None:
    """Return the byte offset where the file's last tensor ends, per its header.

    Raises ModelFileError when the header itself cannot be read (cut short or damaged); returns
    None when libggml's reader is not available here.
    """
    span = _data_span(path)
    return span[1] if span else None


def data_bytes(path: Path) -> int | None:
    """Return how many bytes the file's tensor data spans (what llama.cpp maps as the weights'
    buffer), None where libggml's reader is not available; ModelFileError for a damaged header."""
    span = _data_span(path)
    return span[1] - span[0] if span else None


def _data_span(path: Path) -> tuple[int, int] | None:
    """Return (where the tensor data starts, where the last tensor ends), from the header."""
    check_gguf_file(path)  # a missing file or one that is no GGUF at all says so plainly
    lib = _gguf_lib()
    if lib is None:
        return None
    recent_errors.clear()
    handle = lib.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
    if not handle:
        detail = recent_errors[-1] if recent_errors else "unreadable metadata"
        recent_errors.clear()
        raise ModelFileError(f"the GGUF header of {path} is cut short or damaged ({detail}); download or copy it again")
    try:
        start = lib.gguf_get_data_offset(handle)
        ends = [lib.gguf_get_tensor_offset(handle, i) + lib.gguf_get_tensor_size(handle, i)
                for i in range(lib.gguf_get_n_tensors(handle))]
        return start, start + max(ends, default=0)
    finally:
        lib.gguf_free(handle)


@contextmanager
def _header(path: Path):
    """Yield libggml's GGUF reader and a handle on the file's header, metadata only (the handle
    None where the reader is not available here or the header cannot be read)."""
    lib = _gguf_lib()
    if lib is None:
        yield None, None
        return
    handle = lib.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
    recent_errors.clear()
    if not handle:
        yield lib, None
        return
    try:
        yield lib, handle
    finally:
        lib.gguf_free(handle)


def _architecture(lib, handle) -> str | None:
    key = lib.gguf_find_key(handle, b"general.architecture")
    return lib.gguf_get_val_str(handle, key).decode("utf-8", "replace") if key >= 0 else None


def header_facts(path: Path) -> tuple[str | None, dict[str, int]]:
    """Return (general.architecture, {tensor name: bytes}) from a GGUF header; no weights are read.

    Returns (None, {}) where libggml's reader is not available or the header cannot be read.
    """
    with _header(path) as (lib, handle):
        if handle is None:
            return None, {}
        tensors = {lib.gguf_get_tensor_name(handle, i).decode("utf-8", "replace"): lib.gguf_get_tensor_size(handle, i)
                   for i in range(lib.gguf_get_n_tensors(handle))}
        return _architecture(lib, handle), tensors


@once_per_version(missing=False)
def has_sliding_window(path: Path) -> bool:
    """Whether a GGUF's header gives its attention a sliding window (`<arch>.attention.sliding_window`).
    Read once per version of the file in a process: a plan asks for every context it tries, and a
    large vocabulary's header takes 20 ms to read."""
    with _header(path) as (lib, handle):
        arch = _architecture(lib, handle) if handle is not None else None
        return arch is not None and lib.gguf_find_key(handle, f"{arch}.attention.sliding_window".encode()) >= 0


@once_per_version(missing=None)
def architecture(path: Path) -> str | None:
    """Return a GGUF's general.architecture from its header (None where it cannot be read), read
    once per version of the file in a process (every plan asks, for the target and the draft)."""
    with _header(path) as (lib, handle):
        return _architecture(lib, handle) if handle is not None else None


def check_complete_gguf(path: Path) -> Path:
    """Return path if it is a GGUF file at least as long as its header says; raise ModelFileError."""
    path = check_gguf_file(path)
    end = data_end(path)
    size = path.stat().st_size
    if end is not None and size < end:
        raise ModelFileError(
            f"{path} is shorter than its header says: {human_size(size)} ({size} bytes) of {human_size(end)} "
            f"({end} bytes); the file is truncated (an interrupted copy or download?): get it again"
        )
    return path


def has_mtp_layers(path: Path) -> bool:
    """Whether a GGUF carries MTP (nextn) layers, from its header's tensor names; no weights read."""
    return any(".nextn." in name for name in header_facts(path)[1])
