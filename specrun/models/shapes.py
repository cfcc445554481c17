"""Published model shapes: what a model's GGUF holds, from the facts the registry carries.

A registry entry may say how its model is built (`shape` in models.toml: layers, widths, heads,
head sizes, windows, experts, the recurrent layers of hybrids, MTP blocks). From those facts and
the entry's quantization this module lays out every tensor as llama.cpp's loader asks for it
(src/models/<arch>.cpp) with the types llama.cpp's quantizer gives it (src/llama-quant.cpp), and
writes a header-only GGUF of it: metadata, a placeholder vocabulary of the model's size and the
tensor infos, the weights a hole of their size (a sparse file). llama.cpp's allocation
simulation reads such a file as it reads the real one, so a model can be planned with no network
and no download (models.headers fetches the real header where the hub can be reached; this is
the fallback). The vocabulary's strings are placeholders: only its size matters to memory.

Random-weight models of these shapes (models.synthetic.real_shapes) are written from the same
layouts.
"""

from __future__ import annotations

import hashlib
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from specrun import paths
from specrun.files import atomic_path

# Raise when the written file changes for the same facts: cached copies are then rewritten.
WRITER_VERSION = 1
QK_K = 256
# A k-quant needs rows of whole 256-weight blocks; llama.cpp's quantizer falls back otherwise.
K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# Quantizations the registry names whose tensor types are laid out here (unsloth's "UD" files
# raise some tensors' bits: planned as the plain mix, a few percent under).
QUANTS = ("Q4_K_M", "UD-Q4_K_M", "Q8_0", "MXFP4", "F16", "BF16", "F32")
LAYER_KINDS = ("attn", "conv", "window")


@dataclass(frozen=True)
class Shape:
    """A model's architecture and sizes, as its GGUF metadata states them (llama.cpp's names)."""

    arch: str  # llama, qwen2, qwen3, qwen3moe, gemma3, gemma4, gpt-oss, qwen35, qwen35moe, lfm2
    n_layer: int  # blocks of the trunk (MTP blocks apart: n_mtp)
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rope_theta: float = 1_000_000.0
    tied_output: bool = False
    head_dim: int = 0  # 0: n_embd // n_head
    n_expert: int = 0  # mixture of experts: experts per layer, used per token, their FFN width
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # a shared expert's width (qwen35moe)
    n_ctx_train: int = 32768
    sliding_window: int = 0  # gemma3 (every 6th layer global), gpt-oss (every other layer)
    full_attention_interval: int = 0  # qwen35: every k-th layer attention, the others Gated DeltaNet
    ssm_state: int = 0  # Gated DeltaNet: head size, key heads (groups), value heads, conv kernel
    ssm_groups: int = 0
    ssm_heads: int = 0
    ssm_conv: int = 4
    layer_kinds: tuple[str, ...] = ()  # per layer: lfm2 "conv" or "attn"; gemma4 "window" or "attn" (global)
    conv_cache: int = 3  # lfm2's short convolutions
    n_mtp: int = 0  # MTP (next-token prediction) blocks after the trunk
    # gemma4: window layers' head size and KV heads (head_dim, n_head_kv: the global layers'), the
    # last layers reading an earlier layer's KV (with MLPs n_ff_shared wide where not 0), per-layer
    # token embeddings of this width, global layers whose values are their keys (no V projection)
    global_every: int = 0  # every k-th layer global, the others a window (when layer_kinds are not given)
    head_dim_swa: int = 0
    n_head_kv_swa: int = 0
    shared_kv_layers: int = 0
    n_ff_shared: int = 0
    n_embd_per_layer: int = 0
    kv_equal: bool = False

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def scaled(self, n_layer: int, n_embd: int, n_ff: int, n_vocab: int | None = None) -> Shape:
        """Return the same architecture shrunk (tests build these in seconds); experts too."""
        heads = max(1, min(self.n_head, n_embd // 64))
        kv = max(1, heads // max(1, self.n_head // self.n_head_kv))
        experts = {"n_expert": min(self.n_expert, 8), "n_expert_used": min(self.n_expert_used, 2),
                   "n_ff_exp": n_ff} if self.n_expert else {}
        return replace(self, n_layer=n_layer, n_embd=n_embd, n_head=heads, n_head_kv=kv, n_ff=n_ff, head_dim=0,
                       n_vocab=n_vocab or self.n_vocab, **experts)

    @classmethod
    def from_table(cls, table: dict, arch: str | None = None) -> Shape:
        """Return the shape a registry table states (ValueError: one line saying what is wrong)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ValueError(f"unknown shape key '{unknown[0]}' (known: {', '.join(known)})")
        values = dict(table)
        values.setdefault("arch", arch)
        missing = [name for name, f in known.items() if name not in values and f.default is MISSING]
        if missing:
            raise ValueError(f"shape has no '{missing[0]}'")
        if "layer_kinds" in values:
            kinds = tuple(values["layer_kinds"])
            if any(k not in LAYER_KINDS for k in kinds):
                raise ValueError(f"layer_kinds are {' or '.join(LAYER_KINDS)}, not {sorted(set(kinds) - set(LAYER_KINDS))}")
            values["layer_kinds"] = kinds
        for name, value in values.items():
            want = known[name].type
            if name == "layer_kinds" or value is None:
                continue
            ok = (isinstance(value, bool) if want == "bool" else isinstance(value, str) if want == "str"
                  else isinstance(value, (int, float)) and not isinstance(value, bool) if want == "float"
                  else isinstance(value, int) and not isinstance(value, bool) and value >= 0)
            if not ok:
                raise ValueError(f"shape key '{name}' must be {'a number' if want == 'float' else want}, not {value!r}")
        shape = cls(**values)
        if shape.arch not in LAYOUTS:
            raise ValueError(f"no layout for architecture {shape.arch!r} (one of {', '.join(LAYOUTS)})")
        return shape


# --------------------------------------------------------------------------------------------
# Layouts: (name, ggml dims) of every tensor and the metadata keys, as the vendored llama.cpp's
# loaders ask for them. Dims are ggml's: the row length first.


class _Layout:
    def __init__(self, shape: Shape):
        self.shape, self.keys, self.tensors = shape, {}, []
        self.key("context_length", shape.n_ctx_train)
        self.key("embedding_length", shape.n_embd)
        self.key("block_count", shape.n_layer + shape.n_mtp)
        self.key("vocab_size", shape.n_vocab)
        self.key("attention.layer_norm_rms_epsilon", 1e-6)
        self.key("rope.freq_base", float(shape.rope_theta))

    def key(self, name: str, value) -> None:
        self.keys[f"{self.shape.arch}.{name}"] = value

    def tensor(self, name: str, *dims: int) -> None:
        self.tensors.append((name, tuple(int(d) for d in dims)))

    def norm(self, name: str, width: int | None = None) -> None:
        self.tensor(name, width or self.shape.n_embd)


def _heads(lay: _Layout, n_head_kv=None) -> None:
    s = lay.shape
    lay.key("attention.head_count", s.n_head)
    lay.key("attention.head_count_kv", s.n_head_kv if n_head_kv is None else n_head_kv)
    lay.key("attention.key_length", s.n_embd_head)
    lay.key("attention.value_length", s.n_embd_head)
    lay.key("rope.dimension_count", s.n_embd_head)


def _embeddings(lay: _Layout, output_norm: str = "output_norm.weight") -> None:
    s = lay.shape
    lay.tensor("token_embd.weight", s.n_embd, s.n_vocab)
    lay.norm(output_norm)
    if not s.tied_output:
        lay.tensor("output.weight", s.n_embd, s.n_vocab)


def _attention(lay: _Layout, blk: str, q_width: int | None = None, qk_norm: bool = False, biases: bool = False) -> None:
    s = lay.shape
    q, kv = s.n_head * s.n_embd_head, s.n_head_kv * s.n_embd_head
    lay.tensor(f"{blk}.attn_q.weight", s.n_embd, q_width or q)
    lay.tensor(f"{blk}.attn_k.weight", s.n_embd, kv)
    lay.tensor(f"{blk}.attn_v.weight", s.n_embd, kv)
    lay.tensor(f"{blk}.attn_output.weight", q, s.n_embd)
    if biases:
        lay.tensor(f"{blk}.attn_q.bias", q)
        lay.tensor(f"{blk}.attn_k.bias", kv)
        lay.tensor(f"{blk}.attn_v.bias", kv)
    if qk_norm:
        lay.norm(f"{blk}.attn_q_norm.weight", s.n_embd_head)
        lay.norm(f"{blk}.attn_k_norm.weight", s.n_embd_head)


def _ffn(lay: _Layout, blk: str, width: int | None = None, suffix: str = "") -> None:
    s, n_ff = lay.shape, width or lay.shape.n_ff
    lay.tensor(f"{blk}.ffn_gate{suffix}.weight", s.n_embd, n_ff)
    lay.tensor(f"{blk}.ffn_up{suffix}.weight", s.n_embd, n_ff)
    lay.tensor(f"{blk}.ffn_down{suffix}.weight", n_ff, s.n_embd)


def _experts(lay: _Layout, blk: str, biases: bool = False) -> None:
    s = lay.shape
    lay.tensor(f"{blk}.ffn_gate_inp.weight", s.n_embd, s.n_expert)
    lay.tensor(f"{blk}.ffn_gate_exps.weight", s.n_embd, s.n_ff_exp, s.n_expert)
    lay.tensor(f"{blk}.ffn_up_exps.weight", s.n_embd, s.n_ff_exp, s.n_expert)
    lay.tensor(f"{blk}.ffn_down_exps.weight", s.n_ff_exp, s.n_embd, s.n_expert)
    if biases:
        lay.tensor(f"{blk}.ffn_gate_inp.bias", s.n_expert)
        lay.tensor(f"{blk}.ffn_gate_exps.bias", s.n_ff_exp, s.n_expert)
        lay.tensor(f"{blk}.ffn_up_exps.bias", s.n_ff_exp, s.n_expert)
        lay.tensor(f"{blk}.ffn_down_exps.bias", s.n_embd, s.n_expert)


def _expert_keys(lay: _Layout) -> None:
    s = lay.shape
    lay.key("expert_count", s.n_expert)
    lay.key("expert_used_count", s.n_expert_used)
    lay.key("expert_feed_forward_length", s.n_ff_exp)


def _transformer(lay: _Layout) -> _Layout:
    """llama, qwen2 (q/k/v biases), qwen3 (q/k norms), qwen3moe (and routed experts)."""
    s = lay.shape
    lay.key("feed_forward_length", s.n_ff)
    _heads(lay)
    if s.n_expert:
        _expert_keys(lay)
    _embeddings(lay)
    for i in range(s.n_layer):
        blk = f"blk.{i}"
        lay.norm(f"{blk}.attn_norm.weight")
        _attention(lay, blk, qk_norm=s.arch in ("qwen3", "qwen3moe"), biases=s.arch == "qwen2")
        lay.norm(f"{blk}.ffn_norm.weight")
        if s.n_expert:
            _experts(lay, blk)
        else:
            _ffn(lay, blk)
    return lay


def _gemma3(lay: _Layout) -> _Layout:
    """Gemma 3: sandwich norms, q/k norms, a tied head; five window layers to one global."""
    s = lay.shape
    lay.key("feed_forward_length", s.n_ff)
    _heads(lay)
    if s.sliding_window:
        lay.key("attention.sliding_window", s.sliding_window)
    _embeddings(lay)
    for i in range(s.n_layer):
        blk = f"blk.{i}"
        lay.norm(f"{blk}.attn_norm.weight")
        _attention(lay, blk, qk_norm=True)
        lay.norm(f"{blk}.post_attention_norm.weight")
        lay.norm(f"{blk}.ffn_norm.weight")
        _ffn(lay, blk)
        lay.norm(f"{blk}.post_ffw_norm.weight")
    return lay


def _gpt_oss(lay: _Layout) -> _Layout:
    """gpt-oss: window and full attention layers in turn, with sinks and biased routed experts."""
    s = lay.shape
    lay.key("feed_forward_length", s.n_ff)
    _heads(lay)
    lay.key("attention.sliding_window", s.sliding_window)
    _expert_keys(lay)
    _embeddings(lay)
    for i in range(s.n_layer):
        blk = f"blk.{i}"
        lay.norm(f"{blk}.attn_norm.weight")
        lay.norm(f"{blk}.post_attention_norm.weight")
        _attention(lay, blk, biases=True)
        lay.tensor(f"{blk}.attn_output.bias", s.n_embd)
        lay.tensor(f"{blk}.attn_sinks.weight", s.n_head)
        _experts(lay, blk, biases=True)
    return lay


def _qwen35(lay: _Layout) -> _Layout:
    """Qwen3.5: Gated DeltaNet layers, every full_attention_interval-th one gated attention (its
    query projection twice as wide: it carries the gate), dense or routed + shared experts; MTP
    blocks after the trunk (load_block_mtp)."""
    s = lay.shape
    key_dim, value_dim = s.ssm_state * s.ssm_groups, s.ssm_state * s.ssm_heads
    lay.key("feed_forward_length", s.n_ff)
    _heads(lay)
    lay.key("rope.dimension_count", s.n_embd_head // 4)  # partial rotary: a quarter of the head
    lay.key("rope.dimension_sections", [11, 11, 10, 0])
    lay.key("full_attention_interval", s.full_attention_interval)
    lay.key("ssm.conv_kernel", s.ssm_conv)
    lay.key("ssm.inner_size", value_dim)
    lay.key("ssm.state_size", s.ssm_state)
    lay.key("ssm.time_step_rank", s.ssm_heads)
    lay.key("ssm.group_count", s.ssm_groups)
    if s.n_expert:
        _expert_keys(lay)
        lay.key("expert_shared_feed_forward_length", s.n_ff_shexp)
    if s.n_mtp:
        lay.key("nextn_predict_layers", s.n_mtp)
    _embeddings(lay)

    def mlp(blk: str) -> None:
        if s.n_expert:
            _experts(lay, blk)
            lay.tensor(f"{blk}.ffn_gate_inp_shexp.weight", s.n_embd)
            _ffn(lay, blk, s.n_ff_shexp, "_shexp")
        else:
            _ffn(lay, blk)

    for i in range(s.n_layer + s.n_mtp):
        blk = f"blk.{i}"
        lay.norm(f"{blk}.attn_norm.weight")
        lay.norm(f"{blk}.post_attention_norm.weight")
        if i < s.n_layer and (i + 1) % s.full_attention_interval:
            conv = 2 * key_dim + value_dim
            lay.tensor(f"{blk}.attn_qkv.weight", s.n_embd, conv)
            lay.tensor(f"{blk}.attn_gate.weight", s.n_embd, value_dim)
            lay.tensor(f"{blk}.ssm_conv1d.weight", s.ssm_conv, conv)
            lay.tensor(f"{blk}.ssm_dt.bias", s.ssm_heads)
            lay.tensor(f"{blk}.ssm_a", s.ssm_heads)
            lay.tensor(f"{blk}.ssm_beta.weight", s.n_embd, s.ssm_heads)
            lay.tensor(f"{blk}.ssm_alpha.weight", s.n_embd, s.ssm_heads)
            lay.norm(f"{blk}.ssm_norm.weight", s.ssm_state)
            lay.tensor(f"{blk}.ssm_out.weight", value_dim, s.n_embd)
        else:
            _attention(lay, blk, 2 * s.n_head * s.n_embd_head, qk_norm=True)
        mlp(blk)
        if i >= s.n_layer:  # an MTP block's own projections
            lay.tensor(f"{blk}.nextn.eh_proj.weight", 2 * s.n_embd, s.n_embd)
            lay.norm(f"{blk}.nextn.enorm.weight")
            lay.norm(f"{blk}.nextn.hnorm.weight")
            lay.norm(f"{blk}.nextn.shared_head_norm.weight")
    return lay


def _lfm2(lay: _Layout) -> _Layout:
    """LFM2: short-convolution layers and attention layers (head_count_kv 0 marks a conv layer)."""
    s = lay.shape
    lay.key("feed_forward_length", s.n_ff)
    _heads(lay, [s.n_head_kv if kind == "attn" else 0 for kind in s.layer_kinds])
    lay.key("shortconv.l_cache", s.conv_cache)
    _embeddings(lay, "token_embd_norm.weight")
    for i, kind in enumerate(s.layer_kinds):
        blk = f"blk.{i}"
        lay.norm(f"{blk}.attn_norm.weight")
        lay.norm(f"{blk}.ffn_norm.weight")
        if kind == "attn":
            _attention(lay, blk, qk_norm=True)
        else:
            lay.tensor(f"{blk}.shortconv.conv.weight", s.conv_cache, s.n_embd)
            lay.tensor(f"{blk}.shortconv.in_proj.weight", s.n_embd, 3 * s.n_embd)
            lay.tensor(f"{blk}.shortconv.out_proj.weight", s.n_embd, s.n_embd)
        _ffn(lay, blk)
    return lay


def _gemma4(lay: _Layout) -> _Layout:
    """Gemma 4 (src/models/gemma4.cpp): window layers of narrow heads and global layers of wide
    ones, the last shared_kv_layers keeping no KV of their own, per-layer token embeddings (E2B,
    E4B), routed experts beside the dense MLP (26B-A4B)."""
    s = lay.shape
    kinds = s.layer_kinds or tuple("attn" if (i + 1) % s.global_every == 0 else "window" for i in range(s.n_layer))
    window = [kind == "window" for kind in kinds]
    n_kv_layers = s.n_layer - s.shared_kv_layers
    kv_heads = [s.n_head_kv_swa if w else s.n_head_kv for w in window]
    n_ff = [s.n_ff_shared if s.n_ff_shared and i >= n_kv_layers else s.n_ff for i in range(s.n_layer)]
    lay.key("feed_forward_length", n_ff if s.n_ff_shared else s.n_ff)
    lay.key("attention.head_count", s.n_head)
    lay.key("attention.head_count_kv", kv_heads)
    for suffix, head in (("", s.n_embd_head), ("_swa", s.head_dim_swa)):
        lay.key(f"attention.key_length{suffix}", head)
        lay.key(f"attention.value_length{suffix}", head)
        lay.key(f"rope.dimension_count{suffix}", head)
    lay.key("attention.sliding_window", s.sliding_window)
    lay.key("attention.sliding_window_pattern", window)
    lay.key("attention.shared_kv_layers", s.shared_kv_layers)
    lay.key("embedding_length_per_layer_input", s.n_embd_per_layer)
    lay.key("rope.freq_base_swa", 10000.0)
    lay.key("final_logit_softcapping", 30.0)
    if s.n_expert:
        _expert_keys(lay)
    _embeddings(lay)
    if s.n_embd_per_layer:
        width = s.n_embd_per_layer * s.n_layer
        lay.tensor("per_layer_token_embd.weight", width, s.n_vocab)
        lay.tensor("per_layer_model_proj.weight", s.n_embd, width)
        lay.norm("per_layer_proj_norm.weight", s.n_embd_per_layer)
    lay.norm("rope_freqs.weight", s.n_embd_head // 2)  # the global layers' rope factors, one for all
    for i in range(s.n_layer):
        blk, head = f"blk.{i}", s.head_dim_swa if window[i] else s.n_embd_head
        lay.norm(f"{blk}.attn_norm.weight")
        lay.tensor(f"{blk}.attn_q.weight", s.n_embd, s.n_head * head)
        lay.norm(f"{blk}.attn_q_norm.weight", head)
        if i < n_kv_layers:  # a shared layer reads an earlier layer's keys and values
            lay.tensor(f"{blk}.attn_k.weight", s.n_embd, kv_heads[i] * head)
            if window[i] or not s.kv_equal:
                lay.tensor(f"{blk}.attn_v.weight", s.n_embd, kv_heads[i] * head)
            lay.norm(f"{blk}.attn_k_norm.weight", head)
        lay.tensor(f"{blk}.attn_output.weight", s.n_head * head, s.n_embd)
        lay.norm(f"{blk}.post_attention_norm.weight")
        lay.norm(f"{blk}.ffn_norm.weight")
        _ffn(lay, blk, n_ff[i])
        lay.norm(f"{blk}.post_ffw_norm.weight")
        if s.n_expert:
            _experts(lay, blk)
            lay.tensor(f"{blk}.ffn_gate_inp.scale", s.n_embd)
            for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                lay.norm(f"{blk}.{norm}.weight")
        if s.n_embd_per_layer:
            lay.tensor(f"{blk}.inp_gate.weight", s.n_embd, s.n_embd_per_layer)
            lay.tensor(f"{blk}.proj.weight", s.n_embd_per_layer, s.n_embd)
            lay.norm(f"{blk}.post_norm.weight")
        lay.norm(f"{blk}.layer_output_scale.weight", 1)
    return lay


LAYOUTS = {
    "llama": _transformer, "qwen2": _transformer, "qwen3": _transformer, "qwen3moe": _transformer,
    "gemma3": _gemma3, "gpt-oss": _gpt_oss, "qwen35": _qwen35, "qwen35moe": _qwen35, "lfm2": _lfm2,
    "gemma4": _gemma4,
}


def layout(shape: Shape) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """Return the shape's metadata keys and its tensors as (name, ggml dims), in file order."""
    if shape.arch == "gemma4" and not shape.layer_kinds and not shape.global_every:
        raise ValueError("gemma4 needs global_every or layer_kinds")
    if (shape.arch == "lfm2" or shape.layer_kinds) and len(shape.layer_kinds) != shape.n_layer:
        raise ValueError(f"{shape.arch} needs layer_kinds for each of its {shape.n_layer} layers")
    lay = LAYOUTS[shape.arch](_Layout(shape))
    return lay.keys, lay.tensors


# --------------------------------------------------------------------------------------------
# Tensor types as llama.cpp's quantizer picks them (llama_tensor_get_type).

# Never quantized: 1-D tensors, and these 2-D ones (llama-quant.cpp, tensor_allows_quantization)
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "shortconv.conv.weight", "attn_sinks",
         "per_layer_model_proj")


def more_bits(layer: int, n_layer: int) -> bool:
    """Whether Q4_K_M keeps this layer's attn_v and ffn_down at Q6_K (llama.cpp's use_more_bits)."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_plan(shape: Shape, quant: str = "Q4_K_M") -> list[tuple[str, tuple[int, ...], str]]:
    """Return (name, ggml dims, type name) for every tensor of the shape quantized as `quant`."""
    return _typed(shape, quant, layout(shape)[1])


def _typed(shape: Shape, quant: str, tensors: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...], str]]:
    if quant not in QUANTS:
        raise ValueError(f"no tensor types for quantization {quant!r} (one of {', '.join(QUANTS)})")
    n_layer = shape.n_layer + shape.n_mtp
    n_v = sum(1 for name, _ in tensors if name.endswith("attn_v.weight"))
    i_v = 0
    out = []
    for name, dims in tensors:
        kind = _type(shape, quant, name, dims, n_layer, i_v, n_v)
        i_v += name.endswith("attn_v.weight")
        if kind in K_QUANT_FALLBACK and dims[0] % QK_K:
            kind = K_QUANT_FALLBACK[kind]
        out.append((name, dims, kind))
    return out


def _type(shape: Shape, quant: str, name: str, dims: tuple[int, ...], n_layer: int, i_v: int, n_v: int) -> str:
    if len(dims) == 1 or not name.endswith(".weight") or any(k in name for k in _KEPT):
        return "F32"
    if quant in ("F16", "BF16", "F32", "Q8_0"):
        return quant
    output = name == "output.weight" or (shape.tied_output and name == "token_embd.weight")
    if quant == "MXFP4":
        return "MXFP4" if len(dims) == 3 else "Q8_0"
    if output:
        return "Q6_K"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if name.endswith("attn_v.weight"):
        return "Q6_K" if more_bits(i_v, n_v) else "Q4_K"
    if "ffn_down" in name:
        return "Q6_K" if more_bits(layer, n_layer) else "Q4_K"
    if name.endswith("attn_qkv.weight") or name == "per_layer_token_embd.weight":
        return "Q5_K"  # the second as the publishers' Gemma 4 files have it (their sizes say so)
    return "Q4_K"


def nbytes(dims: tuple[int, ...], kind: str) -> int:
    """Return a tensor's bytes stored as `kind` (gguf's block sizes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    count = 1
    for d in dims:
        count *= d
    return count // block * size


def weights_bytes(shape: Shape, quant: str) -> int:
    """Return the bytes of the shape's tensor data (about its file's size)."""
    return sum(nbytes(dims, kind) for _, dims, kind in tensor_plan(shape, quant))


# --------------------------------------------------------------------------------------------
# Header-only files


def write_header(shape: Shape, quant: str, dst: Path, name: str = "") -> None:
    """Write a header-only GGUF of `shape` at `quant` to `dst` (atomically): metadata, a
    placeholder vocabulary of n_vocab tokens, tensor infos; the data a hole of its size."""
    import gguf

    keys, tensors = layout(shape)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=shape.arch)
        writer.add_name(name or f"{shape.arch} shape")
        writer.add_string("general.type", "model")
        for key, value in keys.items():
            add_key(writer, key, value)
        _add_placeholder_vocab(writer, shape.n_vocab)
        sizes = write_head(writer, _typed(shape, quant, tensors))
        writer.close()
        leave_data_hole(Path(tmp), sizes, writer.data_alignment)


def write_head(writer, plan: list[tuple[str, tuple[int, ...], str]]) -> list[int]:
    """Add every tensor's info (tensor_plan's) to a GGUF writer holding the metadata, and write
    the file up to the tensor data; return the tensors' sizes."""
    import gguf
    import numpy as np

    sizes = [nbytes(dims, kind) for _, dims, kind in plan]
    for (name, dims, kind), size in zip(plan, sizes):
        # numpy's (reversed) element shape; with raw_dtype given, float32 only says "not bytes"
        writer.add_tensor_info(name, tuple(reversed(dims)), np.dtype(np.float32), size,
                               raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return sizes


def leave_data_hole(path: Path, sizes: list[int], alignment: int) -> None:
    """Extend a GGUF that ends after its tensor infos to its full size: the data a hole."""
    def padded(n: int) -> int:
        return (n + alignment - 1) // alignment * alignment

    start = padded(path.stat().st_size)
    with open(path, "r+b") as f:
        f.truncate(start + sum(padded(n) for n in sizes))


def add_key(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        writer.add_string(key, str(value))


def _add_placeholder_vocab(writer, n_vocab: int) -> None:
    """A SentencePiece-style vocabulary of n_vocab distinct pieces: <unk>, <s>, </s>, the 256
    byte pieces llama.cpp looks up, then numbered ones (memory depends on the count alone)."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [f"t{i}" for i in range(len(pieces), n_vocab)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces[:n_vocab])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def copy_path(alias: str, shape: Shape, quant: str) -> Path:
    """Return where the header-only copy of a registry model's shape is kept (keyed by the facts)."""
    facts = repr((WRITER_VERSION, sorted(asdict(shape).items()), quant)).encode()
    digest = hashlib.sha256(facts).hexdigest()[:16]
    return paths.cache_dir() / "headers" / "shapes" / f"{alias}-{digest}.gguf"


def shape_copy(alias: str, shape: Shape, quant: str | None) -> Path:
    """Return a header-only GGUF written from a registry model's published shape (cached)."""
    quant = (quant or "Q4_K_M").upper()
    path = copy_path(alias, shape, quant)
    if not path.is_file():
        write_header(shape, quant, path, name=f"{alias} (published shape)")
    return path
