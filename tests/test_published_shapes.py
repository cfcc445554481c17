"""Published shapes: a registry model planned before its download with no network (models.shapes).

The registry states each model's shape; a header-only GGUF written from it must be what llama.cpp
reads in the real file: checked tensor for tensor against a real model shipped on PyPI, by the
published file sizes of every registry model, by llama.cpp's own loader and allocation simulation
for each architecture, and through `specrun plan` offline.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from specrun.engine import memory
from specrun.engine.memory import ContextSpec, Simulation
from specrun.models import registry
from specrun.models.shapes import Shape, tensor_plan, weights_bytes, write_header

F16 = 2  # bytes per KV value (llama.cpp's default cache type)


@pytest.fixture(scope="module")
def shipped():
    return registry.load(user_toml=Path("/nonexistent/models.toml"))


def test_a_published_shape_is_its_real_file_tensor_for_tensor(offline_models, shipped, tmp_path):
    """Gemma-3-270M at Q4_K_M from PyPI: every tensor's name, dims and type as the registry's
    shape lays it out (the quantizer's fallbacks for 640-wide rows included), and llama.cpp
    allocates the same for the header-only copy as for the real file."""
    spec = shipped.models["gemma3-270m-q4"]
    real = gguf.GGUFReader(offline_models.gemma_q4)
    want = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in real.tensors}
    planned = {name: (dims, kind) for name, dims, kind in tensor_plan(spec.shape, spec.quant)}
    assert planned == want
    assert weights_bytes(spec.shape, spec.quant) == sum(int(t.n_bytes) for t in real.tensors)

    copy = tmp_path / "gemma3-270m-shape.gguf"
    write_header(spec.shape, spec.quant, copy)
    assert copy.stat().st_blocks * 512 < 0.05 * copy.stat().st_size  # the weights are a hole
    contexts = [ContextSpec(4096, 512, 1, 0, swa_full=False), ContextSpec(8192, 512, 4, 0)]
    for spec_ in contexts:
        with Simulation(offline_models.gemma_q4) as a, Simulation(copy) as b:
            assert a.context(spec_).to_dict() == b.context(spec_).to_dict()


def test_every_published_shape_adds_up_to_its_files_size(shipped):
    """The shapes' weights against the sizes the publishers list (the facts and the quantizer's
    types both checked): within 5% under (unsloth's files keep some tensors at more bits) and 8%
    over (Qwen's own 72B file has smaller fallbacks than llama.cpp's quantizer gives today)."""
    ratios = {alias: weights_bytes(spec.shape, spec.quant) / spec.size for alias, spec in shipped.models.items()
              if spec.shape is not None and spec.size}
    assert len(ratios) >= 50
    off = {alias: round(r, 3) for alias, r in ratios.items() if not 0.95 <= r <= 1.08}
    assert not off, off
    assert sum(0.99 <= r <= 1.01 for r in ratios.values()) >= 25  # most are the file to 1%


def _kv_bytes_per_cell(shape: Shape) -> int:
    """Keys and values of one cell over every layer that keeps them, from the published facts."""
    if shape.arch == "gemma4":  # window and global layers of their own widths; shared layers keep none
        return sum(2 * F16 * (shape.n_head_kv_swa * shape.head_dim_swa if (i + 1) % shape.global_every
                              else shape.n_head_kv * shape.n_embd_head)
                   for i in range(shape.n_layer - shape.shared_kv_layers))
    if shape.layer_kinds:
        layers = shape.layer_kinds.count("attn")
    elif shape.full_attention_interval:
        layers = shape.n_layer // shape.full_attention_interval
    else:
        layers = shape.n_layer
    return layers * 2 * F16 * shape.n_head_kv * shape.n_embd_head


# One registry model of each architecture with a layout; qwen3.5-4b-mtp loads its MTP block too.
ARCHES = ["qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b", "mistral-small-3.2-24b", "gemma3-1b", "gpt-oss-20b",
          "qwen3.5-0.8b", "qwen3.5-35b-a3b", "qwen3.5-4b-mtp", "lfm2.5-350m", "gemma4-e2b", "gemma4-26b-a4b"]


@pytest.mark.parametrize("alias", ARCHES)
def test_llama_cpp_loads_each_architecture_from_its_published_shape(alias, shipped, tmp_path):
    """llama.cpp's loader accepts every tensor of the header-only copy (it checks each name and
    dims against its own layout), and the KV cache it allocates is the one the published head
    sizes and layer kinds give; hybrids keep a recurrent state beside it."""
    spec = shipped.models[alias]
    shape = replace(spec.shape, n_vocab=min(spec.shape.n_vocab, 32000))  # a smaller vocabulary loads faster
    copy = tmp_path / f"{alias}.gguf"
    write_header(shape, spec.quant, copy)
    n_ctx = 4096
    with Simulation(copy, load_mtp=spec.mtp) as simulation:
        allocation = simulation.context(ContextSpec(n_ctx, 512, 1, 0, swa_full=True))
        assert allocation.kv == n_ctx * _kv_bytes_per_cell(shape)
        assert (allocation.state > 0) == (shape.arch in ("qwen35", "qwen35moe", "lfm2"))
        if spec.mtp:
            mtp = simulation.context(ContextSpec(n_ctx, 512, 1, mtp=True))
            assert mtp.kv == spec.shape.n_mtp * n_ctx * 2 * F16 * shape.n_head_kv * shape.n_embd_head


def test_plan_offline_of_a_model_never_fetched_uses_its_published_shape(cli, tmp_path, monkeypatch):
    """No network, no cached header: `specrun plan` still plans Qwen3.5-27B (its weights to the
    published size within 5%, llama.cpp's own figures for its contexts) and says how it knows."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("plan", "--json", "--no-spec", "--target", "qwen3.5-27b", "--ctx-size", "8192",
                 "--gpu", "Test=24GiB", "--ram-free", "16GiB")
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    assert planned["target"]["path"] is None
    assert planned["target"]["gpu_layers"] == planned["target"]["layer_slots"]  # 17 GB fit a 24 GiB card
    assert planned["memory"]["figures"] == "llama.cpp"
    model = sum(device["model"] for device in planned["memory"]["breakdown"])
    assert 0.95 < model / registry.resolve("qwen3.5-27b").size < 1.05
    assert any("published shape" in w or "shape the registry states" in w for w in planned["warnings"])
    # a smaller card keeps some layers in RAM
    small = json.loads(cli("plan", "--json", "--no-spec", "--target", "qwen3.5-27b", "--ctx-size", "8192",
                           "--gpu", "Test=8GiB", "--ram-free", "16GiB").stdout)
    assert 0 < small["target"]["gpu_layers"] < small["target"]["layer_slots"]


def test_a_default_drafter_that_does_not_fit_gives_way_to_the_lightest_that_does(cli, tmp_path, monkeypatch):
    """Qwen3.5-27B's default drafting (its 0.8B draft model, four chains each with rollback copies
    of the recurrent state) does not fit beside it in 22 GiB of RAM, even at the smallest default
    context: the plan drops the draft model and drafts from the session's text; in 20 GiB the
    chains' state copies do not fit either, and it decodes plainly with a far longer context. Each
    says why. A drafter the user names is planned as named, fitting or not."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def plan(*args: str) -> dict:
        result = cli("plan", "--json", "--target", "qwen3.5-27b", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    roomy = plan("--ram-free", "40GiB")
    assert roomy["memory"]["fits"] and roomy["draft"]["name"] == "qwen3.5-0.8b"
    assert not any("does not fit beside" in w for w in roomy["warnings"])
    lookup = plan("--ram-free", "22GiB")
    assert lookup["memory"]["fits"] and lookup["drafter"] == "lookup" and lookup["draft"] is None
    assert any("the draft model qwen3.5-0.8b does not fit beside qwen3.5-27b" in w and "lookup trees alone" in w
               for w in lookup["warnings"]), lookup["warnings"]
    plain = plan("--ram-free", "20GiB")
    assert plain["memory"]["fits"] and plain["drafter"] == "none" and plain["tree"] is None
    assert any("planned with plain decoding" in w for w in plain["warnings"]), plain["warnings"]
    assert plain["context"]["n_ctx"] > 4 * lookup["context"]["n_ctx"]  # no state copies for chains
    named = plan("--ram-free", "20GiB", "--draft", "qwen3.5-0.8b")
    assert not named["memory"]["fits"] and named["draft"]["name"] == "qwen3.5-0.8b"


def test_a_large_recurrent_states_snapshots_are_counted_as_llama_cpp_allocates_them(shipped, tmp_path, monkeypatch):
    """A hybrid's chains keep (1 + n_rs_seq) copies of every sequence's recurrent state; a state
    large enough is simulated once without them and counted once per copy (zeroing 36 copies of
    Qwen3.5-27B's state took ten seconds), which must be what llama.cpp allocates with them. The
    compute buffer is the graph's without snapshots (72 MB at 4 chains of 8, against 91 with
    them) or the snapshots' peak, where that is larger: never below what llama.cpp allocates, at
    most a tenth over, whichever chains, snapshots, context and ubatch."""
    spec = shipped.models["qwen3.5-0.8b"]
    copy = tmp_path / "qwen3.5-0.8b.gguf"
    write_header(replace(spec.shape, n_vocab=32000), spec.quant, copy)
    runs = [ContextSpec(4096, 512, 4, 8, swa_full=True), ContextSpec(4096, 512, 8, 8, swa_full=True),
            ContextSpec(4096, 512, 4, 4, swa_full=True), ContextSpec(32768, 512, 4, 8, swa_full=True),
            ContextSpec(4096, 256, 4, 8, swa_full=True), ContextSpec(4096, 512, 2, 8, swa_full=True)]
    with Simulation(copy) as simulation:
        scaled = [simulation.context(chains) for chains in runs]
        assert simulation.context(replace(runs[0], n_rs_seq=0)).state >= memory.SCALED_STATE_BYTES
    monkeypatch.setattr(memory, "SCALED_STATE_BYTES", 1 << 62)  # simulated with every snapshot
    with Simulation(copy) as simulation:
        wholes = [simulation._simulate(chains) for chains in runs]
    for chains, planned, whole in zip(runs, scaled, wholes):
        assert whole.state > 0 and abs(planned.state - whole.state) <= 0.005 * whole.state, (planned.state, whole.state)
        assert planned.kv == whole.kv
        assert whole.compute_total <= planned.compute_total <= 1.1 * whole.compute_total, (chains, planned.compute,
                                                                                         whole.compute)
