"""The llama_model owner: weights, vocabulary, metadata, tokenizing; and GGUF conversion."""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import Sequence

import llama_cpp as C

from specrun import sysinfo
from specrun.engine.backend import (
    Owner,
    ensure_backend,
    last_llama_error,
    raise_if_interrupted,
    recent_errors,
)
from specrun.engine.devices import cpu_buffer_type, local_gpus, offload_devices, remote_hosts, runs_batch_invariant
from specrun.engine.gguf import check_complete_gguf
from specrun.errors import EngineError, ModelFileError

_FTYPES = {"F32": C.LLAMA_FTYPE_ALL_F32, "F16": C.LLAMA_FTYPE_MOSTLY_F16, "Q8_0": C.LLAMA_FTYPE_MOSTLY_Q8_0}


class _BufferOverride(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# The output layer's tensors (llama.cpp's last slot): the output norm and matrix, and the token
# embedding's copy a model with a tied head loads there (its input copy stays in RAM anyway).
HEAD_TENSORS = rb"^(output|output_norm|token_embd)\.(weight|bias)$"


def _in_ram(experts_layers: int, head: bool):
    """Return the override array (NULL-terminated) that keeps layers 0..n-1's experts, and with
    `head` the output layer, in RAM, wherever their slots go."""
    patterns = []
    if experts_layers > 0:
        layers = "|".join(str(i) for i in range(experts_layers))
        patterns.append(rf"^blk\.({layers})\.ffn_(up|down|gate_up|gate)_(ch|)exps".encode())
    if head:
        patterns.append(HEAD_TENSORS)
    overrides = (_BufferOverride * (len(patterns) + 1))()
    for override, pattern in zip(overrides, patterns):
        override.pattern, override.buft = pattern, cpu_buffer_type()
    return overrides


class Model(Owner):
    """Owner of a llama_model (weights + vocabulary)."""

    def __init__(
        self,
        path: str | Path,
        n_gpu_layers: int = 0,
        vocab_only: bool = False,
        tensor_split: Sequence[float] = (),
        main_gpu: int | None = None,
        load_mtp: bool = False,
        simulate: bool = False,
        experts_in_ram: int = 0,
        across_hosts: bool = False,
        mmap: bool | None = None,
        head_here: bool = False,
    ):
        """Load a model. `tensor_split` (per GPU) spreads offloaded layers as planned; `main_gpu`
        puts the whole model on one GPU (llama.cpp's split mode "none"); `load_mtp` also loads its
        MTP layers, for drafting with them (engine.mtp); `simulate` reads only the metadata and
        makes llama.cpp size every buffer without allocating it (engine.memory), contexts too;
        `experts_in_ram` keeps the routed experts of the first that many layers in RAM wherever
        their layers go (llama.cpp's tensor buffer overrides, as its --n-cpu-moe);
        `across_hosts` offloads to the RPC workers' devices too (engine.rpc), first, and then to
        this machine's GPUs: `tensor_split` counts them in that order. `mmap` False reads the
        weights into memory instead of mapping the file: llama.cpp then puts the layers left in
        RAM in the GPU's pinned host memory, which its passes of 32 tokens and more copy to the
        GPU several times faster than mapped pages (None: llama.cpp's default, mapped).
        `head_here` computes the output layer on this machine's CPU wherever its slot goes (an RPC
        worker): hidden states of n_embd floats cross the network, not a logits row per token."""
        ensure_backend()
        self.path = check_complete_gguf(Path(path))
        # Whether some of its layers compute on a GPU here or (across_hosts) an RPC worker's device,
        # whose kernels part further between pass sizes than this CPU's (sampling.near_tie_nats).
        self.offloaded = (n_gpu_layers > 0 and not vocab_only and not simulate
                          and (bool(local_gpus()) or (across_hosts and bool(remote_hosts()))))
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        params.load_mtp = load_mtp
        if mmap is not None:
            params.load_mode = C.LLAMA_LOAD_MODE_MMAP if mmap else C.LLAMA_LOAD_MODE_NONE
        if simulate:
            # The simulation llama.cpp's own fitting runs: it needs load mode "none" (with mmap it
            # asserts), and reads no tensor data, so a header-only sparse copy of a file will do.
            params.no_alloc = True
            params.load_mode = C.LLAMA_LOAD_MODE_NONE
        if tensor_split:
            # llama.cpp reads llama_max_devices() floats; keep the array alive while loading.
            self._split = (ctypes.c_float * C.llama_max_devices())(*tensor_split)
            params.tensor_split = self._split
        if experts_in_ram > 0 or head_here:
            self._overrides = _in_ram(experts_in_ram, head_here)
            params.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        if across_hosts and remote_hosts():
            # llama.cpp reads a NULL-terminated array; without one it offloads to this machine's
            # devices only (the workers' are not in ggml's registry).
            devices = offload_devices()
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if main_gpu is not None:
            params.split_mode = C.LLAMA_SPLIT_MODE_NONE
            params.main_gpu = main_gpu
        # Repacked weights take another kernel for multi-token passes than for one token; on a
        # CPU with AMX they also crash on multi-token Q4_1 batches (sysinfo.repacking_crashes).
        if sysinfo.repacking_crashes() or runs_batch_invariant():
            params.use_extra_bufts = False
        # How it was placed, as what a context measured on it is kept under (decoding.kv.chains_alike).
        self.placement = {"n_gpu_layers": n_gpu_layers, "tensor_split": list(tensor_split), "main_gpu": main_gpu,
                          "experts_in_ram": experts_in_ram, "across_hosts": across_hosts,
                          "repacked": bool(params.use_extra_bufts)}
        if head_here:
            self.placement["head_here"] = True  # (only then: the keys of what was kept before stay as they were)
        recent_errors.clear()
        ptr = C.llama_model_load_from_file(str(self.path).encode(), params)
        try:
            raise_if_interrupted()
        except KeyboardInterrupt:
            if ptr:
                C.llama_model_free(ptr)
            raise
        if not ptr:
            reason = last_llama_error("llama.cpp could not load it")
            raise ModelFileError(f"cannot load model {self.path}: {reason}")
        self._ptr = ptr
        self._vocab = C.llama_model_get_vocab(ptr)
        self._contexts: list = []  # engine.context.Context objects made from this model
        self.n_vocab = C.llama_vocab_n_tokens(self._vocab)
        self.vocab_type = C.llama_vocab_type(self._vocab)
        self.bos = C.llama_vocab_bos(self._vocab)
        self.eos = C.llama_vocab_eos(self._vocab)
        self.add_bos = bool(C.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(C.llama_vocab_get_add_eos(self._vocab))
        # One piece buffer per thread: requests decoding at once detokenize in threads of their own.
        self._piece = threading.local()
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
    def vocab_ptr(self):
        """The llama_vocab pointer (for llguidance's tokenizer, engine.grammar)."""
        return self._vocab

    @property
    def n_layer(self) -> int:
        return C.llama_model_n_layer(self.ptr)

    @property
    def n_embd(self) -> int:
        return C.llama_model_n_embd(self.ptr)

    @property
    def n_head(self) -> int:
        return C.llama_model_n_head(self.ptr)

    @property
    def n_head_kv(self) -> int:
        return C.llama_model_n_head_kv(self.ptr)

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
    def is_recurrent(self) -> bool:
        """Whether the model keeps only a recurrent state (Mamba, RWKV): no attention KV cache."""
        return bool(C.llama_model_is_recurrent(self.ptr))

    @property
    def is_hybrid(self) -> bool:
        """Whether the model mixes attention layers with recurrent ones (Gated DeltaNet, Mamba, ...)."""
        return bool(C.llama_model_is_hybrid(self.ptr))

    @property
    def has_state(self) -> bool:
        """Whether the model keeps a recurrent state, which cannot be cut back to any earlier position."""
        return self.is_recurrent or self.is_hybrid

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
        buf = getattr(self._piece, "buf", None)
        if buf is None:
            buf = self._piece.buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def token_text(self, token: int) -> bytes:
        """Return the token's text as stored in the vocabulary (for comparing vocabularies)."""
        return C.llama_vocab_get_text(self._vocab, token) or b""

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Return the most bytes of text one token stands for (so a text of n bytes needs at least
        n / max_token_bytes tokens)."""
        return max((len(self.token_to_piece(t, True)) for t in range(self.n_vocab)), default=1) or 1

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



def quantize(src: str | Path, dst: str | Path, ftype: str = "F32", threads: int = 0) -> None:
    """Convert a GGUF file to another precision with llama_model_quantize (e.g. Q4_1 -> F32)."""
    ensure_backend()
    check_complete_gguf(Path(src))
    if ftype not in _FTYPES:
        raise ValueError(f"unsupported ftype {ftype!r}; choose one of {sorted(_FTYPES)}")
    params = C.llama_model_quantize_default_params()
    params.ftype = _FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = threads
    recent_errors.clear()
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    raise_if_interrupted()
    if rc != 0:
        raise EngineError(f"converting {src} to {ftype} failed: {last_llama_error(f'code {rc}')}")


# --------------------------------------------------------------------------------------------
# Batch
