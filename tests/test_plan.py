"""One plan before anything loads: the tree, the contexts and the GPU layers agree.

The bug this guards against: GPU layers were planned for a batch of budget + 1 tokens while the
target context was created with another n_ubatch, so on a nearly full GPU the plan under-counted
the compute buffer. Here every way a tree can be chosen loads a context whose n_ubatch is the
planned one, and the placement is the one computed for that n_ubatch.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_offload import QWEN25_05B_Q4KM, QWEN25_14B_Q4KM

from specrun.core.tree_shapes import TreeShape, TreeTemplate
from specrun import engine
from specrun.core.sampling import NEAR_TIE_NATS, NEAR_TIE_NATS_OFFLOADED
from specrun.engine import DeviceInfo, cpu_kernels_batch_invariant, devices, memory, system_info
from specrun.hardware import placement
from specrun.runtime.plan import PREFILL_BATCH, ContextMemory, RunOptions, build_plan
from specrun.runtime.runtime import Runtime, drafts_while_verifying, load_arguments
from specrun.runtime.trees import DEFAULT_SHAPE
from specrun.server.worker import describe
from specrun.tuning import profiles
from specrun.tuning.cost_model import Choice

GB = 1 << 30
OPTS = RunOptions(threads=1, ctx_size=1024, quiet=True)
FAKE_GPU = [DeviceInfo("Fake GPU", "assumed", "gpu", "CUDA", int(0.9 * GB), 1 * GB)]
TEMPLATE = TreeTemplate(parents=(-1, 0, 0, 1), ranks=(0, 1, 2, 1))


def _store(offline_models, choice: Choice) -> None:
    key = profiles.profile_key(offline_models.smollm2_f32, offline_models.smollm2_q4, threads=OPTS.threads)
    profiles.save({"key": key, "config": choice.to_dict(), "predicted_speedup": 1.0, "measured_speedup": 1.0})


WAYS = {
    "default": (None, {}, None),
    "budget flag": (None, {"budget": 700}, None),
    "budget over the context": (None, {"budget": 2000}, None),
    "depth flag": (None, {"depth": 3}, None),
    "specexec profile": (Choice("specexec", 600, 8, 4, 4, 30.0, 1.3), {}, None),
    "sequoia profile": (Choice("sequoia", 3, 2, 2, 2, 30.0, 1.3, TEMPLATE), {}, None),
    "plain profile": (Choice("plain", 0, 0, 0, 0, 20.0, 1.0), {}, None),
    "no-spec": (None, {"no_spec": True}, None),
    "given shape": (None, {}, TreeShape(900, 12, 4, 4)),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_the_loaded_context_has_the_planned_ubatch_and_placement(offline_models, way):
    choice, flags, shape = WAYS[way]
    if choice is not None:
        _store(offline_models, choice)
    opts = replace(OPTS, **flags)
    plan = build_plan(opts, shape, devices=FAKE_GPU, ram_free_bytes=16 * GB)
    tree_tokens = plan.tree.verified.budget + 1 if plan.tree else 1  # the draft model's tree + lookup branches
    assert tree_tokens <= plan.target_ctx.n_ubatch <= opts.ctx_size  # a tree never outgrows the context
    assert plan.target_ctx.n_ubatch == min(opts.ctx_size, max(PREFILL_BATCH, tree_tokens))
    with Runtime(plan) as rt:
        assert rt.target_ctx.n_ubatch == rt.target_ctx.n_batch == plan.target_ctx.n_ubatch
        if plan.tree is not None:
            assert rt.decoder.shape == plan.tree.verified
            if plan.draft_loaded:  # (a plain profile leaves lookup alone: no draft model)
                assert rt.draft_ctx.n_ubatch == plan.draft_ctx.n_ubatch
    # The GPU layers were planned for exactly the context that was loaded.
    sizes = placement.model_size(offline_models.smollm2_f32), placement.model_size(offline_models.smollm2_q4)
    gpus = placement.gpus_of(FAKE_GPU)
    draft = offline_models.smollm2_q4 if plan.draft_loaded else None
    measure = ContextMemory(offline_models.smollm2_f32, draft, plan.tree, "llama")
    again = placement.plan(sizes[0], sizes[1] if plan.draft_loaded else None, gpus, opts.ctx_size, rt.target_ctx.n_ubatch,
                           ram_free_bytes=16 * GB, measured=measure)
    measure.close()
    assert plan.placement == again


def test_plan_says_why(offline_models):
    assert "default" in build_plan(OPTS).why and build_plan(OPTS).tree.shape == DEFAULT_SHAPE
    _store(offline_models, Choice("plain", 0, 0, 0, 0, 20.0, 1.0))
    plain = build_plan(OPTS)  # the draft model's trees lost: lookup alone runs
    assert plain.drafter == "lookup" and not plain.draft_loaded and "profile" in plain.why
    assert build_plan(replace(OPTS, lookup=False)).drafter == "none"  # --no-lookup: plain decoding
    flagged = build_plan(replace(OPTS, budget=3))
    assert flagged.tree.source == "flags" and flagged.tree.shape.budget == 3


def test_a_bigger_tree_leaves_fewer_layers_on_a_nearly_full_gpu():
    """qwen2.5-14b + qwen2.5-0.5b on a made-up 8 GB GPU, planned before either file exists."""
    gpu = [DeviceInfo("RTX 4060", "assumed", "gpu", "CUDA", int(7.6 * GB), 8 * GB)]
    opts = RunOptions(target="qwen2.5-14b", ctx_size=4096, lookup=False, quiet=True)
    sizes = (QWEN25_14B_Q4KM, QWEN25_05B_Q4KM)
    small = build_plan(opts, fetch=False, devices=gpu, ram_free_bytes=32 * GB, sizes=sizes)
    big = build_plan(replace(opts, budget=2000), fetch=False, devices=gpu, ram_free_bytes=32 * GB, sizes=sizes)
    assert small.files.target_path is None  # nothing downloaded: the plan works from sizes
    assert small.files.draft_name == "qwen2.5-0.5b" and small.drafter == "draft model"
    assert build_plan(replace(opts, lookup=None), fetch=False, devices=gpu, ram_free_bytes=32 * GB, sizes=sizes).drafter == "hybrid"
    assert small.target_ctx.n_ubatch == PREFILL_BATCH and big.target_ctx.n_ubatch == 2001
    assert 0 < small.target_gpu_layers < QWEN25_14B_Q4KM.n_layer + 1  # the 14B model is split
    assert small.placement.draft_device == 0  # the draft fits whole on the GPU
    assert big.target_gpu_layers < small.target_gpu_layers  # the larger compute buffer costs layers
    assert small.placement.gpu_fits and big.placement.gpu_fits


def test_specrun_plan_prints_the_plan_without_loading_weights(offline_models, cli):
    result = cli("plan", "--json", "--ctx-size", "1024", "--gpu", "Fake GPU=1.5GiB/2GiB", "--ram-free", "16GiB")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["drafter"] == "hybrid" and data["tree"]["kind"] == "chain"
    assert data["contexts"]["target"]["n_ubatch"] == PREFILL_BATCH
    assert data["memory"]["devices"][0]["name"] == "Fake GPU"
    assert 0 < data["target"]["gpu_layers"] <= data["target"]["layer_slots"]
    text = cli("plan", "--ctx-size", "1024")
    assert text.exit_code == 0 and "chain of 5 draft tokens" in text.stdout and "no GPU" in text.stdout
    # which kind of CPU kernels the loaded build has, read from llama.cpp's own system-info line
    invariant = "LLAMAFILE = 1" not in system_info()
    assert data["kernels"]["cpu_batch_invariant"] is invariant
    kernels_line = next(line for line in text.stdout.splitlines() if line.startswith("kernels"))
    assert ("one kernel for every pass size" in kernels_line) is invariant
    assert ("-DGGML_LLAMAFILE=OFF" in kernels_line) is not invariant
    assert "GPU or worker" not in kernels_line and data["kernels"]["offloaded"]  # (the JSON plan put layers on the GPU)
    # with layers on a GPU the line says what CUDA's kernels do, and the wider near-tie threshold
    assert data["kernels"]["near_tie_nats"] == NEAR_TIE_NATS_OFFLOADED
    on_gpu = cli("plan", "--ctx-size", "1024", "--gpu", "Fake GPU=1.5GiB/2GiB", "--ram-free", "16GiB")
    kernels_line = next(line for line in on_gpu.stdout.splitlines() if line.startswith("kernels"))
    assert kernels_line.startswith("kernels  GPU or worker: passes of two tokens or more round unlike one-token")
    assert f"under {NEAR_TIE_NATS_OFFLOADED} nats" in kernels_line and "--reproducible" in kernels_line
    assert json.loads(cli("plan", "--json", "--ctx-size", "1024").stdout)["kernels"]["near_tie_nats"] == NEAR_TIE_NATS
    bad = cli("plan", "--gpu", "nonsense")
    assert bad.exit_code == 2 and "NAME=FREE" in bad.output


def test_load_arguments_follow_the_plan_on_several_gpus():
    """What llama.cpp is told matches the plan: the split per GPU, the draft on its own GPU."""
    gpus = [DeviceInfo("GPU0", "assumed", "gpu", "CUDA", int(5.6 * GB), 6 * GB),
            DeviceInfo("GPU1", "assumed", "gpu", "CUDA", int(3.6 * GB), 4 * GB)]
    opts = RunOptions(target="qwen2.5-14b", ctx_size=4096, quiet=True)
    plan = build_plan(opts, fetch=False, devices=gpus, ram_free_bytes=32 * GB, sizes=(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM))
    target, draft = load_arguments(plan)
    assert target["n_gpu_layers"] == plan.target_gpu_layers > 0
    assert sum(target["tensor_split"]) == plan.target_gpu_layers  # per-device slot counts
    assert target["op_offload"] == plan.placement.op_offload
    assert draft["main_gpu"] == plan.placement.draft_device and draft["n_gpu_layers"] == QWEN25_05B_Q4KM.n_layer + 1
    cpu_only = build_plan(opts, fetch=False, devices=[], ram_free_bytes=32 * GB, sizes=(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM))
    assert load_arguments(cpu_only) == ({"n_gpu_layers": 0, "op_offload": None, "mmap": None},
                                        {"n_gpu_layers": 0, "op_offload": None})


def test_the_draft_drafts_during_the_target_pass_only_where_the_target_runs_wholly_elsewhere():
    """runtime.drafts_while_verifying: a target wholly on an RPC worker, the draft on this
    machine, overlap; a target split with RAM, a draft sharing the target's local GPU or a
    CPU-only run do not."""
    sizes = (QWEN25_14B_Q4KM, QWEN25_05B_Q4KM)
    opts = RunOptions(target="qwen2.5-14b", ctx_size=4096, lookup=False, quiet=True)

    def plan(*devices):
        return build_plan(opts, fetch=False, devices=list(devices), ram_free_bytes=32 * GB, sizes=sizes)

    worker = DeviceInfo("RPC0", "192.168.1.20:50052", "gpu", "RPC", 30 * GB, 32 * GB, host="192.168.1.20:50052")
    remote = plan(worker)
    assert remote.placement.target_cpu_layers == 0 and remote.placement.draft_device is None
    assert drafts_while_verifying(remote)
    local = plan(DeviceInfo("GPU", "assumed", "gpu", "CUDA", 40 * GB, 40 * GB))
    assert local.placement.target_cpu_layers == 0 and local.placement.draft_device == 0
    assert not drafts_while_verifying(local)  # the draft's passes would queue behind the target's
    split = plan(DeviceInfo("GPU", "assumed", "gpu", "CUDA", 8 * GB, 8 * GB))
    assert split.placement.target_cpu_layers > 0 and not drafts_while_verifying(split)
    assert not drafts_while_verifying(plan())


def test_without_a_gpu_a_run_reads_no_model_shapes(offline_models, monkeypatch):
    """Nothing to place on a CPU: a run must not pay for reading the models' shapes; RAM holds
    the files (memory-mapped) and the contexts as llama.cpp's simulation sizes them."""
    def no_reading(path):
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(placement, "model_size", no_reading)
    plan = build_plan(OPTS, devices=[])
    assert plan.target_gpu_layers == 0 and plan.draft_gpu_layers == 0
    weights = sum(placement.weight_bytes(p) for p in (offline_models.smollm2_f32, offline_models.smollm2_q4))
    (ram,) = plan.placement.breakdown
    assert ram.model == weights and plan.placement.measured
    assert plan.placement.ram_bytes == weights + ram.context + ram.compute + ram.output > weights


PROFILE_PASS_S = 0.0108  # the target's one-token pass when the stored profile was made


def _store_measured(offline_models, choice: Choice, pass_s: float = PROFILE_PASS_S) -> None:
    """A profile with what tune measures (the demo pair's figures), deciding `choice`."""
    key = profiles.profile_key(offline_models.smollm2_f32, offline_models.smollm2_q4, threads=OPTS.threads)
    profiles.save({
        "key": key, "config": choice.to_dict(), "best_tree": choice.to_dict(), "workloads": {},
        "predicted_speedup": 1.0, "measured_speedup": 1.0,
        "curves": {"target": {"sizes": [1, 8, 64], "seconds": [0.0113, 0.02, 0.09]},
                   "draft": {"sizes": [1, 64], "seconds": [0.0078, 0.3]}, "draft_topk": None},
        "plain": {"target_s": pass_s, "overhead_s": 0.00003},
        "acceptance": {"tau": {"4": 3.1, "5": 3.4}},
    })


def test_a_profile_is_checked_at_load_against_the_plan_made_without_it(offline_models, cli):
    """A profile measured on this machine in another state (a laptop on battery, a busy host)
    must not run slower than no profile: its plan carries the target's pass as the profile timed
    it, and the plan made without the profile, loaded when the pass timed at load is off."""
    _store_measured(offline_models, Choice("plain", 0, 0, 0, 0, 90.0, 1.0))
    plan = build_plan(OPTS, devices=[])
    assert plan.drafter == "lookup" and not plan.draft_loaded
    check = plan.check
    assert check.pass_s == PROFILE_PASS_S
    fallback = check.fallback
    assert fallback.drafter == "hybrid" and fallback.draft_loaded and fallback.check is None
    assert fallback.tree.shape == DEFAULT_SHAPE and fallback.tree.prior is None and fallback.tree.plain_s is None
    assert fallback.target_ctx == plan.target_ctx and fallback.draft_ctx is not None
    assert fallback.placement.ram_bytes > plan.placement.ram_bytes  # the draft's file is counted
    # Within 8% either way the profile holds; beyond, the run decides as without it.
    for holds in (PROFILE_PASS_S, PROFILE_PASS_S * 1.07, PROFILE_PASS_S / 1.07, None):
        assert plan.checked(holds) is plan
    for off in (PROFILE_PASS_S * 1.09, PROFILE_PASS_S / 1.09, PROFILE_PASS_S * 3):
        checked = plan.checked(off)
        assert checked.drafter == "hybrid" and checked.draft_loaded and checked.check is None
        assert f"{off * 1e3:.1f} ms now against 10.8 ms" in checked.why and fallback.why in checked.why
    # A profile whose tree won: its prior decides the first steps, and the fallback drops it.
    _store_measured(offline_models, Choice("specexec", 4, 4, 1, 1, 110.0, 1.2))
    tree = build_plan(OPTS, devices=[])
    assert tree.tree.source == "profile" and tree.tree.prior is not None and tree.tree.shape.budget == 4
    assert tree.check.fallback.tree.shape == DEFAULT_SHAPE and tree.check.fallback.tree.prior is None
    assert build_plan(OPTS, TreeShape(3, 3, 1, 1), devices=[]).check is None  # a tree given: nothing to check
    # `specrun plan` says so.
    data = json.loads(cli("plan", "--json", "--threads", "1", "--ctx-size", "1024").stdout)
    assert data["profile_check"] == {"target_pass_s": PROFILE_PASS_S, "drift": 0.08,
                                     "otherwise": {"drafter": "hybrid", "draft_loaded": True,
                                                   "tree": fallback.tree.describe()}}
    text = cli("plan", "--threads", "1", "--ctx-size", "1024").stdout
    assert "check: at load the target's one-token pass is timed; more than 8% off the profile's 10.8 ms" in text


def test_a_profile_check_that_would_take_the_targets_gpu_layers_is_not_offered(offline_models):
    """The fallback is loaded after the target: only where the target loads the same in both.
    A draft model that the profile left out would take GPU room the target's layers have."""
    _store_measured(offline_models, Choice("plain", 0, 0, 0, 0, 90.0, 1.0))
    sizes = (QWEN25_14B_Q4KM, QWEN25_05B_Q4KM)
    snug = [DeviceInfo("GPU", "assumed", "gpu", "CUDA", int(9.6 * GB), 10 * GB)]  # the target, nearly alone
    roomy = [DeviceInfo("GPU", "assumed", "gpu", "CUDA", int(23 * GB), 24 * GB)]  # both, whole
    plan = build_plan(OPTS, devices=snug, ram_free_bytes=32 * GB, sizes=sizes)
    assert not plan.draft_loaded and plan.check is None
    assert plan.target_gpu_layers == QWEN25_14B_Q4KM.n_layer + 1  # whole on the GPU without the draft
    plan = build_plan(OPTS, devices=roomy, ram_free_bytes=32 * GB, sizes=sizes)
    assert plan.check is not None and plan.check.fallback.placement.draft_device == 0
    assert plan.check.fallback.target_gpu_layers == plan.target_gpu_layers == QWEN25_14B_Q4KM.n_layer + 1


@pytest.mark.parametrize("pass_s", [0.0, -0.01, float("inf"), float("nan")])
def test_a_profile_whose_pass_time_is_nonsense_offers_no_check(offline_models, pass_s):
    """A hand-edited profile's pass time is not trusted to divide by: no check, the run goes on."""
    _store_measured(offline_models, Choice("plain", 0, 0, 0, 0, 90.0, 1.0), pass_s)
    plan = build_plan(OPTS, devices=[])
    assert plan.check is None and plan.drafter == "lookup"


def test_a_tied_head_in_ram_is_counted_once(offline_models):
    """Gemma 3 ties its output head to the token embedding (671 MB in F32 for the 270M). On a GPU
    llama.cpp keeps a copy of it for the head; in RAM the head reads the embedding's own mapped
    bytes. The detailed plan (specrun plan, chat's default context) counted the copy in RAM too:
    2.0 GB of weights planned for the Gemma pair where llama.cpp mapped 1.3, and every chat
    warned that the memory plan was off."""
    opts = RunOptions(target="gemma3-270m-f32", draft="gemma3-270m-q4", ctx_size=1024, threads=1, quiet=True)
    plan = build_plan(opts, devices=[], detailed=True)
    (ram,) = plan.placement.breakdown
    with Runtime(plan) as rt:
        mapped = rt.allocation.weights
    assert abs(ram.model - mapped) <= 0.03 * mapped, (ram.model, mapped)
    # On a GPU the head's copy is counted there, beside the layers; the embedding stays in RAM.
    size = placement.model_size(offline_models.gemma_f32)
    assert size.tied_bytes > 0 and size.tied_bytes <= size.output_bytes
    gpu = [DeviceInfo("Big GPU", "assumed", "gpu", "CUDA", 80 * GB, 80 * GB)]
    on_gpu = build_plan(replace(opts, draft=None, no_spec=True), devices=gpu, detailed=True)
    device, ram = on_gpu.placement.breakdown
    assert device.model == sum(size.layer_bytes) + size.output_bytes
    assert ram.model == size.input_bytes


def test_cpu_kernels_are_batch_invariant_only_without_llamafile():
    # llama.cpp's system-info line as the pinned build prints it, with and without tinyBLAS
    with_llamafile = "CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1"
    without = "CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 | REPACK = 1"
    assert not cpu_kernels_batch_invariant(with_llamafile)
    assert cpu_kernels_batch_invariant(without)
    assert cpu_kernels_batch_invariant() is ("LLAMAFILE = 1" not in system_info())


def test_contexts_keep_flash_attention_off_where_passes_run_batch_invariant(offline_models, monkeypatch):
    # On a build without llamafile and no device to offload to, every context opens with flash
    # attention off (its CPU kernel sums another way for every pass size); elsewhere llama.cpp's
    # "auto", which it resolves to enabled on the CPU and logs. The memory simulation opens the same.
    invariant = devices.runs_batch_invariant()
    assert invariant is (cpu_kernels_batch_invariant() and not devices.offload_devices())
    [allocated] = memory.simulate(offline_models.smollm2_f32, [memory.ContextSpec(256, 64)])
    assert allocated.flash_attn is (None if invariant else True)
    monkeypatch.setattr(devices, "offload_devices", lambda: [1])  # a GPU or an RPC worker
    assert not devices.runs_batch_invariant()


def test_flash_attention_as_the_user_asks_reaches_the_target_the_plan_and_its_simulation(offline_models, cli):
    # --flash-attn off opens the target's context without it (llama.cpp says so), the plan's memory
    # simulation opens the same (its compute buffer then holds the attention scores: larger), the
    # draft keeps its default, and the whole run still writes plain decoding's text.
    opts = replace(OPTS, flash_attn="off")
    plan = build_plan(opts, None, devices=[], ram_free_bytes=16 * GB)
    assert plan.target_ctx.flash_attn == "off" and plan.draft_ctx.flash_attn is None
    contexts = plan.to_dict()["contexts"]
    assert contexts["target"]["flash_attn"] == "off" and contexts["draft"]["flash_attn"] == engine.default_flash_attn()
    spec = dict(n_ctx=8192, n_batch=512)  # (the scores outgrow the output rows)
    [off] = memory.simulate(offline_models.smollm2_f32, [memory.ContextSpec(**spec, flash_attn="off")])
    [on] = memory.simulate(offline_models.smollm2_f32, [memory.ContextSpec(**spec, flash_attn="on")])
    assert off.compute_total > on.compute_total
    with engine.captured_log(quiet=True) as lines, Runtime(plan) as rt:
        assert rt.target_ctx.flash_attn == "off" and rt.target_ctx.batch_invariant is devices.runs_batch_invariant()
        assert "flash attention off (--flash-attn)" in describe(rt)  # the server's startup line
        with engine.Context(rt.target, n_ctx=256, n_batch=64, flash_attn="on") as on_ctx:
            assert not on_ctx.batch_invariant  # its kernel sums a row by the pass's size on any build
    said = [line.split("=")[-1].strip() for line in lines if "flash_attn" in line and "=" in line]
    assert said[:2] == ["disabled", engine.default_flash_attn()], said  # the target's, then the draft's
    prompt = "List three uses of a paperclip."
    texts = [cli("generate", "--raw", "-n", "40", "--temperature", "0", "--ctx-size", "512", "--flash-attn", "off", *flags,
                 input=prompt) for flags in ([], ["--no-spec"])]
    assert all(t.exit_code == 0 for t in texts), [t.output for t in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.strip()
    # Beside other requests it warns: their cells in the shared cache cost every pass without it.
    assert not plan.notes and any("--flash-attn off with 2 requests" in n for n in build_plan(
        replace(opts, parallel=2), None, devices=[], ram_free_bytes=16 * GB).notes)
    bad = cli("generate", "--flash-attn", "sometimes", input=prompt)
    assert bad.exit_code == 2 and "--flash-attn 'sometimes': choose auto, on or off" in bad.output


def test_a_tuning_profile_is_kept_apart_for_each_flash_attention_asked(offline_models):
    f32, q4 = offline_models.smollm2_f32, offline_models.smollm2_q4
    plain_key = profiles.profile_key(f32, q4, "fp", 2)
    assert "flash_attn" not in plain_key  # left to the default: the key profiles had before
    off, on = (profiles.profile_key(f32, q4, "fp", 2, flash_attn=v) for v in ("off", "on"))
    assert len({profiles.profile_path(k) for k in (plain_key, off, on)}) == 3
