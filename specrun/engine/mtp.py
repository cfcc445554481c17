"""A model's own MTP (next-token-prediction) layers as a drafter: the MTP context and its inputs.

llama.cpp runs a model's MTP block in a context of its own (`ctx_type = LLAMA_CONTEXT_TYPE_MTP`,
opened on the same llama_model loaded with `load_mtp`). The block reads, per token, the token and
the target's hidden row of the position before it (the "nextn" row: the last hidden state before
the output norm), and gives logits for the token after, plus a row of its own that feeds the next
MTP step. Tokens and rows travel in `llama_batch_ext` batches (one embedding per token).

The nextn rows and the staging switches come from src/llama-ext.h, which libllama exports with
C++ linkage: llama-cpp-python does not bind them, so they are called here by their Itanium-mangled
names (Linux and macOS builds), each resolved on first use. A build that does not export one
(another ABI, another llama.cpp) gets one line saying which, and MTP drafting is refused.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Sequence

import llama_cpp as C
import numpy as np

from specrun.engine import compute
from specrun.engine.backend import last_llama_error, recent_errors
from specrun.engine.context import Batch, Context
from specrun.engine.model import Model
from specrun.errors import EngineError

# name -> (mangled symbol, argument types, return type); src/llama-ext.h of the vendored llama.cpp.
_STAGING = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                 [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "set_nextn_layer_offset": ("_Z28llama_set_nextn_layer_offsetP13llama_contexti",
                               [ctypes.c_void_p, ctypes.c_int32], None),
}
_resolved: dict[str, object] = {}


def _staging(name: str):
    """Return the staging function `name`, declared; EngineError when libllama lacks it."""
    fn = _resolved.get(name)
    if fn is None:
        symbol, argtypes, restype = _STAGING[name]
        try:
            fn = getattr(C.llama_cpp._lib, symbol)
        except AttributeError:
            raise EngineError(f"this libllama does not export llama_{name} ({symbol}): "
                              "it cannot drive MTP layers (another ABI or llama.cpp version?)") from None
        fn.argtypes, fn.restype = argtypes, restype
        _resolved[name] = fn
    return fn


def check_mtp_support() -> None:
    """Raise EngineError (one line) unless every staging function MTP drafting calls is exported."""
    for name in _STAGING:
        _staging(name)


def n_layer_nextn(model: Model) -> int:
    """How many MTP (nextn) layers the model file carries (loaded or not)."""
    return int(C.llama_model_n_layer_nextn(model.ptr))


def set_embeddings_nextn(ctx, on: bool = True, masked: bool = False) -> None:
    """Make a context output nextn rows: for every token of each batch (masked=False), or only for
    the tokens that ask for logits."""
    _staging("set_embeddings_nextn")(ctx.ptr, on, masked)


def set_nextn_layer_offset(ctx, offset: int) -> None:
    """Pick which MTP block (past the trunk) an MTP context runs; 0 is the first."""
    _staging("set_nextn_layer_offset")(ctx.ptr, offset)


def embeddings_nextn_row(ctx, i: int, n_embd: int) -> np.ndarray:
    """Return the nextn row of token i of the last batch (a copy): unmasked contexts index it by
    the token's place in the batch, masked ones by output."""
    ptr = _staging("get_embeddings_nextn_ith")(ctx.ptr, i)
    if not ptr:
        raise EngineError(f"no nextn row {i} in the last batch: {last_llama_error('not produced')}")
    return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()


def enable_target_rows(ctx: Context) -> None:
    """Turn on a target context's nextn rows (one per token of every batch) for an MTP drafter."""
    set_embeddings_nextn(ctx, True, False)


class MtpContext(Context):
    """An MTP context on a model loaded with `load_mtp`: its own small KV cache (the MTP block is
    attention), fed (token, position, hidden row) triples in `MtpBatch`es, a sequence for each
    request that drafts with it (`n_seq_max`, one unified cache of `n_ctx` cells). Closing,
    seq_rm and clear are a Context's. Several requests' threads share it: through a gate
    (decoding.batching), or each holding `lock` over its cache edits and passes."""

    def __init__(self, model: Model, n_ctx: int, n_batch: int = 512, threads: int | None = None, layer: int = 0,
                 n_seq_max: int = 1):
        check_mtp_support()
        if n_layer_nextn(model) < 1:
            raise EngineError(f"{model.path.name} has no MTP layers (llama_model_n_layer_nextn is 0)")
        self.model = model
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_outputs_max = max(n_batch, n_seq_max)
        params.kv_unified = True  # as the target's: a request's text takes the cells it needs
        if threads:
            params.n_threads = params.n_threads_batch = threads
        params.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        params.no_perf = True
        ptr = self._open(params, "cannot open an MTP context", "refused")
        self.n_batch = C.llama_n_batch(ptr)
        self.n_ctx = min(n_ctx, C.llama_n_ctx(ptr))
        self.n_vocab = model.n_vocab
        self.n_embd = C.llama_model_n_embd_out(model.ptr)
        self.n_seq_max, self.n_rs_seq, self.has_state, self.threads = C.llama_n_seq_max(ptr), 0, False, threads
        self._n_outputs = 0
        self.lock = threading.Lock()
        set_embeddings_nextn(self, True, True)  # its own row of the token that asks for logits
        if layer:
            set_nextn_layer_offset(self, layer)
        model._contexts.append(self)

    def new_batch(self, capacity: int, n_seq_max: int = 1) -> "MtpBatch":
        return MtpBatch(capacity, self.n_embd, n_seq_max)

    def decode(self, batch: "MtpBatch") -> None:
        """Run the MTP block over the batch's (token, position, row) triples, each in its first
        sequence id (several requests' tokens in one pass). The outputs' logits are `logits()`'s
        rows and their own rows `embeddings_nextn_row(self, i, ...)` (i: the token's place in the
        batch), until the next pass."""
        n = batch.n_tokens
        if not 0 < n <= self.n_batch:
            raise EngineError(f"an MTP batch of {n} tokens (this context takes 1..{self.n_batch})")
        ext = C.llama_batch_ext_init(self.ptr)
        if not ext:
            raise EngineError("llama.cpp could not make an MTP batch")
        position = (C.llama_pos * 4)()
        fptr = ctypes.POINTER(ctypes.c_float)
        row_bytes = 4 * self.n_embd
        try:
            for i in range(n):
                idx = C.llama_batch_ext_add_token(ext, int(batch.seq_ids[i, 0]), int(batch.tokens[i]))
                position[0] = int(batch.positions[i])
                C.llama_batch_ext_set_pos(ext, idx, position)
                embd = C.llama_embd(ctypes.cast(batch.rows.ctypes.data + row_bytes * i, fptr), 1, self.n_embd)
                C.llama_batch_ext_set_embd_token(ext, idx, embd)
                if batch.want_logits[i]:
                    C.llama_batch_ext_set_output_logits(ext, idx, True)
            recent_errors.clear()
            rc = compute.run(C.llama_process, self.ptr, C.LLAMA_PROCESS_TYPE_DECODE, ext)
            if rc != 0:
                raise EngineError(f"the MTP pass failed (code {rc}): {last_llama_error('llama_process')}")
        finally:
            C.llama_batch_ext_free(ext)
        self._n_outputs = int(batch.want_logits[:n].sum())


class MtpBatch(Batch):
    """A batch for an MTP context: each token with the hidden row it is paired with."""

    def __init__(self, capacity: int, n_embd: int, n_seq_max: int = 1):
        super().__init__(capacity, n_seq_max)
        self.n_embd = n_embd
        self.rows = np.zeros((self.capacity, n_embd), dtype=np.float32)

    def set_rows(self, tokens: Sequence[int], pos0: int, rows: np.ndarray, seq: int, want_last: bool) -> None:
        """Fill the batch: tokens at pos0.. in sequence `seq`, token i paired with rows[i]; the
        last one asks for logits (and its own row) with want_last."""
        n = len(tokens)
        if not 0 < n <= self.capacity:
            raise EngineError(f"an MTP batch of {n} tokens (this context takes 1..{self.capacity})")
        if np.shape(rows) != (n, self.n_embd):
            raise EngineError(f"MTP rows of shape {np.shape(rows)}, expected ({n}, {self.n_embd})")
        self.set_sequence(tokens, pos0, seq, "last" if want_last else "none")
        self.rows[:n] = rows

    def copy_to(self, big: "MtpBatch", at: int) -> None:
        super().copy_to(big, at)
        big.rows[at: at + self.n_tokens] = self.rows[: self.n_tokens]
