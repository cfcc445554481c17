"""Emulated consumer cards: `--gpu-memory` makes a big GPU plan like a smaller one, and the cost
curves know where llama.cpp's placement makes t(n) jump. Device figures are passed in (no GPU here)."""

from __future__ import annotations

import json

import pytest
from test_offload import QWEN25_05B_Q4KM, QWEN25_14B_Q4KM

from specrun.engine import DeviceInfo
from specrun.hardware import offload
from specrun.runtime.plan import RunOptions, build_plan
from specrun.tuning import measure, profiles

GB = 1 << 30
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", "assumed", "gpu", "CUDA", int(79.1 * GB), int(79.6 * GB))
RTX_4060 = DeviceInfo("RTX 4060", "assumed", "gpu", "CUDA", 8 * GB, 8 * GB)
OPTS = RunOptions(target="qwen2.5-14b", ctx_size=4096, lookup=False, quiet=True)
SIZES = (QWEN25_14B_Q4KM, QWEN25_05B_Q4KM)


def _plan(devices, **flags):
    from dataclasses import replace

    return build_plan(replace(OPTS, **flags), fetch=False, devices=devices, ram_free_bytes=100 * GB, sizes=SIZES)


def test_a_capped_h100_plans_like_the_consumer_card_it_stands_in_for():
    whole = _plan([H100])
    assert whole.target_gpu_layers == QWEN25_14B_Q4KM.n_layer + 1  # 80 GB: everything on the GPU
    for card in (8, 12, 16):
        capped = _plan([H100], gpu_memory=card * GB)
        real = _plan([DeviceInfo(f"{card} GB card", "assumed", "gpu", "CUDA", card * GB, card * GB)])
        assert capped.placement.target_gpu_layers == real.placement.target_gpu_layers
        assert capped.placement.device_bytes == real.placement.device_bytes
        assert capped.placement.device_bytes[0] <= card * GB  # never more of the card than allowed
        assert capped.devices[0].name.startswith("NVIDIA H100") and f"{card}.0 GiB" in capped.devices[0].name
    layers = [_plan([H100], gpu_memory=card * GB).target_gpu_layers for card in (8, 12, 16, 24)]
    assert layers == sorted(layers) and layers[0] < layers[-1]  # more memory, more layers
    assert 0 < layers[0] < QWEN25_14B_Q4KM.n_layer  # the 8 GB card splits the 14B model
    # a cap above the card changes nothing
    assert _plan([RTX_4060], gpu_memory=80 * GB).placement == _plan([RTX_4060]).placement


def test_op_offload_and_the_cost_steps_follow_the_placement():
    split = _plan([H100], gpu_memory=8 * GB, budget=255)  # a 256-token tree: op offload pays
    assert split.placement.op_offload and split.placement.target_cpu_layers > 0
    assert offload.cost_steps(split.placement) == (offload.CUDA_VECTOR_KERNEL_MAX_BATCH + 1, offload.OP_OFFLOAD_MIN_BATCH)
    whole = _plan([H100], budget=255)
    assert offload.cost_steps(whole.placement) == (offload.CUDA_VECTOR_KERNEL_MAX_BATCH + 1,)  # nothing left in RAM
    assert offload.cost_steps(_plan([]).placement) == ()  # CPU only: one regime


def test_curve_sizes_measure_both_sides_of_each_step():
    assert measure.curve_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    stepped = measure.curve_sizes(256, (9, 32))
    assert {8, 9, 31, 32} <= set(stepped) and stepped == sorted(stepped)
    assert measure.curve_sizes(16, (9, 32)) == [1, 2, 4, 8, 9, 16]  # a step beyond the range adds nothing


def test_a_curve_may_fall_across_the_op_offload_step_but_not_within_a_regime():
    # RAM-resident layers: 31 tokens on the CPU cost more than 32 on the GPU after the weight copy
    decode = {1: 0.10, 16: 0.40, 31: 0.70, 32: 0.30, 64: 0.29, 128: 0.33}
    smooth = measure.CurveMeasurement(dict(decode), {}).curve()
    stepped = measure.CurveMeasurement(dict(decode), {}, steps=(32,)).curve()
    assert smooth.t(31) == pytest.approx(0.29)  # without the step the envelope hides the jump
    assert stepped.t(31) == pytest.approx(0.70) and stepped.t(32) == pytest.approx(0.29)
    assert stepped.t(16) == pytest.approx(0.40) and stepped.t(24) > stepped.t(64)


def test_a_capped_card_has_its_own_tuning_profile(offline_models):
    f32, q4 = offline_models.smollm2_f32, offline_models.smollm2_q4
    plain_key = profiles.profile_key(f32, q4, "fp", 2)
    assert "gpu_memory" not in plain_key  # profiles made before the option keep their key
    capped = profiles.profile_key(f32, q4, "fp", 2, gpu_memory=8 * GB)
    assert profiles.profile_path(capped) != profiles.profile_path(plain_key)
    assert profiles.profile_path(capped) != profiles.profile_path(profiles.profile_key(f32, q4, "fp", 2, gpu_memory=12 * GB))
    # the target read or mapped: its big passes cost differently, so each has its own profile
    assert "mmap" not in plain_key  # left to the plan (the default): the key profiles had before
    read, mapped = (profiles.profile_key(f32, q4, "fp", 2, mmap=m) for m in (False, True))
    assert len({profiles.profile_path(k) for k in (plain_key, read, mapped)}) == 3


def test_specrun_plan_with_gpu_memory(offline_models, cli):
    free = cli("plan", "--json", "--ctx-size", "1024", "--gpu", "Big GPU=79GiB/80GiB", "--ram-free", "16GiB")
    capped = cli("plan", "--json", "--ctx-size", "1024", "--gpu", "Big GPU=79GiB/80GiB", "--ram-free", "16GiB",
                 "--gpu-memory", "1GiB")
    assert free.exit_code == 0 and capped.exit_code == 0, capped.output
    whole, small = json.loads(free.stdout), json.loads(capped.stdout)
    assert whole["target"]["gpu_layers"] == whole["target"]["layer_slots"]
    assert 0 < small["target"]["gpu_layers"] < small["target"]["layer_slots"]
    device = small["memory"]["devices"][0]
    assert device["free_bytes"] == GB and device["planned_bytes"] <= device["limit_bytes"]
    for bad in ("lots", "0", "-1GiB"):
        result = cli("plan", "--gpu-memory", bad)
        assert result.exit_code != 0 and "--gpu-memory" in result.output and "Traceback" not in result.output
    no_gpu = cli("plan", "--ctx-size", "1024", "--gpu-memory", "8GiB")
    assert no_gpu.exit_code == 0 and "--gpu-memory has no effect" in no_gpu.stdout


def test_layers_left_in_ram_are_read_into_pinned_memory_where_a_gpu_runs_the_big_passes(cli):
    from dataclasses import replace

    from specrun.commands.plan import plan_lines

    split = _plan([H100], gpu_memory=8 * GB, budget=255)
    assert split.placement.target_cpu_layers > 0 and split.placement.op_offload
    assert split.mmap is False and split.to_dict()["target"]["mmap"] is False
    assert any("read into memory, not mapped" in line and "pinned" in line for line in plan_lines(split))
    assert _plan([H100]).mmap is None  # whole on the GPU: nothing in RAM to copy, mapped as llama.cpp does
    assert _plan([]).mmap is None  # no GPU
    # RPC workers alone: no GPU of this machine has pinned memory to lend
    worker = DeviceInfo("RPC[10.0.0.2:50052]", "worker", "gpu", "RPC", 8 * GB, 8 * GB, host="10.0.0.2:50052")
    assert _plan([worker], budget=255).placement.target_cpu_layers > 0 and _plan([worker], budget=255).mmap is None
    # RAM that cannot hold the layers read: mapped pages can be paged out, read ones cannot
    tight = build_plan(replace(OPTS, gpu_memory=8 * GB, budget=255), fetch=False, devices=[H100],
                       ram_free_bytes=2 * GB, sizes=SIZES)
    assert not tight.placement.ram_fits and tight.mmap is None
    # the user's choice wins either way, and reaches the loader
    forced = _plan([H100], gpu_memory=8 * GB, budget=255, mmap=True)
    assert forced.mmap is True and forced.to_dict()["target"]["mmap"] is True
    assert _plan([], mmap=False).mmap is False
    from specrun.runtime.runtime import load_arguments

    assert load_arguments(split)[0]["mmap"] is False and load_arguments(forced)[0]["mmap"] is True
    assert load_arguments(_plan([]))[0]["mmap"] is None


def test_specrun_plan_says_how_the_target_is_read(offline_models, cli):
    gpu = ("--gpu", "Big GPU=79GiB/80GiB", "--ram-free", "16GiB", "--gpu-memory", "1GiB", "--budget", "64")
    split = cli("plan", "--json", "--ctx-size", "1024", *gpu)
    mapped = cli("plan", "--json", "--ctx-size", "1024", "--mmap", *gpu)
    whole = cli("plan", "--json", "--ctx-size", "1024", "--gpu", "Big GPU=79GiB/80GiB", "--ram-free", "16GiB")
    assert split.exit_code == mapped.exit_code == whole.exit_code == 0, split.output
    assert json.loads(split.stdout)["target"]["mmap"] is False
    assert json.loads(mapped.stdout)["target"]["mmap"] is True
    assert json.loads(whole.stdout)["target"]["mmap"] is True
    text = cli("plan", "--ctx-size", "1024", *gpu)
    assert text.exit_code == 0 and "read into memory, not mapped" in text.stdout
    read_on_cpu = cli("plan", "--ctx-size", "1024", "--no-mmap")
    assert read_on_cpu.exit_code == 0 and "read into memory, not mapped" in read_on_cpu.stdout


def test_the_decoders_of_a_target_split_with_a_gpu_know_the_op_offload_step(offline_models):
    from specrun.runtime.runtime import Runtime, make_decoder

    def op_offload_step(plan):
        return offload.op_offload_step(plan.placement, plan.devices)

    assert op_offload_step(_plan([H100], gpu_memory=8 * GB, budget=255)) == offload.OP_OFFLOAD_MIN_BATCH
    assert op_offload_step(_plan([H100])) == 0 and op_offload_step(_plan([])) == 0  # nothing in RAM / no GPU
    worker = DeviceInfo("RPC[10.0.0.2:50052]", "worker", "gpu", "RPC", 8 * GB, 8 * GB, host="10.0.0.2:50052")
    assert op_offload_step(_plan([worker], budget=255)) == 0  # over RPC workers: the network's regime
    # The demo pair's untuned default (the hybrid around trees grown online), built as a split
    # target's decoder: its ladder leaves out the sizes below the step, its cost knows the step.
    with Runtime(RunOptions(ctx_size=1024, quiet=True)) as rt:
        tree = rt.plan.tree
        assert tree.grow is not None and tree.lookup is not None
        told = make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, offload_step=32).drafter
        blind = make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx).drafter
        assert told.cost.step == told.draft.cost.step == 32 and blind.cost.step == 0
        assert told.draft.levels == (blind.draft.levels[0], *(b for b in blind.draft.levels if b >= 31))
        assert any(b < 31 for b in blind.draft.levels[1:])


def test_the_op_offload_step_follows_llamas_own_setting():
    # CUDA reads GGML_OP_OFFLOAD_MIN_BATCH at start; the cost steps follow it, and a value it
    # cannot mean leaves llama.cpp's default rather than a traceback at import
    import os
    import subprocess
    import sys

    code = "from specrun.hardware import offload; print(offload.OP_OFFLOAD_MIN_BATCH)"
    for value, step in (("8", 8), ("", 32), ("lots", 32)):
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GGML_OP_OFFLOAD_MIN_BATCH": value},
                              capture_output=True, text=True, check=True)
        assert done.stdout.strip() == str(step)
