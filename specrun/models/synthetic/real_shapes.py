"""Random-weight models of real shapes: a 14B or 27B model's exact architecture and tensor shapes
at Q4_K_M, written without downloading its weights.

Speed and memory depend on shapes and quantization types, not on weight values, so on a machine
that can download nothing these measure cost curves and placement at full size. (Acceptance does
depend on the values: it comes from real small pairs.) The quantized blocks are written directly,
random bytes with small finite scales, streamed tensor by tensor: a 14B file takes about as long
as writing 9 GB. The tokenizer is copied from a real model so prompts tokenize as they would.

The shapes, tensor layouts and Q4_K_M types are models.shapes' (the ones specrun plans a model
from before its download); this module fills them with bytes.

Needs the `gguf` package.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrun.errors import UsageError
from specrun.models.shapes import Shape, add_key, layout, leave_data_hole, tensor_plan, weights_bytes, write_head
from specrun.files import atomic_path
from specrun.models.synthetic.gguf_writer import add_tokenizer, read_tokenizer

# Per type: weights per block, bytes per block and where its f16 scales sit (ggml-common.h
# block_q4_K, block_q6_K, block_q5_0, block_q8_0). Every other byte (packed quants, sub-block
# scales) is valid whatever its value.
BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q5_0": (32, 22, (0,)), "Q8_0": (32, 34, (0,))}
# A dequantized weight is at most ~scale * 63 * 15: this keeps activations far from f16 limits.
BLOCK_SCALE = np.float16(2e-5)
# Random bytes are drawn once in a pool of this size and reused: values do not change speed.
POOL_BYTES = 16 * 1024 * 1024


# Real shapes (config.json of each model family). qwen2.5-14b-shape ~ Qwen2.5-14B-Instruct;
# dense-27b-shape ~ a 27B dense model of Qwen's layout (64 layers, 5120 wide, GQA 40/8).
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 24, 896, 14, 2, 4864, 151936, tied_output=True),
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 28, 4, 18944, 152064),
    "qwen2.5-14b": Shape("qwen2", 48, 5120, 40, 8, 13824, 152064),
    "qwen2.5-32b": Shape("qwen2", 64, 5120, 40, 8, 27648, 152064),
    "dense-27b": Shape("qwen2", 64, 5120, 40, 8, 17408, 152064),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 used per token; heads of 128 over a 2048-wide stream
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 32, 4, 6144, 151936, head_dim=128, n_expert=128,
                           n_expert_used=8, n_ff_exp=768),
}


def file_bytes(shape: Shape) -> int:
    """Return about how big the file is (tensor data only)."""
    return weights_bytes(shape, "Q4_K_M")


def write_shape_model(shape: Shape, tokenizer_gguf: Path, dst: Path, seed: int = 0,
                      header_only: bool = False) -> None:
    """Write a random-weight Q4_K_M GGUF of `shape` to `dst` with `tokenizer_gguf`'s tokenizer.

    The vocabulary is the shape's: a tokenizer with fewer tokens is padded with unused tokens (a
    real embedding is often padded so too), one with more is refused. Appears atomically.
    `header_only` writes the header and leaves the weights a hole of their size (a sparse file:
    what llama.cpp's memory simulation reads, in seconds and no disk space, at any size).
    """
    import gguf

    if shape.n_embd % 32 or shape.n_ff % 32:
        raise ValueError("n_embd and n_ff must be multiples of 32 (the smallest quant block)")
    tokenizer = _padded_tokenizer(read_tokenizer(Path(tokenizer_gguf).resolve()), shape.n_vocab)
    with atomic_path(Path(dst)) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=shape.arch)
        _write_metadata(writer, shape, tokenizer, seed)
        plan = tensor_plan(shape)
        sizes = write_head(writer, plan)
        if header_only:
            writer.close()
            leave_data_hole(Path(tmp), sizes, writer.data_alignment)
            return
        rng = np.random.default_rng(seed)
        pool = rng.integers(0, 256, POOL_BYTES, dtype=np.uint8)
        for name, dims, kind in plan:
            writer.write_tensor_data(_tensor_data(name, dims, kind, pool, rng))
        writer.close()


def _write_metadata(writer, shape: Shape, tokenizer: dict, seed: int) -> None:
    import gguf

    writer.add_name(f"specrun random {shape.arch} shape {shape.n_layer}x{shape.n_embd} (seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value in layout(shape)[0].items():
        add_key(writer, key, value)
    add_tokenizer(writer, tokenizer)


def _padded_tokenizer(fields: dict, n_vocab: int) -> dict:
    """Return the tokenizer fields with unused tokens appended up to n_vocab."""
    from gguf import TokenType

    tokens = fields["tokenizer.ggml.tokens"]
    have = len(tokens[1])
    if have > n_vocab:
        raise ValueError(f"the tokenizer has {have} tokens, more than the shape's {n_vocab}")
    extra = n_vocab - have
    if not extra:
        return fields
    padded = dict(fields)
    padded["tokenizer.ggml.tokens"] = (tokens[0], tokens[1] + [f"<|specrun_pad_{i}|>".encode() for i in range(extra)])
    if "tokenizer.ggml.token_type" in fields:
        types, values = fields["tokenizer.ggml.token_type"]
        padded["tokenizer.ggml.token_type"] = (types, values + [int(TokenType.UNUSED)] * extra)
    if "tokenizer.ggml.scores" in fields:
        types, values = fields["tokenizer.ggml.scores"]
        padded["tokenizer.ggml.scores"] = (types, values + [0.0] * extra)
    return padded


def _tensor_data(name: str, dims: tuple[int, ...], kind: str, pool: np.ndarray, rng) -> np.ndarray:
    """Return one tensor's bytes: norms of ones, small random biases, or random quantized blocks."""
    count = int(np.prod(dims))
    if kind == "F32":
        if name.endswith("norm.weight"):
            return np.ones(count, dtype=np.float32)
        return (rng.standard_normal(count, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    weights, block, scales = BLOCKS[kind]
    n_blocks = count // weights
    reps = -(-n_blocks * block // pool.size)
    data = np.tile(pool, reps)[: n_blocks * block].reshape(n_blocks, block)
    scale = np.frombuffer(BLOCK_SCALE.tobytes(), dtype=np.uint8)
    for offset in scales:
        data[:, offset:offset + 2] = scale
    return data.reshape(-1)


def write_derived(src, tokenizer_gguf: Path, dst: Path) -> None:
    """Build a registry model of op "shape" (models.specs.DerivedSource): SHAPES[src.shape],
    shrunk to src.scaled = (n_layer, n_embd, n_ff) when given."""
    if src.shape not in SHAPES:
        raise UsageError(f"unknown model shape {src.shape!r} in models.toml: one of {', '.join(SHAPES)}")
    shape = SHAPES[src.shape]
    if src.scaled:
        shape = shape.scaled(*src.scaled)
    write_shape_model(shape, tokenizer_gguf, dst, seed=src.seed)
