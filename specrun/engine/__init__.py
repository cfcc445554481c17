"""The one module that talks to llama.cpp (through llama-cpp-python's low-level ctypes API).

Owner objects wrap each C pointer: they free it exactly once, work as context managers, and a
context is always closed before the model it was made from. Every return code is checked and
turned into a specrun exception with a readable message.

What llama-cpp-python does not offer and this module adds: batches whose tokens carry several
sequence ids (the tree "colours" that make one forward pass score a whole draft tree), logits as
zero-copy numpy views, and llama.cpp's log lines routed into Python `logging`.

The package is split by what it owns: `backend` (process-wide setup, logs, file checks), `model`
(llama_model), `context` (llama_context, batches, detokenizing), `devices` (ggml's device list).
Everything a caller needs is importable from `specrun.engine`.
"""

from specrun.engine.backend import GGUF_MAGIC, check_gguf_file, llama_version_info
from specrun.engine.context import Batch, Context, Detokenizer, default_threads
from specrun.engine.devices import DeviceInfo, backend_names, list_devices, system_info
from specrun.engine.gguf import architecture as gguf_architecture
from specrun.engine.gguf import header_facts as gguf_header_facts
from specrun.engine.model import Model, quantize
from specrun.limits import MAX_SEQ

__all__ = [
    "GGUF_MAGIC", "MAX_SEQ", "Batch", "Context", "Detokenizer", "DeviceInfo", "Model", "backend_names",
    "check_gguf_file", "default_threads", "gguf_architecture", "gguf_header_facts", "list_devices", "llama_version_info", "quantize", "system_info",
]
