"""Tiny random-weight llama GGUF models that share a real model's tokenizer.

Tests need a draft model that speaks the target's vocabulary but mostly disagrees with it, so the
speculative loop exercises rejection, bonus tokens and short accepted paths. A pruned copy of the
real model agrees too often; a 2-layer model with random weights and the base model's tokenizer
copied verbatim disagrees almost always, loads in llama.cpp in milliseconds and is a few tens of MB.

Needs the `gguf` package.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrun.models.synthetic.gguf_writer import (
    add_tokenizer,
    read_tokenizer,
    write_gguf,
)

# Must cover every n_ctx the tests ask for; llama.cpp warns (but works) beyond the trained length.
CONTEXT_LENGTH = 8192
RMS_NORM_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0

# Standard deviation of the output logits. Around 4 the softmax is peaked enough that greedy
# decoding follows the weights rather than ties, yet the argmax still changes with the context.
LOGIT_STD = 4.0


def write_random_model(
    base_gguf: Path,
    dst: Path,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
) -> None:
    """Write a random-weight llama GGUF to `dst` with exactly `base_gguf`'s tokenizer.

    All weights are F32 drawn from `np.random.default_rng(seed)`, so the same arguments give a
    byte-identical file. The file appears atomically: it is written beside `dst` and renamed.
    """
    import gguf  # imported when a model is written

    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd={n_embd}, n_head={n_head}, n_head_kv={n_head_kv} don't divide")
    base_gguf, dst = Path(base_gguf), Path(dst)
    tokenizer = read_tokenizer(base_gguf.resolve())
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][1])
    head_dim = n_embd // n_head

    def fill(writer) -> None:
        writer.add_name(f"specrun random llama (seed {seed})")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(CONTEXT_LENGTH)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(ROPE_FREQ_BASE)
        writer.add_vocab_size(n_vocab)
        add_tokenizer(writer, tokenizer)
        for name, tensor in _random_tensors(seed, n_vocab, n_layer, n_embd, n_head_kv * head_dim, n_ff):
            writer.add_tensor(name, tensor)

    write_gguf(dst, "llama", fill)


# The attention probe's model: the target's heads over a residual stream this wide, a vocabulary
# and feed-forward this small, so that its passes cost its attention and little else.
PROBE_EMBD = 64
PROBE_VOCAB = 256
PROBE_FF = 64


def write_attention_model(dst: Path, n_layer: int, n_head: int, n_head_kv: int, head_dim: int) -> None:
    """Write a random-weight llama GGUF to `dst` whose attention has these heads of this size,
    over a PROBE_EMBD-wide stream, a PROBE_VOCAB-token vocabulary of no tokenizer and a PROBE_FF
    feed-forward: a pass of it costs a real model's attention for `n_layer` of its layers (the
    flash attention probe, tuning.flash_attention). Atomically, as write_random_model."""
    import gguf  # imported when a model is written

    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv or head_dim <= 0:
        raise ValueError(f"n_head={n_head}, n_head_kv={n_head_kv}, head size {head_dim}: not an attention")

    def fill(writer) -> None:
        writer.add_name("specrun attention probe")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(CONTEXT_LENGTH)
        writer.add_embedding_length(PROBE_EMBD)
        writer.add_block_count(n_layer)
        writer.add_feed_forward_length(PROBE_FF)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_head_kv)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(ROPE_FREQ_BASE)
        writer.add_vocab_size(PROBE_VOCAB)
        writer.add_tokenizer_model("none")  # (token ids only: llama.cpp adds PROBE_VOCAB dummy tokens)
        for name, tensor in _random_tensors(0, PROBE_VOCAB, n_layer, PROBE_EMBD, n_head_kv * head_dim, PROBE_FF,
                                            n_q=n_head * head_dim):
            writer.add_tensor(name, tensor)

    write_gguf(Path(dst), "llama", fill)


def _random_tensors(seed: int, n_vocab: int, n_layer: int, n_embd: int, n_embd_kv: int, n_ff: int, n_q: int | None = None):
    """Yield (name, float32 array) for a llama model; numpy shapes are ggml's dims reversed.
    `n_q`: the heads' width where they are not n_embd / n_head wide (n_embd otherwise)."""
    rng = np.random.default_rng(seed)
    n_q = n_q or n_embd

    def normal(std: float, *shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    # 1/sqrt(fan_in) keeps each block's output at the scale of the residual stream.
    proj = 1.0 / np.sqrt(n_embd)
    yield "token_embd.weight", normal(1.0, n_vocab, n_embd)
    for i in range(n_layer):
        blk = f"blk.{i}"
        yield f"{blk}.attn_norm.weight", ones
        yield f"{blk}.attn_q.weight", normal(proj, n_q, n_embd)
        yield f"{blk}.attn_k.weight", normal(proj, n_embd_kv, n_embd)
        yield f"{blk}.attn_v.weight", normal(proj, n_embd_kv, n_embd)
        yield f"{blk}.attn_output.weight", normal(1.0 / np.sqrt(n_q), n_embd, n_q)
        yield f"{blk}.ffn_norm.weight", ones
        yield f"{blk}.ffn_gate.weight", normal(proj, n_ff, n_embd)
        yield f"{blk}.ffn_up.weight", normal(proj, n_ff, n_embd)
        yield f"{blk}.ffn_down.weight", normal(1.0 / np.sqrt(n_ff), n_embd, n_ff)
    yield "output_norm.weight", ones
    # A separate (untied) output matrix: tied to token_embd, the argmax would echo the last token.
    yield "output.weight", normal(LOGIT_STD / np.sqrt(n_embd), n_vocab, n_embd)
