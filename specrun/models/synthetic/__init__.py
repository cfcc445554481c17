"""Synthetic GGUF models, made without a download: random weights, a real model's tokenizer.

- `write_random_model`: a tiny llama that mostly disagrees with its target (tiny_llama).
- `write_attention_model`: a real model's attention heads and little else (tiny_llama: the flash
  attention probe's).
- `write_arch_model`: tiny hybrid, MoE and recurrent models of the real layouts (tiny_archs).
- `write_shape_model`: a real model's architecture and tensor shapes at Q4_K_M, full size or
  scaled down (real_shapes; `write_derived` builds the registry's "shape" models).

Writing needs the `gguf` package (imported only when a model is written).
"""

from specrun.models.synthetic.real_shapes import (
    SHAPES,
    Shape,
    file_bytes,
    tensor_plan,
    write_derived,
    write_shape_model,
)
from specrun.models.synthetic.tiny_archs import ARCHITECTURES, write_arch_model
from specrun.models.synthetic.tiny_llama import write_attention_model, write_random_model

__all__ = [
    "ARCHITECTURES", "SHAPES", "Shape", "file_bytes", "tensor_plan", "write_arch_model", "write_attention_model", "write_derived",
    "write_random_model", "write_shape_model",
]
