"""The memory plan is llama.cpp's own allocation, for every architecture the registry holds.

Each model below is loaded for real (engine.Model / Context, as a run loads it), and what
llama.cpp says it allocated (its log lines) is held against the plan made before the load: KV
cache with the real head sizes and windows, recurrent state with every copy, the MTP context,
the draft's context and its sequences, compute and output buffers. Real small models where they
exist (SmolLM2 for llama, Gemma-3-270M for gemma3), tiny random models of the real layouts
otherwise (tests/tiny_archs.py, models/synthetic/real_shapes.py scaled with the real head sizes).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import MODEL_CACHE
from pinned_sources import vocab_gguf
from tiny_archs import tiny_arch_model

from specrun import engine
from specrun.engine.memory import Allocation
from specrun.hardware import placement
from specrun.models.shapes import nbytes
from specrun.models.synthetic import real_shapes as shapes
from specrun.runtime.plan import RunOptions, build_plan
from specrun.runtime.runtime import Runtime

# The plan's figures must be within this share of what llama.cpp allocated (the bar).
TOLERANCE = 0.03
CONTEXTS = (1024, 4096, 16384)


def _scaled_shape(name: str, head_dim: int, arch: str | None = None) -> Path:
    """A scaled random model of a registry shape that keeps its real head size (as `arch`)."""
    path = MODEL_CACHE / "tiny-arch" / f"{name}{'-' + arch if arch else ''}-scaled-h{head_dim or 0}.gguf"
    if not path.exists():
        shape = replace(shapes.SHAPES[name].scaled(2, 256, 512, n_vocab=151936), head_dim=head_dim)
        shape = replace(shape, arch=arch) if arch else shape
        path.parent.mkdir(parents=True, exist_ok=True)
        shapes.write_shape_model(shape, vocab_gguf("qwen2"), path)
    return path


@pytest.fixture(scope="module")
def models(offline_models) -> dict[str, Path]:
    """{architecture: a model of it}, every one the registry holds that llama.cpp here can load."""
    found = {
        "llama": offline_models.smollm2_f32,
        "gemma3": offline_models.gemma_q4,
        "qwen2": _scaled_shape("qwen2.5-14b", 0),  # qwen2 has no key_length: n_embd / n_head
        "qwen3moe": _scaled_shape("qwen3-30b-a3b", 128),  # heads of 128 where n_embd / n_head is 64
        "qwen3": _scaled_shape("qwen2.5-14b", 128, "qwen3"),
        # Mistral Small's GGUFs are llama files whose heads (128) are narrower than n_embd / n_head (160)
        "mistral": _scaled_shape("qwen2.5-14b", 96, "llama"),
    }
    for arch in ("qwen35", "qwen35moe", "lfm2", "gpt-oss", "gemma4", "jamba", "nemotron_h", "mamba"):
        found[arch] = tiny_arch_model(MODEL_CACHE, arch)
    found["qwen35-mtp"] = tiny_arch_model(MODEL_CACHE, "qwen35", mtp=True)
    return found


def _planned_and_allocated(opts: RunOptions):
    plan = build_plan(opts, devices=[])
    with Runtime(plan) as rt:
        return plan, rt.allocation


def _assert_close(what: str, planned: int, allocated: int) -> None:
    assert abs(planned - allocated) <= TOLERANCE * max(allocated, 1), (
        f"{what}: planned {planned} bytes, llama.cpp allocated {allocated}")


def _assert_plan_matches(plan, allocated: Allocation) -> None:
    (ram,) = plan.placement.breakdown
    assert plan.placement.measured
    _assert_close("KV cache and recurrent state", ram.context, allocated.context)
    _assert_close("compute buffers", ram.compute, allocated.compute_total)
    _assert_close("output buffer", ram.output, allocated.output)
    # the weights as mapped from the file; the CPU backend may also copy some into its own layout
    _assert_close("weights", ram.model, allocated.weights)


@pytest.mark.parametrize("n_ctx", CONTEXTS)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe",
                                  "lfm2", "gpt-oss", "gemma4", "jamba", "nemotron_h", "mamba"])
def test_plain_decoding_plan_is_what_llama_cpp_allocates(models, arch, n_ctx):
    plan, allocated = _planned_and_allocated(
        RunOptions(target=str(models[arch]), ctx_size=n_ctx, no_spec=True, threads=1, quiet=True))
    _assert_plan_matches(plan, allocated)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe", "qwen35", "qwen35moe", "lfm2", "gpt-oss", "gemma4",
                                  "nemotron_h"])
def test_speculative_plan_is_what_llama_cpp_allocates(models, arch):
    """Lookup trees (attention models: 256 sequences) or chains with rollback snapshots (hybrids:
    the recurrent state kept once per chain and snapshot)."""
    plan, allocated = _planned_and_allocated(
        RunOptions(target=str(models[arch]), draft="lookup", ctx_size=4096, threads=1, quiet=True))
    assert plan.tree is not None
    _assert_plan_matches(plan, allocated)
    if arch in ("qwen35", "qwen35moe", "lfm2", "nemotron_h"):
        assert plan.target_ctx.n_rs_seq > 0 and allocated.state > 0


def test_a_tree_pass_grows_the_output_buffer_to_the_rows_the_plan_counts(models):
    """llama.cpp opens a context's output buffer for n_seq_max rows of logits and grows it at the
    first pass that asks for more. Lookup trees of 64 tokens on a sliding-window target open 17
    sequences (WINDOW_LEAVES and the text's) and ask for 65 rows: the plan counts 65."""
    import numpy as np

    plan = build_plan(RunOptions(target=str(models["gemma3"]), draft="lookup", ctx_size=1024, threads=1,
                                 quiet=True), devices=[])
    ctx_plan = plan.target_ctx
    assert ctx_plan.n_outputs == plan.tree.verified.budget + 1 == 65 > ctx_plan.n_seq_max == 17
    opened = engine.Simulation(models["gemma3"]).context(engine.ContextSpec(
        ctx_plan.cells, ctx_plan.n_batch, ctx_plan.n_seq_max, swa_full=ctx_plan.swa_full)).output
    (ram,) = plan.placement.breakdown
    assert opened > 0 and abs(ram.output - opened * 65 / 17) <= 1
    with Runtime(plan) as rt:
        _assert_plan_matches(plan, rt.allocation)
        batch = engine.Batch(65, 1)
        batch.set_arrays(np.full(65, 2, np.int32), np.arange(65, dtype=np.int32), np.zeros(65, np.int32), True)
        rt.target_ctx.decode(batch)
        assert rt.target_ctx.logits().shape == (65, rt.target.n_vocab)  # 65 rows, where 17 were opened


def test_draft_model_plan_counts_the_draft_and_its_sequences(offline_models):
    plan, allocated = _planned_and_allocated(RunOptions(ctx_size=4096, threads=1, quiet=True))
    assert plan.draft_loaded and plan.draft_ctx.n_seq_max > 1
    _assert_plan_matches(plan, allocated)


def test_mtp_plan_counts_the_mtp_context(models):
    plan, allocated = _planned_and_allocated(
        RunOptions(target=str(models["qwen35-mtp"]), draft="mtp", ctx_size=4096, threads=1, quiet=True))
    assert plan.tree is not None and plan.tree.drafting.loads_mtp
    _assert_plan_matches(plan, allocated)
    without = build_plan(RunOptions(target=str(models["qwen35-mtp"]), ctx_size=4096, no_spec=True, threads=1,
                                    quiet=True), devices=[])
    assert plan.placement.breakdown[0].context > without.placement.breakdown[0].context  # the MTP block's KV
    # Three requests at once: the MTP context holds a sequence for each, as the target's does.
    three, allocated = _planned_and_allocated(
        RunOptions(target=str(models["qwen35-mtp"]), draft="mtp", ctx_size=4096, parallel=3, threads=1, quiet=True))
    assert three.target_ctx.parallel == 3 and three.tree.drafting.loads_mtp and not three.notes
    _assert_plan_matches(three, allocated)
    assert three.placement.breakdown[0].context > plan.placement.breakdown[0].context


def test_head_sizes_and_hybrid_layers_count_as_llama_cpp_counts_them(models):
    """The old arithmetic's misses (issue 33): Gemma's 256-wide heads, Qwen3-MoE's 128-wide heads,
    Gemma 4's global heads wider than its window heads and its layers without a cache of their own,
    and hybrids whose recurrent layers keep no KV cache. The plan now carries llama.cpp's figures."""
    for arch in ("gemma3", "qwen3moe", "qwen35", "lfm2", "gemma4", "nemotron_h"):
        # A plain run keeps only the window of sliding-window layers (gemma3), as llama.cpp does.
        simulated = engine.Simulation(models[arch]).context(engine.ContextSpec(4096, 512, swa_full=False))
        plan = build_plan(RunOptions(target=str(models[arch]), ctx_size=4096, no_spec=True, threads=1, quiet=True),
                          devices=[])
        assert plan.placement.breakdown[0].context == simulated.context > 0
    qwen35 = engine.Simulation(models["qwen35"]).context(engine.ContextSpec(4096, 512))
    assert qwen35.kv_layers < placement.model_size(models["qwen35"]).n_layer  # only its attention layers
    # Gemma 4's KV-shared layers read earlier layers' caches (3 of its 6 layers keep one);
    # Nemotron-H's Mamba-2 and MLP-only blocks keep none (1 attention layer of 5)
    assert engine.Simulation(models["gemma4"]).context(engine.ContextSpec(4096, 512)).kv_layers == 3
    assert engine.Simulation(models["nemotron_h"]).context(engine.ContextSpec(4096, 512)).kv_layers == 1


def test_a_model_not_downloaded_is_planned_from_its_header_alone(offline_models, cli, tmp_path, monkeypatch):
    """`specrun plan` of a Hugging Face model that is not on disk: its real header is fetched by
    range requests (a small part of the file), and the plan is the one the downloaded file gets."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fakehub import FakeHub

    real = offline_models.smollm2_q4
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    with FakeHub() as hub:
        hub.add_file("fake/SmolLM2-GGUF", real.name, real.read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        args = ("plan", "--json", "--no-spec", "--ctx-size", "4096", "--gpu", "Test=8GiB", "--ram-free", "16GiB")
        result = cli(*args, "--target", f"hf:fake/SmolLM2-GGUF/{real.name}")
        assert result.exit_code == 0, result.output
        fetched = sum(r.body_bytes for r in hub.gets())
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the header is kept: offline, the same plan
        again = cli(*args, "--target", f"hf:fake/SmolLM2-GGUF/{real.name}")
    assert again.exit_code == 0, again.output
    planned = json.loads(result.stdout)
    assert planned["target"]["path"] is None  # nothing was downloaded
    assert 0 < fetched < 0.05 * real.stat().st_size
    assert json.loads(again.stdout)["memory"] == planned["memory"]
    local = json.loads(cli(*args, "--target", str(real)).stdout)
    assert planned["memory"]["figures"] == "llama.cpp"
    assert planned["memory"]["breakdown"] == local["memory"]["breakdown"]
    assert planned["target"]["gpu_layers"] == local["target"]["gpu_layers"] == local["target"]["layer_slots"]


def test_a_model_not_downloaded_offline_without_its_header_is_one_clear_line(cli, tmp_path, monkeypatch):
    """A file the registry states no shape for (a Hugging Face reference of the user's): offline,
    with no header cached, it cannot be planned before its download, and the error says why."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = "hf:someone/Some-Model-GGUF/some-model-q4_k_m.gguf"
    result = cli("plan", "--target", target)
    assert result.exit_code != 0
    message = result.output.strip()
    assert f"cannot plan {target} before its download" in message and "HF_HUB_OFFLINE" in message
    assert "Traceback" not in message and len(message.splitlines()) == 1


def test_pull_warns_before_a_download_that_will_not_fit(offline_models, cli, tmp_path, monkeypatch):
    """The plan is made from the header before the weights come: a machine that cannot hold the
    model hears so first (the download still happens: it was asked for)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fakehub import FakeHub

    from specrun import sysinfo

    real = offline_models.smollm2_q4
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    with FakeHub() as hub:
        hub.add_file("fake/SmolLM2-GGUF", real.name, real.read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-first"))
        roomy = cli("pull", f"hf:fake/SmolLM2-GGUF/{real.name}")
        assert roomy.exit_code == 0, roomy.output
        assert "pulling" in roomy.output and "very slowly" not in roomy.output
        # a machine with 600 MiB of free RAM (none is so small here: its reading is replaced)
        monkeypatch.setattr(sysinfo, "ram_bytes", lambda: (1 << 30, 600 << 20))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
        small = cli("pull", f"hf:fake/SmolLM2-GGUF/{real.name}")
    assert small.exit_code == 0, small.output
    assert "needs about" in small.output and "very slowly" in small.output
    assert Path(small.stdout.strip().splitlines()[-1]).stat().st_size == real.stat().st_size


def _moe_size(name: str):
    """The planner's view of a registry MoE shape at Q4_K_M, from its exact tensor list."""
    shape = shapes.SHAPES[name]
    tensors = {name: nbytes(dims, kind) for name, dims, kind in shapes.tensor_plan(shape)}
    return placement.size_from_tensors(
        tensors, sum(tensors.values()), shape.n_layer, n_embd=shape.n_embd, n_vocab=shape.n_vocab,
        n_head=shape.n_head, n_head_kv=shape.n_head_kv, n_ff=shape.n_ff, n_ctx_train=32768,
        key_length=shape.n_embd_head, value_length=shape.n_embd_head)


@pytest.mark.parametrize("card_gib", [8, 12, 16])
def test_a_moe_model_keeps_its_experts_in_ram_and_every_other_weight_on_the_gpu(card_gib):
    """Qwen3-30B-A3B (17 GB at Q4_K_M) on consumer cards: attention and shared weights of every
    layer on the GPU, the routed experts of as few layers as need be in RAM (llama.cpp's own fit
    and its users' --n-cpu-moe), where a whole-layer split keeps far fewer weights on the GPU."""
    from specrun.hardware import offload

    moe = _moe_size("qwen3-30b-a3b")
    assert len(moe.expert_bytes) == moe.n_layer and sum(moe.expert_bytes) > 0.9 * sum(moe.layer_bytes)
    card = [offload.Device("GPU", card_gib << 30, card_gib << 30)]
    plan = offload.plan_offload(moe, None, card, 64 << 30, 16384, 512)
    dense = offload.plan_offload(replace(moe, expert_bytes=()), None, card, 64 << 30, 16384, 512)
    assert plan.gpu_fits and plan.target_gpu_layers == moe.n_layer + 1 and not plan.op_offload
    assert 0 < plan.cpu_expert_layers < moe.n_layer
    assert dense.target_gpu_layers < plan.target_gpu_layers
    gpu, ram = plan.breakdown
    assert gpu.context > dense.breakdown[0].context  # every layer's KV cache sits on the GPU too
    assert ram.model == moe.input_bytes + sum(moe.expert_bytes[:plan.cpu_expert_layers])
    # as few layers' experts in RAM as fit: one fewer would overflow the card
    fewer = offload._place_target(offload._experts_in_ram(moe, plan.cpu_expert_layers - 1),
                                  offload._Buffers.of(moe, 16384, 512, False), moe.n_layer + 1, False,
                                  [0], list(plan.device_limit_bytes))
    assert not fewer.fits


def test_experts_kept_in_ram_load_and_decode_the_same(models):
    """The override that keeps experts in RAM (tensor_buft_overrides) loads a real MoE file and
    changes nothing in what it computes."""
    from specrun.core.sampling import SamplingParams, make_rng
    from specrun.decoding.plain import PlainDecoder

    outputs = []
    for experts_in_ram in (0, 1):
        with engine.Model(models["qwen3moe"], experts_in_ram=experts_in_ram) as model:
            ctx = engine.Context(model, n_ctx=256, n_batch=64, threads=1)
            decoder = PlainDecoder(model, ctx)
            steps = decoder.steps([1, 2, 3, 4], SamplingParams(temperature=0.0), 8, make_rng(0))
            outputs.append([t for step in steps for t in step.tokens])
            ctx.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def _header_only_shape(name: str) -> Path:
    """A header-only sparse file of a registry shape at full size (a hole where the weights go)."""
    path = MODEL_CACHE / "tiny-arch" / f"{name}-header-only.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shapes.write_shape_model(shapes.SHAPES[name], vocab_gguf("qwen2"), path, header_only=True)
    return path


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dense-27b"])
def test_big_models_on_consumer_cards_never_exceed_the_card(name):
    """Full-size header-only files (17-18 GB of weights that are not there) planned for 8, 12, 16
    and 24 GiB cards with the default context: llama.cpp's own figures for the contexts, and the
    plan never asks a card for more than it has; bigger cards never get less."""
    path = _header_only_shape(name)
    assert path.stat().st_blocks * 512 < 0.01 * path.stat().st_size  # the weights are a hole
    previous = None
    for gib in (8, 12, 16, 24):
        card = [engine.DeviceInfo("Card", "assumed", "gpu", "CUDA", gib << 30, gib << 30)]
        plan = build_plan(RunOptions(target=str(path), ctx_size=None, no_spec=True, threads=1, quiet=True),
                          devices=card, ram_free_bytes=64 << 30)
        assert plan.placement.measured and plan.placement.gpu_fits
        device, _ = plan.placement.breakdown
        assert device.total == plan.placement.device_bytes[0] <= (gib << 30) - (512 << 20)
        assert plan.target_ctx.n_ctx >= placement.MIN_AUTO_CTX
        if previous is not None:
            assert device.model >= previous.model  # more room never means fewer weights on the GPU
        previous = device


@pytest.mark.slow
def test_models_fit_says_how_each_would_run_here_downloaded_or_not(offline_models, cli, tmp_path, monkeypatch):
    """`specrun models --fit`: a downloaded model, one not downloaded (planned from its header,
    fetched from the fake hub), one whose header cannot be had (another repo) and one planned from
    the shape the registry states for it."""
    import os

    sys.path.insert(0, str(Path(__file__).parent))
    from fakehub import FakeHub

    real = offline_models.smollm2_q4
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    config = Path(os.environ["SPECRUN_CONFIG"])
    config.mkdir(parents=True, exist_ok=True)
    repo = f"fake/smol-{uuid.uuid4().hex[:12]}"  # a repo of its own: no header of it is cached yet
    (config / "models.toml").write_text(
        f'[models."remote-smol"]\nfamily = "smollm2"\ndraft = false\n'
        f'[[models."remote-smol".source]]\nhf = "{repo}"\nfile = "{real.name}"\n'
        f'[models."remote-gone"]\nfamily = "smollm2"\ndraft = false\n'
        f'[[models."remote-gone".source]]\nhf = "{repo}-gone"\nfile = "{real.name}"\n')
    with FakeHub() as hub:
        hub.add_file(repo, real.name, real.read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("SPECRUN_HOME", str(MODEL_CACHE))  # the demo pair is there
        result = cli("models", "--fit", "--json")
        fetched = sum(r.body_bytes for r in hub.gets())
    assert result.exit_code == 0, result.output
    rows = {row["alias"]: row for row in json.loads(result.stdout)}
    remote = rows["remote-smol"]["fit"]
    assert remote["fits"] is True and remote["n_ctx"] == 8192 and not rows["remote-smol"]["present"]
    assert 0 < fetched < 0.05 * real.stat().st_size  # its header only
    demo = rows["smollm2-135m-f32"]["fit"]
    assert demo["fits"] is True and demo["drafter"] == "hybrid"
    unknown = rows["remote-gone"]["fit"]  # a repo the fake hub does not have, and no published shape
    assert unknown["fits"] is None and unknown["text"] == "?" and "remote-gone" in unknown["why"]
    shaped = rows["qwen3.5-27b"]["fit"]  # not on the fake hub either: planned from its published shape
    assert shaped["fits"] is not None and shaped["n_ctx"] >= 4096


def test_simulated_allocations_are_kept_apart_from_the_memory_of_answers_and_bounded(offline_models, tmp_path,
                                                                                       monkeypatch):
    """llama.cpp's simulated allocations are saved per model file and context in allocations/ (not
    in memory/, where the memory of answers is saved), and only the MAX_RECORDS most recently used
    stay (stored or read)."""
    from specrun.engine import memory as engine_memory

    home = tmp_path / "specrun"
    monkeypatch.setenv("SPECRUN_HOME", str(home))
    monkeypatch.setattr(engine_memory.RECORDS, "keep", 2)
    folder = home / "allocations"
    folder.mkdir(parents=True)
    for i, name in enumerate(("oldest", "older", "old")):
        (folder / f"{name}.json").write_text("{}")
        os.utime(folder / f"{name}.json", (1_000_000 + i, 1_000_000 + i))
    spec = engine_memory.ContextSpec(n_ctx=256, n_batch=64, n_seq_max=1)
    first = engine_memory.simulate(offline_models.smollm2_random, [spec])[0]
    kept = sorted(p.name for p in folder.glob("*.json"))
    assert len(kept) == 2 and "old.json" in kept, kept  # the new record and the most recent old one
    assert not (home / "memory").exists()
    # The record is read back by the next run's plan instead of a new simulation.
    again = engine_memory.Simulation(offline_models.smollm2_random)
    monkeypatch.setattr(again, "_simulate", lambda spec: pytest.fail("simulated again instead of reading the record"))
    [record] = [p for p in folder.glob("*.json") if p.name != "old.json"]
    os.utime(record, (900_000, 900_000))  # stored long ago: reading it makes it the most recent
    assert again.context(spec) == first
    (folder / "newer.json").write_text("{}")
    engine_memory.RECORDS.prune()
    assert record.exists() and not (folder / "old.json").exists()
