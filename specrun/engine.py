"""The one module that talks to llama.cpp (through llama-cpp-python's low-level ctypes API).

Owner objects wrap each C pointer: they free it exactly once, work as context managers, and a
context is always closed before the model it was made from. Every return code is checked and
turned into a specrun exception with a readable message.

What llama-cpp-python does not offer and this module adds: batches whose tokens carry several
sequence ids (the tree "colours" that make one forward pass score a whole draft tree), logits as
zero-copy numpy views, and llama.cpp's log lines routed into Python `logging`.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

import llama_cpp as C

from specrun.errors import ContextFullError, EngineError, ModelFileError

log = logging.getLogger("specrun.llama")

# llama.cpp keeps at most this many sequences in one context; each tree leaf needs its own.
MAX_SEQ = 256
GGUF_MAGIC = b"GGUF"

_FTYPES = {"F32": C.LLAMA_FTYPE_ALL_F32, "F16": C.LLAMA_FTYPE_MOSTLY_F16, "Q8_0": C.LLAMA_FTYPE_MOSTLY_Q8_0}


# --------------------------------------------------------------------------------------------
# Logging: llama.cpp prints through one global callback. We keep the recent error lines so a
# failed load can say *why* in its exception message.

_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_recent_errors: deque[str] = deque(maxlen=8)
_last_level = [logging.INFO]
_backend_lock = threading.Lock()
_backend_ready = False


@C.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == 5:  # GGML_LOG_LEVEL_CONT continues the previous line at its level
        py_level = _last_level[0]
    else:
        py_level = _LEVELS.get(level, logging.DEBUG)
        _last_level[0] = py_level
    message = text.decode("utf-8", errors="replace").rstrip("\n")
    if not message.strip():
        return
    if py_level >= logging.WARNING:
        _recent_errors.append(message.strip())
    if log.isEnabledFor(py_level):
        log.log(py_level, "%s", message)


def _ensure_backend() -> None:
    """Initialise llama.cpp once per process and route its logs into `logging`."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        C.llama_log_set(_log_callback, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def _last_llama_error(default: str) -> str:
    lines = [line for line in _recent_errors if line]
    _recent_errors.clear()
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


def _cpu_has_amx() -> bool:
    """Return whether the CPU advertises Intel AMX (read once from /proc/cpuinfo on Linux)."""
    global _AMX
    if _AMX is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                _AMX = any(line.startswith("flags") and "amx_int8" in line for line in f)
        except OSError:
            _AMX = False
    return _AMX


_AMX: bool | None = None


class _Owner:
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


class Model(_Owner):
    """Owner of a llama_model (weights + vocabulary)."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, vocab_only: bool = False):
        _ensure_backend()
        self.path = check_gguf_file(Path(path))
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        if _cpu_has_amx():
            # ggml's AMX matmul (an "extra buffer type") crashes on multi-token batches of Q4_1
            # weights in the vendored llama.cpp; the plain CPU kernels are exact and safe.
            params.use_extra_bufts = False
        _recent_errors.clear()
        ptr = C.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            reason = _last_llama_error("llama.cpp could not load it")
            raise ModelFileError(f"cannot load model {self.path}: {reason}")
        self._ptr = ptr
        self._vocab = C.llama_model_get_vocab(ptr)
        self._contexts: list[Context] = []
        self.n_vocab = C.llama_vocab_n_tokens(self._vocab)
        self.vocab_type = C.llama_vocab_type(self._vocab)
        self.bos = C.llama_vocab_bos(self._vocab)
        self.eos = C.llama_vocab_eos(self._vocab)
        self.add_bos = bool(C.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(C.llama_vocab_get_add_eos(self._vocab))
        self._piece_buf = ctypes.create_string_buffer(256)
        self._eog: frozenset[int] | None = None

    # -- lifetime --
    @property
    def ptr(self):
        if self._ptr is None:
            raise EngineError(f"model {self.path.name} is already closed")
        return self._ptr

    def close(self) -> None:
        """Free the model (and any context still open on it) exactly once."""
        for ctx in list(self._contexts):
            ctx.close()
        if self._ptr is not None:
            C.llama_model_free(self._ptr)
            self._ptr = None

    # -- metadata --
    @property
    def n_layer(self) -> int:
        return C.llama_model_n_layer(self.ptr)

    @property
    def n_embd(self) -> int:
        return C.llama_model_n_embd(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        return C.llama_model_n_ctx_train(self.ptr)

    @property
    def n_swa(self) -> int:
        return C.llama_model_n_swa(self.ptr)

    @property
    def file_size(self) -> int:
        return self.path.stat().st_size

    def meta(self, key: str) -> str | None:
        """Return one GGUF metadata value as a string, or None when absent."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def metadata(self) -> dict[str, str]:
        """Return all GGUF metadata (except long arrays llama.cpp elides) as strings."""
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(C.llama_model_meta_count(self.ptr)):
            n = C.llama_model_meta_key_by_index(self.ptr, i, buf, len(buf))
            if n < 0:
                continue
            key = buf.value.decode("utf-8", errors="replace")
            out[key] = self.meta(key) or ""
        return out

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def name(self) -> str:
        return self.meta("general.name") or self.path.stem

    @property
    def chat_template(self) -> str | None:
        ptr = C.llama_model_chat_template(self.ptr, None)
        return ptr.decode("utf-8", errors="replace") if ptr else None

    # -- vocabulary --
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Return token ids for `text`; add_special adds BOS when the model asks for it."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
            if n < 0:
                raise EngineError(f"tokenization failed for a text of {len(data)} bytes")
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """Return the bytes a token stands for (special tokens render empty unless special=True)."""
        buf = self._piece_buf
        n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def token_text(self, token: int) -> bytes:
        """Return the token's text as stored in the vocabulary (for comparing vocabularies)."""
        return C.llama_vocab_get_text(self._vocab, token) or b""

    def token_attr(self, token: int) -> int:
        return C.llama_vocab_get_attr(self._vocab, token)

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self._vocab, token))

    @property
    def eog_tokens(self) -> frozenset[int]:
        """Return every end-of-generation token id (EOS, EOT, <|im_end|>, ...)."""
        if self._eog is None:
            self._eog = frozenset(t for t in range(self.n_vocab) if C.llama_vocab_is_eog(self._vocab, t))
        return self._eog

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Return the text of a token sequence (concatenated pieces, decoded as UTF-8)."""
        return b"".join(self.token_to_piece(t, special) for t in tokens).decode("utf-8", errors="replace")

    def context(self, **kwargs) -> "Context":
        return Context(self, **kwargs)


def quantize(src: str | Path, dst: str | Path, ftype: str = "F32", threads: int = 0) -> None:
    """Convert a GGUF file to another precision with llama_model_quantize (e.g. Q4_1 -> F32)."""
    _ensure_backend()
    check_gguf_file(Path(src))
    if ftype not in _FTYPES:
        raise ValueError(f"unsupported ftype {ftype!r}; choose one of {sorted(_FTYPES)}")
    params = C.llama_model_quantize_default_params()
    params.ftype = _FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = threads
    _recent_errors.clear()
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise EngineError(f"converting {src} to {ftype} failed: {_last_llama_error(f'code {rc}')}")


# --------------------------------------------------------------------------------------------
# Batch


class Batch:
    """A llama_batch whose arrays are numpy buffers we own.

    Each token has a position, a list of sequence ids and a want-logits flag. The seq-id lists
    live in one (capacity x n_seq_max) int32 matrix so filling a whole tree is array work.
    """

    def __init__(self, capacity: int, n_seq_max: int = 1):
        self.capacity = int(capacity)
        self.n_seq_max = int(n_seq_max)
        self.tokens = np.zeros(self.capacity, dtype=np.int32)
        self.positions = np.zeros(self.capacity, dtype=np.int32)
        self.n_seq = np.ones(self.capacity, dtype=np.int32)
        self.seq_ids = np.zeros((self.capacity, self.n_seq_max), dtype=np.int32)
        self.want_logits = np.zeros(self.capacity, dtype=np.int8)
        row_ptrs = self.seq_ids.ctypes.data + np.arange(self.capacity, dtype=np.uint64) * (4 * self.n_seq_max)
        self._row_ptrs = (ctypes.POINTER(C.llama_seq_id) * self.capacity)(
            *[ctypes.cast(int(p), ctypes.POINTER(C.llama_seq_id)) for p in row_ptrs]
        )
        self.struct = C.llama_batch()
        self.struct.token = self.tokens.ctypes.data_as(ctypes.POINTER(C.llama_token))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self.positions.ctypes.data_as(ctypes.POINTER(C.llama_pos))
        self.struct.n_seq_id = self.n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self._row_ptrs, ctypes.POINTER(ctypes.POINTER(C.llama_seq_id)))
        self.struct.logits = self.want_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n_tokens = 0

    def __len__(self) -> int:
        return self.n_tokens

    def clear(self) -> None:
        self.n_tokens = 0

    def add(self, token: int, pos: int, seq_ids: Sequence[int] = (0,), logits: bool = False) -> None:
        """Append one token."""
        i = self.n_tokens
        if i >= self.capacity:
            raise EngineError(f"batch full ({self.capacity} tokens)")
        if not 1 <= len(seq_ids) <= self.n_seq_max:
            raise EngineError(f"a token carries {len(seq_ids)} sequence ids; this batch allows 1..{self.n_seq_max}")
        self.tokens[i] = token
        self.positions[i] = pos
        self.n_seq[i] = len(seq_ids)
        self.seq_ids[i, : len(seq_ids)] = seq_ids
        self.want_logits[i] = logits
        self.n_tokens = i + 1

    def set_sequence(self, tokens: Sequence[int], start_pos: int, seq_id: int = 0, logits: str = "last") -> None:
        """Fill the batch with a run of tokens in one sequence (prefill); logits 'last', 'all' or 'none'."""
        n = len(tokens)
        if n > self.capacity:
            raise EngineError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        self.tokens[:n] = tokens
        self.positions[:n] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self.n_seq[:n] = 1
        self.seq_ids[:n, 0] = seq_id
        self.want_logits[:n] = 1 if logits == "all" else 0
        if logits == "last" and n:
            self.want_logits[n - 1] = 1
        self.n_tokens = n

    def set_tree(self, tokens: np.ndarray, positions: np.ndarray, seq_lists: Sequence[Sequence[int]], logits: bool = True) -> None:
        """Fill the batch with tree nodes: one position and one list of seq ids (colours) per node."""
        n = len(tokens)
        if n > self.capacity:
            raise EngineError(f"tree of {n} nodes exceeds batch capacity {self.capacity}")
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        counts = np.fromiter((len(s) for s in seq_lists), dtype=np.int32, count=n)
        if n and (counts.min() < 1 or counts.max() > self.n_seq_max):
            raise EngineError(f"tree nodes carry 1..{counts.max()} seq ids; this batch allows 1..{self.n_seq_max}")
        self.n_seq[:n] = counts
        if n and counts.max() == 1:
            self.seq_ids[:n, 0] = [s[0] for s in seq_lists]
        else:
            rows = np.repeat(np.arange(n), counts)
            cols = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            self.seq_ids[rows, cols] = np.fromiter((c for s in seq_lists for c in s), dtype=np.int32, count=len(rows))
        self.want_logits[:n] = 1 if logits else 0
        self.n_tokens = n

    def set_arrays(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, logits: np.ndarray | bool = True) -> None:
        """Fill the batch with tokens that each carry exactly one seq id (given as an array)."""
        n = len(tokens)
        if n > self.capacity:
            raise EngineError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.n_seq[:n] = 1
        self.seq_ids[:n, 0] = seq_ids
        self.want_logits[:n] = logits
        self.n_tokens = n

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.clear()


# --------------------------------------------------------------------------------------------
# Context


def default_threads() -> int:
    """Return the thread count llama.cpp runs best with here: the usable CPU cores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Context(_Owner):
    """Owner of a llama_context: KV cache, decode, logits."""

    def __init__(
        self,
        model: Model,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_seq_max: int = 1,
        threads: int | None = None,
        flash_attn: str = "auto",
        swa_full: bool = True,
        kv_unified: bool = True,
    ):
        if n_seq_max > MAX_SEQ:
            raise EngineError(f"n_seq_max {n_seq_max} exceeds llama.cpp's limit of {MAX_SEQ}")
        self.model = model
        threads = threads or default_threads()
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        # One ubatch for the whole tree: split trees pay the weight transfer again when offloading.
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        # llama.cpp reserves at least one output row per sequence and aborts (not errors) when
        # that exceeds n_outputs_max, which defaults to n_batch.
        params.n_outputs_max = max(n_batch, n_seq_max)
        params.n_threads = threads
        params.n_threads_batch = threads
        params.flash_attn_type = {
            "auto": C.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "on": C.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": C.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        # Sliding-window caches drop old cells; rollback of a rejected tree needs them all.
        params.swa_full = swa_full
        # A split-per-sequence cache cannot hold tokens shared by several tree colours.
        params.kv_unified = kv_unified
        params.no_perf = True
        _recent_errors.clear()
        ptr = C.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise EngineError(f"cannot create a context for {model.path.name}: {_last_llama_error('out of memory?')}")
        self._ptr = ptr
        self._mem = C.llama_get_memory(ptr)
        self.n_ctx = C.llama_n_ctx(ptr)
        self.n_batch = C.llama_n_batch(ptr)
        self.n_seq_max = C.llama_n_seq_max(ptr)
        self.n_vocab = model.n_vocab
        self.threads = threads
        self._n_outputs = 0
        model._contexts.append(self)

    @property
    def ptr(self):
        if self._ptr is None:
            raise EngineError("context is already closed")
        return self._ptr

    def close(self) -> None:
        if self._ptr is not None:
            C.llama_free(self._ptr)
            self._ptr = None
            self._mem = None
            if self in self.model._contexts:
                self.model._contexts.remove(self)

    # -- decode --
    def decode(self, batch: Batch) -> None:
        """Run the model over the batch; raise on failure (the KV cache is then unchanged)."""
        n = batch.n_tokens
        if n == 0:
            raise EngineError("decode called with an empty batch")
        if n > self.n_batch:
            raise EngineError(f"batch of {n} tokens exceeds the context's n_batch {self.n_batch}")
        batch.struct.n_tokens = n
        rc = C.llama_decode(self.ptr, batch.struct)
        if rc != 0:
            if rc == 1:
                raise ContextFullError(f"the context ({self.n_ctx} tokens) has no room for {n} more tokens")
            if rc == 2:
                raise EngineError("decode was aborted")
            if rc == -1:
                raise EngineError(f"llama.cpp rejected the batch: {_last_llama_error('invalid batch')}")
            raise EngineError(f"decode failed with code {rc}: {_last_llama_error('fatal error')}")
        self._n_outputs = int(batch.want_logits[:n].sum())

    def logits(self) -> np.ndarray:
        """Return the (n_outputs x n_vocab) float32 logits of the last decode, zero-copy.

        Rows follow the order of the batch tokens that asked for logits. The view is valid only
        until the next decode.
        """
        ptr = C.llama_get_logits(self.ptr)
        if not ptr or self._n_outputs == 0:
            raise EngineError("no logits available: the last batch asked for none")
        return np.ctypeslib.as_array(ptr, shape=(self._n_outputs, self.n_vocab))

    def logits_row(self, i: int = -1) -> np.ndarray:
        """Return one row of the last decode's logits (by output index; -1 = last), zero-copy."""
        ptr = C.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise EngineError(f"no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    # -- KV cache --
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove seq's cells with positions in [p0, p1); raise if the cache cannot do it."""
        if not C.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise EngineError(
                f"{self.model.path.name}: its cache cannot drop part of a sequence "
                "(recurrent or hybrid models cannot roll back; speculation needs that)"
            )

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        C.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        C.llama_memory_seq_keep(self._mem, seq)

    def seq_pos_max(self, seq: int = 0) -> int:
        """Return the largest cached position of seq (-1 when empty)."""
        return C.llama_memory_seq_pos_max(self._mem, seq)

    def seq_pos_min(self, seq: int = 0) -> int:
        return C.llama_memory_seq_pos_min(self._mem, seq)

    def clear(self) -> None:
        C.llama_memory_clear(self._mem, True)

    def can_roll_back(self) -> bool:
        """Return whether the cache can drop the tail of a sequence (needed for speculation)."""
        probe_seq = 0
        end = self.seq_pos_max(probe_seq)
        return bool(C.llama_memory_seq_rm(self._mem, probe_seq, end + 1, -1))


# --------------------------------------------------------------------------------------------
# Detokenizer


class Detokenizer:
    """Turns a stream of token ids into text without ever splitting a UTF-8 character."""

    def __init__(self, model: Model, special: bool = False):
        self.model = model
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        """Return the text that became complete with this token (maybe empty)."""
        return self._decoder.decode(self.model.token_to_piece(token, self.special))

    def feed_many(self, tokens: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in tokens)

    def flush(self) -> str:
        """Return whatever is left (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


# --------------------------------------------------------------------------------------------
# Devices: llama-cpp-python does not bind libggml's device API, so a few ctypes declarations do.

# enum ggml_backend_dev_type (ggml-backend.h)
_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class DeviceInfo:
    """One compute device as libggml reports it: name, kind ('cpu', 'gpu', ...), memory in bytes."""

    __slots__ = ("name", "description", "kind", "backend", "free_bytes", "total_bytes")

    def __init__(self, name: str, description: str, kind: str, backend: str, free_bytes: int, total_bytes: int):
        self.name, self.description, self.kind, self.backend = name, description, kind, backend
        self.free_bytes, self.total_bytes = int(free_bytes), int(total_bytes)

    def to_dict(self) -> dict:
        return {slot: getattr(self, slot) for slot in self.__slots__}

    def __repr__(self) -> str:
        return f"DeviceInfo({self.to_dict()!r})"


_ggml = None


def _ggml_lib():
    """Return libggml (the copy libllama already loaded), with the device functions declared."""
    global _ggml
    if _ggml is not None:
        return _ggml
    _ensure_backend()
    lib_dir = Path(C.llama_cpp._lib._name).parent
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:
        raise EngineError(f"libggml not found beside libllama in {lib_dir}")
    ptr, size_t, char_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    signatures = {
        "ggml_backend_dev_count": ([], size_t),
        "ggml_backend_dev_get": ([size_t], ptr),
        "ggml_backend_dev_name": ([ptr], char_p),
        "ggml_backend_dev_description": ([ptr], char_p),
        "ggml_backend_dev_memory": ([ptr, ctypes.POINTER(size_t), ctypes.POINTER(size_t)], None),
        "ggml_backend_dev_type": ([ptr], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([ptr], ptr),
        "ggml_backend_reg_count": ([], size_t),
        "ggml_backend_reg_get": ([size_t], ptr),
        "ggml_backend_reg_name": ([ptr], char_p),
    }
    for fn_name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, restype
    _ggml = lib
    return lib


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", errors="replace") if raw else ""


def list_devices() -> list[DeviceInfo]:
    """Return every device llama.cpp can compute on (the CPU included), with its free/total memory."""
    lib = _ggml_lib()
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        devices.append(
            DeviceInfo(
                name=_text(lib.ggml_backend_dev_name(dev)),
                description=_text(lib.ggml_backend_dev_description(dev)).strip(),
                kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "unknown"),
                backend=_text(lib.ggml_backend_reg_name(reg)) if reg else "",
                free_bytes=free.value,
                total_bytes=total.value,
            )
        )
    return devices


def backend_names() -> list[str]:
    """Return the llama.cpp backends compiled in or loaded (e.g. ['CPU'], ['CUDA', 'CPU'])."""
    lib = _ggml_lib()
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def system_info() -> str:
    """Return llama.cpp's one-line CPU feature summary (SSE3 = 1 | AVX2 = 1 | ...)."""
    _ensure_backend()
    return _text(C.llama_print_system_info()).strip(" |")
