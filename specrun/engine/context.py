"""Contexts (KV cache + compute), batches whose tokens carry several sequence ids, detokenizing."""

from __future__ import annotations

import codecs
import ctypes
import os
import threading
import time
from typing import Iterable, Sequence

import llama_cpp as C
import numpy as np

from specrun.engine import compute
from specrun.engine.backend import Owner, last_llama_error, recent_errors
from specrun.engine.devices import runs_batch_invariant
from specrun.engine.model import Model
from specrun.errors import ContextFullError, EngineError
from specrun.limits import MAX_SEQ


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

    def copy_to(self, big: "Batch", at: int) -> None:
        """Write this batch's tokens into `big` from its token `at` on (a shared pass's batch)."""
        k = self.n_tokens
        big.tokens[at: at + k] = self.tokens[:k]
        big.positions[at: at + k] = self.positions[:k]
        big.n_seq[at: at + k] = self.n_seq[:k]
        big.seq_ids[at: at + k, : self.n_seq_max] = self.seq_ids[:k]
        big.want_logits[at: at + k] = self.want_logits[:k]

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.clear()


# --------------------------------------------------------------------------------------------
# Context


def _decode(ctx_ptr, batch_struct) -> int:
    """llama_decode, waited for (in the compute thread: engine.compute)."""
    rc = C.llama_decode(ctx_ptr, batch_struct)
    if rc == 0:
        # llama_decode returns once the pass is queued: on a GPU or an RPC worker it runs, and
        # its logits come back, after that. Waiting here makes a pass's time the time of the
        # pass, wherever it runs (the cost curves of trees are built on it: timed without the
        # wait, a pass over an RPC worker looked free and lookup trees grew until the rewrites
        # of the demo pair ran at 0.82x plain).
        C.llama_synchronize(ctx_ptr)
    return rc


def _timed_decode(ctx_ptr, batch_struct) -> tuple[int, float]:
    """_decode and its seconds, timed in the thread that ran it."""
    t0 = time.perf_counter()
    rc = _decode(ctx_ptr, batch_struct)
    return rc, time.perf_counter() - t0


# --kv-type: the KV cache's element type, keys and values alike (llama.cpp's --cache-type-k/-v).
# A quantized one needs flash attention, whose CPU kernel then takes one query row at a time over
# the cells in their order, however many tokens the pass holds and wherever the cells sit, so long
# as they lie in position order (docs/exactness.md, "A quantized KV cache").
KV_TYPES = {"f16": C.GGML_TYPE_F16, "q8_0": C.GGML_TYPE_Q8_0, "q4_0": C.GGML_TYPE_Q4_0}
DEFAULT_KV_TYPE = "f16"


def kv_quantized(kv_type: str | None) -> bool:
    """Whether a KV cache of this type (None: DEFAULT_KV_TYPE) holds quantized cells."""
    return (kv_type or DEFAULT_KV_TYPE) != "f16"


def default_flash_attn(kv_type: str | None = None) -> str:
    """A context's flash attention unless told: on for a quantized KV cache (llama.cpp needs it
    there); else off where every pass size must round alike (runs_batch_invariant), else
    llama.cpp's "auto" (on wherever its devices have the kernel)."""
    if kv_quantized(kv_type):
        return "on"
    return "off" if runs_batch_invariant() else "auto"


def passes_batch_invariant(flash_attn: str | None = None, kv_type: str | None = None) -> bool:
    """Whether a context with this flash attention (None: default_flash_attn) and KV type rounds a
    token alike in every pass size: a batch-invariant build (runs_batch_invariant), and flash
    attention off, or on over a quantized cache (the CPU kernel sums a row of an f16 cache by the
    pass's size and the cells' places, of a quantized one a row at a time over its cells in
    order, which also keeps it from moving with where they sit). Measured for F32 and Q4_1
    weights; a K-quant target's passes of 16 tokens and more differ even so (docs/exactness.md)."""
    if not runs_batch_invariant():
        return False
    return kv_quantized(kv_type) or (flash_attn or default_flash_attn(kv_type)) == "off"


def chains_may_match(flash_attn: str | None = None, kv_type: str | None = None) -> bool:
    """Whether a context with these options may score a tree's chains as its one-token passes,
    for decoding.kv.chains_exact to measure on the loaded target: where every pass size is claimed
    to round alike (passes_batch_invariant) or a quantized cache's attention reads a row's cells
    one by one; elsewhere its attention or matrix products sum by the pass's size."""
    return kv_quantized(kv_type) or passes_batch_invariant(flash_attn, kv_type)


def default_threads() -> int:
    """Return the thread count llama.cpp runs best with here: the usable CPU cores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Context(Owner):
    """Owner of a llama_context: KV cache, decode, logits."""

    split = False  # a cache per sequence (--kv-split: kv_unified off); an MtpContext's never is
    # Seconds each pass spends on the network where the model runs on RPC workers (the runtime
    # sets it), where a pass over a count of tokens not met before costs round trips: a prompt's
    # pass is then filled to a count met before where that pays (decoding.pay.counts).
    network_s = 0.0

    def __init__(
        self,
        model: Model,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_seq_max: int = 1,
        threads: int | None = None,
        flash_attn: str | None = None,
        swa_full: bool = True,
        kv_unified: bool = True,
        op_offload: bool | None = None,
        n_rs_seq: int = 0,
        kv_type: str | None = None,
    ):
        """`n_rs_seq`: recurrent-state snapshots kept per sequence, so a model with a recurrent
        state can roll back that many tokens of its last decode (llama.cpp keeps 0 for models that
        cannot; `self.n_rs_seq` says what it kept).

        `swa_full`: sliding-window layers keep every cell; False keeps llama.cpp's own default, a
        window per sequence and a batch (see `window`, and `compact_window` for tree colours)."""
        if n_seq_max > MAX_SEQ:
            raise EngineError(f"n_seq_max {n_seq_max} exceeds llama.cpp's limit of {MAX_SEQ}")
        self.model = model
        threads = threads or default_threads()
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        # One ubatch for the whole tree: split trees pay the weight transfer again when offloading.
        params.n_ubatch = n_batch
        if op_offload is not None:  # None: llama.cpp's default (run big-batch matmuls on the GPU)
            params.op_offload = op_offload
        params.n_seq_max = n_seq_max
        # llama.cpp reserves at least one output row per sequence and aborts (not errors) when
        # that exceeds n_outputs_max, which defaults to n_batch.
        params.n_outputs_max = max(n_batch, n_seq_max)
        params.n_threads = threads
        params.n_threads_batch = threads
        flash_attn = flash_attn or default_flash_attn(kv_type)
        if flash_attn not in ("auto", "on", "off"):
            raise EngineError(f"flash attention {flash_attn!r}: choose auto, on or off")
        kv_type = kv_type or DEFAULT_KV_TYPE
        if kv_type not in KV_TYPES:
            raise EngineError(f"KV cache type {kv_type!r}: choose {', '.join(KV_TYPES)}")
        if kv_quantized(kv_type) and flash_attn == "off":
            raise EngineError(f"a {kv_type} KV cache needs flash attention: leave it on (auto)")
        params.type_k = params.type_v = KV_TYPES[kv_type]
        params.flash_attn_type = {
            "auto": C.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "on": C.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": C.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        # A window-sized cache reuses the cells its window has passed, only where one sequence
        # holds them: tree colours, which copy the committed text into several, give them back
        # first (compact_window), or no room is left once the text filled the cache.
        params.swa_full = swa_full
        # A split-per-sequence cache cannot hold tokens shared by several tree colours.
        params.kv_unified = kv_unified
        self.split = not kv_unified  # a cache per sequence (--kv-split)
        params.no_perf = True
        params.n_rs_seq = n_rs_seq if model.has_state else 0
        ptr = self._open(params, "cannot create a context", "out of memory?")
        # llama.cpp pads the cache to a multiple of 256 cells (a --ctx-size of 64 gets 256): specrun
        # keeps to the size asked for, so the limit the user set is the one decoding stops at.
        allocated = C.llama_n_ctx(ptr)
        self.n_ctx = min(n_ctx, allocated) if n_ctx > 0 else allocated
        self.n_batch = C.llama_n_batch(ptr)
        self.n_ubatch = C.llama_n_ubatch(ptr)
        self.n_seq_max = C.llama_n_seq_max(ptr)
        self.n_rs_seq = C.llama_n_rs_seq(ptr)
        # A recurrent state holds only the end of each sequence: it can be dropped whole, rolled
        # back by at most n_rs_seq tokens of the last decode, and never cut anywhere else.
        self.has_state = model.has_state
        # Positions a sliding-window cache keeps behind its newest (0: it keeps every cell).
        self.window = 0 if swa_full else max(0, model.n_swa)
        self.n_vocab = model.n_vocab
        self.threads = threads
        self.flash_attn = flash_attn  # as asked ("auto": llama.cpp's choice)
        self.kv_type = kv_type
        self._n_outputs = 0
        model._contexts.append(self)

    @property
    def chains_only(self) -> bool:
        """Whether trees verify here as chains, a sequence each, and llama.cpp splits a pass into
        ubatches of as many tokens per sequence: a recurrent state (rolled back only in the
        sequence that made it) or a cache per sequence (which holds no token of several)."""
        return self.has_state or self.split

    @property
    def batch_invariant(self) -> bool:
        """Whether every pass size rounds a token alike here (passes_batch_invariant)."""
        return passes_batch_invariant(self.flash_attn, self.kv_type)

    def _open(self, params, refusal: str, hint: str):
        """Open the llama.cpp context for self.model with `params`; return its pointer. A refusal
        raises EngineError: `refusal`, then llama.cpp's last error (or `hint` when it said none)."""
        recent_errors.clear()
        ptr = C.llama_init_from_model(self.model.ptr, params)
        if not ptr:
            raise EngineError(f"{refusal} for {self.model.path.name}: {last_llama_error(hint)}")
        self._ptr = ptr
        self._mem = C.llama_get_memory(ptr)
        # llama.cpp's cache is not safe to edit (or read) from two threads at once: requests that
        # share a context (decoding.batching) edit their own sequences each in its own thread, and
        # two edits at the same moment crashed the process. The gates keep edits away from a
        # pass; this lock keeps them away from one another.
        self._cache_lock = threading.Lock()
        return ptr

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
    def new_batch(self, capacity: int, n_seq_max: int = 1) -> Batch:
        """A batch this context decodes (an MTP context's carries a hidden row per token)."""
        return Batch(capacity, n_seq_max)

    def decode(self, batch: Batch) -> None:
        """Run the model over the batch; raise on failure (the KV cache is then unchanged)."""
        self._check(compute.run(_decode, self.ptr, self._struct(batch)), batch)

    def start_decode(self, batch: Batch) -> compute.Job:
        """Start the pass over the batch in the thread for passes whose work runs elsewhere
        (engine.compute.start_beside: a context wholly on a GPU or on RPC workers) and return at
        once; `finish_decode` waits for it and gives its seconds."""
        return compute.start_beside(_timed_decode, self.ptr, self._struct(batch))

    def _struct(self, batch: Batch):
        """The batch's llama_batch, its size checked against this context."""
        n = batch.n_tokens
        if n == 0:
            raise EngineError("decode called with an empty batch")
        if n > self.n_batch:
            raise EngineError(f"batch of {n} tokens exceeds the context's n_batch {self.n_batch}")
        batch.struct.n_tokens = n
        return batch.struct

    def finish_decode(self, job: compute.Job, batch: Batch) -> float:
        """Wait for a pass `start_decode` started; return its seconds (raise as decode does)."""
        rc, seconds = compute.finish(job)
        self._check(rc, batch)
        return seconds

    def use_one_thread(self) -> None:
        """Run this context's CPU work in one thread: for a context whose layers all run
        elsewhere (its CPU part looks up the batch's embeddings), whose passes start beside the
        compute thread's (engine.compute: one thread starts no OpenMP team)."""
        C.llama_set_n_threads(self.ptr, 1, 1)

    def _check(self, rc: int, batch: Batch) -> None:
        n = batch.n_tokens
        if rc != 0:
            if rc == 1:
                raise ContextFullError(f"the context ({self.n_ctx} tokens) has no room for {n} more tokens")
            if rc == 2:
                raise EngineError("decode was aborted")
            if rc == -1:
                raise EngineError(f"llama.cpp rejected the batch: {last_llama_error('invalid batch')}")
            raise EngineError(f"decode failed with code {rc}: {last_llama_error('fatal error')}")
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
        """Remove seq's cells with positions in [p0, p1); raise if the cache cannot do it.

        With a recurrent state, llama.cpp accepts a rollback of the last `n_rs_seq` tokens even
        when it cannot be right (the tokens were not all in the last decode): callers keep to
        what is exact (see decoding.kv.CachedSequence.roll_back); the return value cannot tell.
        """
        with self._cache_lock:
            done = C.llama_memory_seq_rm(self._mem, seq, p0, p1)
        if not done:
            raise EngineError(
                f"{self.model.path.name}: its cache cannot drop positions {p0}.. of sequence {seq} "
                "(a recurrent state rolls back only a few tokens of its last decode)"
            )

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        with self._cache_lock:
            C.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        with self._cache_lock:
            C.llama_memory_seq_keep(self._mem, seq)

    def seq_pos_max(self, seq: int = 0) -> int:
        """Return the largest cached position of seq (-1 when empty)."""
        with self._cache_lock:
            return C.llama_memory_seq_pos_max(self._mem, seq)

    def seq_pos_min(self, seq: int = 0) -> int:
        """Return the smallest cached position of seq (-1 when empty); with a window-sized cache,
        the oldest position its sliding-window layers still hold."""
        with self._cache_lock:
            return C.llama_memory_seq_pos_min(self._mem, seq)

    def can_cut(self, seq: int, n: int) -> bool:
        """Return whether seq can be cut back to its first n positions and decoding go on from
        there: a window-sized cache must still hold the window before position n (llama.cpp
        reuses the cells its window has passed; it keeps the positions it holds contiguous)."""
        if not self.window:
            return True
        return self.seq_pos_min(seq) <= max(0, n - self.window)

    def compact_window(self, seq: int) -> None:
        """Free the cells a window-sized cache holds for seq behind its window, keeping the window.

        llama.cpp reuses such a cell for new tokens only while it belongs to one sequence; tree
        colours copy the committed text into several (decoding.speculative), so the cells that text
        passed stay taken and a cache of llama.cpp's window size fills. Saving the sequence's
        window-layer cells (llama.cpp writes only those its window still sees) and loading them back
        into the sequence frees the others; the full-attention layers' cells are not touched."""
        if not self.window:
            return
        with self._cache_lock:
            self._compact_window(seq)

    def _compact_window(self, seq: int) -> None:
        flags = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = C.llama_state_seq_get_size_ext(self.ptr, seq, flags)
        data = (ctypes.c_uint8 * size)()
        if C.llama_state_seq_get_data_ext(self.ptr, data, size, seq, flags) != size:
            raise EngineError(f"{self.model.path.name}: could not read the window of sequence {seq}")
        if C.llama_state_seq_set_data_ext(self.ptr, data, size, seq, flags) != size:
            raise EngineError(f"{self.model.path.name}: could not put back the window of sequence {seq}: "
                              f"{last_llama_error('its cache is full')}")

    def clear(self) -> None:
        with self._cache_lock:
            C.llama_memory_clear(self._mem, True)

    @property
    def can_roll_back(self) -> bool:
        """Return whether rejected draft tokens can be dropped: always for attention caches; for a
        recurrent state only as far as its snapshots reach (n_rs_seq tokens of the last decode)."""
        return not self.has_state or self.n_rs_seq > 0


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
