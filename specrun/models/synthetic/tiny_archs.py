"""Tiny random-weight GGUF models of current architectures: hybrid, MoE and pure recurrent.

Tests of hybrid (Gated DeltaNet, short-conv, Mamba) and mixture-of-experts models need those
models without a download. Each writer here lays out the tensors and hyperparameters the vendored
llama.cpp's loader asks for (src/models/<arch>.cpp), fills them with seeded random weights and
copies a real tokenizer from a vocab-only GGUF. The models load in milliseconds; their size is
mostly the embedding and output matrices (stored Q8_0, a few MB per 100k tokens of vocabulary).

Architectures: `qwen35` (Gated DeltaNet + attention, can roll back its recurrent state),
`qwen35moe` (the same with routed + shared experts), `lfm2` (short convolutions + attention, can
roll back), `gpt-oss` (MoE attention model with sinks and sliding window), `gemma4` (window and
global attention layers of different head sizes, shared KV layers, per-layer embeddings),
`jamba` (Mamba + attention, cannot roll back), `nemotron_h` (Mamba-2, attention and MLP-only
blocks, can roll back) and `mamba` (pure recurrent).

Needs the `gguf` package.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrun.models.shapes import add_key
from specrun.models.synthetic.gguf_writer import (
    add_tokenizer,
    read_tokenizer,
    write_gguf,
)
from specrun.models.synthetic.tiny_llama import LOGIT_STD

ARCHITECTURES = ("qwen35", "qwen35moe", "lfm2", "gpt-oss", "gemma4", "jamba", "nemotron_h", "mamba")

CONTEXT_LENGTH = 8192
RMS_NORM_EPS = 1e-6


@dataclass
class _Layout:
    """What one architecture's file holds: metadata keys and tensors (ggml dims, fill kind)."""

    arch: str
    keys: dict[str, object] = field(default_factory=dict)
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)

    def key(self, name: str, value: object) -> None:
        self.keys[f"{self.arch}.{name}"] = value

    def tensor(self, name: str, dims: tuple[int, ...], kind: str = "w") -> None:
        self.tensors.append((name, tuple(int(d) for d in dims), kind))


def write_arch_model(arch: str, base_gguf: Path, dst: Path, seed: int = 0, mtp: bool = False) -> None:
    """Write a random-weight `arch` model to `dst` with exactly `base_gguf`'s tokenizer.

    `mtp` appends one MTP (next-token-prediction) block after the trunk, as the publishers' *-MTP
    files carry it (qwen35 only). The same arguments give a byte-identical file; the file appears
    atomically.
    """
    import gguf

    if arch not in _LAYOUTS:
        raise ValueError(f"no tiny layout for architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    base_gguf, dst = Path(base_gguf), Path(dst)
    tokenizer = read_tokenizer(base_gguf.resolve())
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][1])
    if mtp and arch != "qwen35":
        raise ValueError(f"no tiny MTP layout for architecture {arch!r} (qwen35 only)")
    layout = _qwen35(n_vocab, mtp=True) if mtp else _LAYOUTS[arch](n_vocab)

    def fill(writer) -> None:
        writer.add_name(f"specrun random {arch} (seed {seed})")
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        writer.add_uint32(f"{arch}.context_length", CONTEXT_LENGTH)
        writer.add_uint32(f"{arch}.vocab_size", n_vocab)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", RMS_NORM_EPS)
        for key, value in layout.keys.items():
            add_key(writer, key, value)
        add_tokenizer(writer, tokenizer)
        for name, array, qtype in _fill(layout, seed):
            if qtype is None:
                writer.add_tensor(name, array)
            else:
                writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    write_gguf(dst, arch, fill)


def _fill(layout: _Layout, seed: int) -> Iterator[tuple[str, np.ndarray, object]]:
    """Yield (name, float32 array in numpy order = ggml dims reversed, quant type or None)."""
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    for name, dims, kind in layout.tensors:
        shape = tuple(reversed(dims))
        qtype = None
        if kind == "w":  # a weight matrix: 1/sqrt(fan_in) keeps activations at scale
            array = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(dims[0]))
        elif kind in ("embd", "out"):  # the big vocabulary matrices, stored Q8_0
            std = 1.0 if kind == "embd" else LOGIT_STD / np.sqrt(dims[0])
            array = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            qtype = GGMLQuantizationType.Q8_0
        elif kind == "ones":
            array = np.ones(shape, dtype=np.float32)
        elif kind == "zeros":
            array = np.zeros(shape, dtype=np.float32)
        elif kind == "decay":  # negative state decay rates (A of an SSM)
            array = -rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
        elif kind == "dt_bias":  # softplus(-4) ~ 0.02: a slowly moving state
            array = np.full(shape, -4.0, dtype=np.float32)
        else:
            raise ValueError(f"unknown fill kind {kind!r}")
        yield name, np.ascontiguousarray(array, dtype=np.float32), qtype


# --------------------------------------------------------------------------------------------
# Layouts, read from the loaders in the vendored llama.cpp (src/models/<arch>.cpp).

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_FF = 128
N_EXPERT = 4
N_EXPERT_USED = 2
N_FF_EXP = 32


def _common(arch: str, n_vocab: int, n_layer: int) -> _Layout:
    lay = _Layout(arch)
    lay.key("embedding_length", N_EMBD)
    lay.key("block_count", n_layer)
    lay.tensor("token_embd.weight", (N_EMBD, n_vocab), "embd")
    # A separate (untied) output matrix: tied to token_embd, the argmax would echo the last token.
    lay.tensor("output.weight", (N_EMBD, n_vocab), "out")
    return lay


def _attention(lay: _Layout, blk: str, n_q: int, qk_norm: bool) -> None:
    n_kv = N_HEAD_KV * HEAD_DIM
    lay.tensor(f"{blk}.attn_q.weight", (N_EMBD, n_q))
    lay.tensor(f"{blk}.attn_k.weight", (N_EMBD, n_kv))
    lay.tensor(f"{blk}.attn_v.weight", (N_EMBD, n_kv))
    lay.tensor(f"{blk}.attn_output.weight", (N_HEAD * HEAD_DIM, N_EMBD))
    if qk_norm:
        lay.tensor(f"{blk}.attn_q_norm.weight", (HEAD_DIM,), "ones")
        lay.tensor(f"{blk}.attn_k_norm.weight", (HEAD_DIM,), "ones")


def _dense_ffn(lay: _Layout, blk: str, n_ff: int = N_FF) -> None:
    lay.tensor(f"{blk}.ffn_gate.weight", (N_EMBD, n_ff))
    lay.tensor(f"{blk}.ffn_up.weight", (N_EMBD, n_ff))
    lay.tensor(f"{blk}.ffn_down.weight", (n_ff, N_EMBD))


def _experts(lay: _Layout, blk: str, biases: bool) -> None:
    lay.tensor(f"{blk}.ffn_gate_inp.weight", (N_EMBD, N_EXPERT))
    lay.tensor(f"{blk}.ffn_gate_exps.weight", (N_EMBD, N_FF_EXP, N_EXPERT))
    lay.tensor(f"{blk}.ffn_up_exps.weight", (N_EMBD, N_FF_EXP, N_EXPERT))
    lay.tensor(f"{blk}.ffn_down_exps.weight", (N_FF_EXP, N_EMBD, N_EXPERT))
    if biases:
        lay.tensor(f"{blk}.ffn_gate_inp.bias", (N_EXPERT,), "zeros")
        lay.tensor(f"{blk}.ffn_gate_exps.bias", (N_FF_EXP, N_EXPERT), "zeros")
        lay.tensor(f"{blk}.ffn_up_exps.bias", (N_FF_EXP, N_EXPERT), "zeros")
        lay.tensor(f"{blk}.ffn_down_exps.bias", (N_EMBD, N_EXPERT), "zeros")


def _qwen35(n_vocab: int, moe: bool = False, mtp: bool = False) -> _Layout:
    """Three Gated DeltaNet layers, then one gated attention layer (full_attention_interval 4);
    with `mtp`, one MTP block after them (src/models/qwen35.cpp, load_block_mtp)."""
    n_layer = 4
    lay = _common("qwen35moe" if moe else "qwen35", n_vocab, n_layer + (1 if mtp else 0))
    d_state, n_group, n_v_heads, d_conv = HEAD_DIM, 2, 4, 4
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads
    lay.key("feed_forward_length", N_FF)
    lay.key("attention.head_count", N_HEAD)
    lay.key("attention.head_count_kv", N_HEAD_KV)
    lay.key("attention.key_length", HEAD_DIM)
    lay.key("attention.value_length", HEAD_DIM)
    lay.key("rope.dimension_count", HEAD_DIM)
    lay.key("rope.dimension_sections", [3, 3, 2, 0])  # sums to rope dims / 2
    lay.key("rope.freq_base", 10000000.0)
    lay.key("full_attention_interval", 4)
    lay.key("ssm.conv_kernel", d_conv)
    lay.key("ssm.inner_size", value_dim)
    lay.key("ssm.state_size", d_state)
    lay.key("ssm.time_step_rank", n_v_heads)
    lay.key("ssm.group_count", n_group)
    if moe:
        lay.key("expert_count", N_EXPERT)
        lay.key("expert_used_count", N_EXPERT_USED)
        lay.key("expert_feed_forward_length", N_FF_EXP)
        lay.key("expert_shared_feed_forward_length", N_FF_EXP * 2)
    lay.tensor("output_norm.weight", (N_EMBD,), "ones")
    for i in range(n_layer):
        blk = f"blk.{i}"
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.post_attention_norm.weight", (N_EMBD,), "ones")
        if (i + 1) % 4:  # recurrent (Gated DeltaNet)
            lay.tensor(f"{blk}.attn_qkv.weight", (N_EMBD, 2 * key_dim + value_dim))
            lay.tensor(f"{blk}.attn_gate.weight", (N_EMBD, value_dim))
            lay.tensor(f"{blk}.ssm_conv1d.weight", (d_conv, 2 * key_dim + value_dim))
            lay.tensor(f"{blk}.ssm_dt.bias", (n_v_heads,), "zeros")
            lay.tensor(f"{blk}.ssm_a", (n_v_heads,), "decay")
            lay.tensor(f"{blk}.ssm_beta.weight", (N_EMBD, n_v_heads))
            lay.tensor(f"{blk}.ssm_alpha.weight", (N_EMBD, n_v_heads))
            lay.tensor(f"{blk}.ssm_norm.weight", (d_state,), "ones")
            lay.tensor(f"{blk}.ssm_out.weight", (value_dim, N_EMBD))
        else:  # the query projection carries a gate: 2 x heads x head_dim
            _attention(lay, blk, 2 * N_HEAD * HEAD_DIM, qk_norm=True)
        if moe:
            _experts(lay, blk, biases=False)
            n_shexp = N_FF_EXP * 2
            lay.tensor(f"{blk}.ffn_gate_inp_shexp.weight", (N_EMBD,))
            lay.tensor(f"{blk}.ffn_gate_shexp.weight", (N_EMBD, n_shexp))
            lay.tensor(f"{blk}.ffn_up_shexp.weight", (N_EMBD, n_shexp))
            lay.tensor(f"{blk}.ffn_down_shexp.weight", (n_shexp, N_EMBD))
        else:
            _dense_ffn(lay, blk)
    if mtp:
        _mtp_block(lay, f"blk.{n_layer}")
    return lay


def _mtp_block(lay: _Layout, blk: str) -> None:
    """One MTP block: a full-attention decoder block plus the nextn projections and norms
    (llama.cpp counts it in block_count and names it by nextn_predict_layers)."""
    lay.key("nextn_predict_layers", 1)
    lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
    lay.tensor(f"{blk}.post_attention_norm.weight", (N_EMBD,), "ones")
    _attention(lay, blk, 2 * N_HEAD * HEAD_DIM, qk_norm=True)
    _dense_ffn(lay, blk)
    lay.tensor(f"{blk}.nextn.eh_proj.weight", (2 * N_EMBD, N_EMBD))
    lay.tensor(f"{blk}.nextn.enorm.weight", (N_EMBD,), "ones")
    lay.tensor(f"{blk}.nextn.hnorm.weight", (N_EMBD,), "ones")
    lay.tensor(f"{blk}.nextn.shared_head_norm.weight", (N_EMBD,), "ones")


def _lfm2(n_vocab: int) -> _Layout:
    """Short-convolution layers with one attention layer (head_count_kv 0 marks the conv layers)."""
    kinds = ["conv", "conv", "attn", "conv"]
    lay = _common("lfm2", n_vocab, len(kinds))
    lay.key("feed_forward_length", N_FF)
    lay.key("attention.head_count", N_HEAD)
    lay.key("attention.head_count_kv", [N_HEAD_KV if k == "attn" else 0 for k in kinds])
    lay.key("rope.freq_base", 1000000.0)
    lay.key("shortconv.l_cache", 3)
    lay.tensor("token_embd_norm.weight", (N_EMBD,), "ones")  # lfm2's output norm
    for i, kind in enumerate(kinds):
        blk = f"blk.{i}"
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.ffn_norm.weight", (N_EMBD,), "ones")
        if kind == "attn":
            _attention(lay, blk, N_HEAD * HEAD_DIM, qk_norm=True)
        else:
            lay.tensor(f"{blk}.shortconv.conv.weight", (3, N_EMBD))
            lay.tensor(f"{blk}.shortconv.in_proj.weight", (N_EMBD, 3 * N_EMBD))
            lay.tensor(f"{blk}.shortconv.out_proj.weight", (N_EMBD, N_EMBD))
        _dense_ffn(lay, blk)
    return lay


def _gpt_oss(n_vocab: int) -> _Layout:
    """Two attention layers (sliding window, then full) with sinks and biased routed experts."""
    n_layer = 2
    lay = _common("gpt-oss", n_vocab, n_layer)
    lay.key("feed_forward_length", N_FF)
    lay.key("attention.head_count", N_HEAD)
    lay.key("attention.head_count_kv", N_HEAD_KV)
    lay.key("attention.key_length", HEAD_DIM)
    lay.key("attention.value_length", HEAD_DIM)
    lay.key("rope.dimension_count", HEAD_DIM)
    lay.key("rope.freq_base", 150000.0)
    lay.key("attention.sliding_window", 128)
    lay.key("expert_count", N_EXPERT)
    lay.key("expert_used_count", N_EXPERT_USED)
    lay.key("expert_feed_forward_length", N_FF_EXP)
    lay.tensor("output_norm.weight", (N_EMBD,), "ones")
    for i in range(n_layer):
        blk = f"blk.{i}"
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.post_attention_norm.weight", (N_EMBD,), "ones")
        _attention(lay, blk, N_HEAD * HEAD_DIM, qk_norm=False)
        lay.tensor(f"{blk}.attn_output.bias", (N_EMBD,), "zeros")
        lay.tensor(f"{blk}.attn_sinks.weight", (N_HEAD,), "zeros")
        _experts(lay, blk, biases=True)
    return lay


def _gemma4(n_vocab: int) -> _Layout:
    """Gemma 4 as its small (E2B/E4B) files lay it out (src/models/gemma4.cpp): sliding-window
    layers with narrow heads and global layers with heads twice as wide and fewer KV heads
    (key_length vs key_length_swa, a per-layer head_count_kv); the last layers keep no KV cache of
    their own but read an earlier layer's (shared_kv_layers), with MLPs twice as wide; and
    per-layer token embeddings mixed into every layer's output."""
    swa = [True, True, False, True, True, False]
    n_layer, n_shared = len(swa), 3
    n_kv_layers = n_layer - n_shared
    # llama.cpp points a shared window layer at layer n_kv_layers - 2 and a shared global layer at
    # n_kv_layers - 1: the last two layers with a cache must be a window one, then a global one.
    assert swa[n_kv_layers - 2] and not swa[n_kv_layers - 1]
    head_swa, head_full = HEAD_DIM, 2 * HEAD_DIM
    n_per_layer = 16  # n_layer x 16 = 96 values a token: whole Q8_0 blocks of 32
    lay = _common("gemma4", n_vocab, n_layer)
    lay.key("feed_forward_length", [N_FF if i < n_kv_layers else 2 * N_FF for i in range(n_layer)])
    lay.key("attention.head_count", N_HEAD)
    lay.key("attention.head_count_kv", [N_HEAD_KV if s else 1 for s in swa])
    lay.key("attention.key_length", head_full)
    lay.key("attention.value_length", head_full)
    lay.key("attention.key_length_swa", head_swa)
    lay.key("attention.value_length_swa", head_swa)
    lay.key("attention.sliding_window", 128)
    lay.key("attention.sliding_window_pattern", swa)
    lay.key("attention.shared_kv_layers", n_shared)
    lay.key("embedding_length_per_layer_input", n_per_layer)
    lay.key("rope.dimension_count", head_full)
    lay.key("rope.dimension_count_swa", head_swa)
    lay.key("rope.freq_base", 1000000.0)
    lay.key("rope.freq_base_swa", 10000.0)
    lay.key("final_logit_softcapping", 30.0)
    lay.tensor("per_layer_token_embd.weight", (n_per_layer * n_layer, n_vocab), "embd")
    lay.tensor("per_layer_model_proj.weight", (N_EMBD, n_per_layer * n_layer))
    lay.tensor("per_layer_proj_norm.weight", (n_per_layer,), "ones")
    lay.tensor("output_norm.weight", (N_EMBD,), "ones")
    # the global layers' rope frequency factors, one tensor for all of them (factors of 1: plain rope)
    lay.tensor("rope_freqs.weight", (head_full // 2,), "ones")
    for i, window in enumerate(swa):
        blk, head = f"blk.{i}", head_swa if window else head_full
        n_kv = (N_HEAD_KV if window else 1) * head
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.attn_q.weight", (N_EMBD, N_HEAD * head))
        lay.tensor(f"{blk}.attn_q_norm.weight", (head,), "ones")
        if i < n_kv_layers:  # a shared layer has no keys or values of its own
            lay.tensor(f"{blk}.attn_k.weight", (N_EMBD, n_kv))
            lay.tensor(f"{blk}.attn_v.weight", (N_EMBD, n_kv))
            lay.tensor(f"{blk}.attn_k_norm.weight", (head,), "ones")
        lay.tensor(f"{blk}.attn_output.weight", (N_HEAD * head, N_EMBD))
        lay.tensor(f"{blk}.post_attention_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.ffn_norm.weight", (N_EMBD,), "ones")
        _dense_ffn(lay, blk, N_FF if i < n_kv_layers else 2 * N_FF)
        lay.tensor(f"{blk}.post_ffw_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.inp_gate.weight", (N_EMBD, n_per_layer))
        lay.tensor(f"{blk}.proj.weight", (n_per_layer, N_EMBD))
        lay.tensor(f"{blk}.post_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.layer_output_scale.weight", (1,), "ones")
    return lay


def _mamba_layer(lay: _Layout, blk: str, d_inner: int, d_state: int, dt_rank: int, norms: bool) -> None:
    d_conv = 4
    lay.tensor(f"{blk}.ssm_in.weight", (N_EMBD, 2 * d_inner))
    lay.tensor(f"{blk}.ssm_conv1d.weight", (d_conv, d_inner))
    lay.tensor(f"{blk}.ssm_conv1d.bias", (d_inner,), "zeros")
    lay.tensor(f"{blk}.ssm_x.weight", (d_inner, dt_rank + 2 * d_state))
    lay.tensor(f"{blk}.ssm_dt.weight", (dt_rank, d_inner))
    lay.tensor(f"{blk}.ssm_dt.bias", (d_inner,), "dt_bias")
    lay.tensor(f"{blk}.ssm_a", (d_state, d_inner), "decay")
    lay.tensor(f"{blk}.ssm_d", (d_inner,), "ones")
    lay.tensor(f"{blk}.ssm_out.weight", (d_inner, N_EMBD))
    if norms:  # jamba normalises dt, B and C
        lay.tensor(f"{blk}.ssm_dt_norm.weight", (dt_rank,), "ones")
        lay.tensor(f"{blk}.ssm_b_norm.weight", (d_state,), "ones")
        lay.tensor(f"{blk}.ssm_c_norm.weight", (d_state,), "ones")


def _ssm_keys(lay: _Layout, d_inner: int, d_state: int, dt_rank: int) -> None:
    lay.key("ssm.conv_kernel", 4)
    lay.key("ssm.inner_size", d_inner)
    lay.key("ssm.state_size", d_state)
    lay.key("ssm.time_step_rank", dt_rank)


def _jamba(n_vocab: int) -> _Layout:
    """A Mamba layer and an attention layer (head_count_kv 0 marks the Mamba one), dense FFNs."""
    kinds = ["ssm", "attn"]
    lay = _common("jamba", n_vocab, len(kinds))
    d_inner, d_state, dt_rank = 2 * N_EMBD, 16, 4
    lay.key("feed_forward_length", N_FF)
    lay.key("attention.head_count", N_HEAD)
    lay.key("attention.head_count_kv", [N_HEAD_KV if k == "attn" else 0 for k in kinds])
    _ssm_keys(lay, d_inner, d_state, dt_rank)
    lay.tensor("output_norm.weight", (N_EMBD,), "ones")
    for i, kind in enumerate(kinds):
        blk = f"blk.{i}"
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
        lay.tensor(f"{blk}.ffn_norm.weight", (N_EMBD,), "ones")
        if kind == "attn":
            _attention(lay, blk, N_HEAD * HEAD_DIM, qk_norm=False)
        else:
            _mamba_layer(lay, blk, d_inner, d_state, dt_rank, norms=True)
        _dense_ffn(lay, blk)
    return lay


def _nemotron_h(n_vocab: int) -> _Layout:
    """Nemotron-H's three kinds of block (src/models/nemotron-h.cpp): Mamba-2 mixers, attention
    without an FFN, and MLP-only blocks (squared ReLU, no gate). llama.cpp reads a block's kind
    from the per-layer arrays: head_count_kv > 0 is attention, feed_forward_length > 0 an MLP,
    both 0 a Mamba-2 mixer."""
    kinds = ["mamba", "mlp", "mamba", "attn", "mlp"]
    lay = _common("nemotron_h", n_vocab, len(kinds))
    # Mamba-2: time_step_rank is the number of SSM heads (d_inner / heads = 16 wide), B and C in groups
    d_inner, d_state, n_ssm_head, n_group, d_conv = 2 * N_EMBD, 16, 8, 2, 4
    d_xbc = d_inner + 2 * n_group * d_state
    lay.key("feed_forward_length", [N_FF if k == "mlp" else 0 for k in kinds])
    lay.key("attention.head_count", N_HEAD)
    lay.key("attention.head_count_kv", [N_HEAD_KV if k == "attn" else 0 for k in kinds])
    lay.key("attention.key_length", HEAD_DIM)
    lay.key("attention.value_length", HEAD_DIM)
    lay.key("attention.layer_norm_epsilon", 1e-5)  # required beside the RMS one
    _ssm_keys(lay, d_inner, d_state, n_ssm_head)
    lay.key("ssm.group_count", n_group)
    lay.tensor("output_norm.weight", (N_EMBD,), "ones")
    for i, kind in enumerate(kinds):
        blk = f"blk.{i}"
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")  # every block's one norm
        if kind == "mamba":  # in_proj yields z, x, B, C and one dt per head
            lay.tensor(f"{blk}.ssm_in.weight", (N_EMBD, d_inner + d_xbc + n_ssm_head))
            lay.tensor(f"{blk}.ssm_conv1d.weight", (d_conv, d_xbc))
            lay.tensor(f"{blk}.ssm_conv1d.bias", (d_xbc,), "zeros")  # the graph adds it unconditionally
            lay.tensor(f"{blk}.ssm_dt.bias", (n_ssm_head,), "dt_bias")
            lay.tensor(f"{blk}.ssm_a", (1, n_ssm_head), "decay")
            lay.tensor(f"{blk}.ssm_d", (1, n_ssm_head), "ones")
            lay.tensor(f"{blk}.ssm_norm.weight", (d_inner // n_group, n_group), "ones")
            lay.tensor(f"{blk}.ssm_out.weight", (d_inner, N_EMBD))
        elif kind == "attn":
            _attention(lay, blk, N_HEAD * HEAD_DIM, qk_norm=False)
        else:
            lay.tensor(f"{blk}.ffn_up.weight", (N_EMBD, N_FF))
            lay.tensor(f"{blk}.ffn_down.weight", (N_FF, N_EMBD))
    return lay


def _mamba(n_vocab: int) -> _Layout:
    """Two Mamba layers: a pure recurrent model (no attention, no KV cache)."""
    n_layer = 2
    lay = _common("mamba", n_vocab, n_layer)
    d_inner, d_state, dt_rank = 2 * N_EMBD, 16, 4
    _ssm_keys(lay, d_inner, d_state, dt_rank)
    lay.tensor("output_norm.weight", (N_EMBD,), "ones")
    for i in range(n_layer):
        blk = f"blk.{i}"
        lay.tensor(f"{blk}.attn_norm.weight", (N_EMBD,), "ones")
        _mamba_layer(lay, blk, d_inner, d_state, dt_rank, norms=False)
    return lay


_LAYOUTS = {
    "qwen35": _qwen35,
    "qwen35moe": lambda n_vocab: _qwen35(n_vocab, moe=True),
    "lfm2": _lfm2,
    "gpt-oss": _gpt_oss,
    "gemma4": _gemma4,
    "jamba": _jamba,
    "nemotron_h": _nemotron_h,
    "mamba": _mamba,
}
