"""The one module that talks to llama.cpp (through llama-cpp-python's low-level ctypes API).

Owner objects wrap each C pointer: they free it exactly once, work as context managers, and a
context is always closed before the model it was made from. Every return code is checked and
turned into a specrun exception with a readable message.

What llama-cpp-python does not offer and this module adds: batches whose tokens carry several
sequence ids (the tree "colours" that make one forward pass score a whole draft tree), logits as
zero-copy numpy views, and llama.cpp's log lines routed into Python `logging`.

The package is split by what it owns: `backend` (process-wide setup, logs, file checks), `model`
(llama_model), `context` (llama_context, batches, detokenizing), `devices` (ggml's device list), `memory` (what llama.cpp allocates, simulated or read from a load's log), `mtp` (a model's MTP layers as a drafter: the MTP context, the
target's hidden rows, llama.cpp's C++ staging functions called by their mangled names).
Everything a caller needs is importable from `specrun.engine`.
"""

from specrun.engine.backend import (
    GGUF_MAGIC,
    captured_log,
    check_gguf_file,
    llama_version_info,
)
from specrun.engine.context import (
    DEFAULT_KV_TYPE, KV_TYPES, Batch, Context, Detokenizer, chains_may_match, default_flash_attn, default_threads, kv_quantized, passes_batch_invariant,
)
from specrun.engine.devices import (
    DeviceInfo,
    backend_names,
    cpu_kernels_batch_invariant,
    list_devices,
    remote_devices,
    runs_batch_invariant,
    system_info,
)
from specrun.engine.gguf import architecture as gguf_architecture
from specrun.engine.gguf import data_bytes as gguf_data_bytes
from specrun.engine.gguf import has_mtp_layers as gguf_has_mtp_layers
from specrun.engine.gguf import has_sliding_window as gguf_has_sliding_window
from specrun.engine.gguf import header_facts as gguf_header_facts
from specrun.engine.memory import Allocation, ContextSpec, Simulation
from specrun.engine.model import Model, quantize
from specrun.engine.mtp import (
    MtpContext,
    check_mtp_support,
    embeddings_nextn_row,
    enable_target_rows,
    n_layer_nextn,
)
from specrun.limits import MAX_SEQ

__all__ = [
    "GGUF_MAGIC", "MAX_SEQ", "Allocation", "Batch", "captured_log", "ContextSpec", "Simulation", "Context", "Detokenizer", "DeviceInfo", "Model", "MtpContext", "backend_names", "check_mtp_support", "cpu_kernels_batch_invariant",
    "embeddings_nextn_row", "enable_target_rows", "n_layer_nextn",
    "DEFAULT_KV_TYPE", "KV_TYPES", "chains_may_match", "check_gguf_file", "default_flash_attn", "default_threads", "gguf_architecture", "gguf_data_bytes", "gguf_has_mtp_layers", "gguf_has_sliding_window", "gguf_header_facts", "kv_quantized", "list_devices", "llama_version_info", "passes_batch_invariant", "remote_devices", "runs_batch_invariant", "quantize", "system_info",
]
