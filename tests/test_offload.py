"""The offload planner with made-up GPUs and real model sizes: never more than the memory given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specrun.hardware import placement
from specrun.hardware.offload import (
    DEFAULT_MARGIN_BYTES,
    Device,
    ModelSize,
    compute_buffer_bytes,
    kv_bytes_per_layer,
    plan_offload,
)

GB = 10**9
RAM = 32 * GB


def _bytes(n_elements: int, bits_per_weight: float) -> int:
    return int(n_elements * bits_per_weight / 8)


# Real file sizes; input/output from their shapes and quant types (Q4_K = 4.5 bits per weight,
# Q6_K = 6.5625, Q8_0 = 8.5), the layers get the rest of the file.
QWEN25_14B_Q4KM = ModelSize.from_totals(
    8_988_110_496, 48, n_embd=5120, n_vocab=152064, n_head=40, n_head_kv=8, n_ff=13824,
    input_bytes=_bytes(152064 * 5120, 4.5), output_bytes=_bytes(152064 * 5120, 6.5625),
)
QWEN25_05B_Q4KM = ModelSize.from_totals(  # ties its output to the token embedding
    491_400_032, 24, n_embd=896, n_vocab=151936, n_head=14, n_head_kv=2, n_ff=4864,
    input_bytes=_bytes(151936 * 896, 8.5), output_bytes=_bytes(151936 * 896, 8.5),
)
LLAMA31_70B_Q4KM = ModelSize.from_totals(
    42_520_393_152, 80, n_embd=8192, n_vocab=128256, n_head=64, n_head_kv=8, n_ff=28672,
    input_bytes=_bytes(128256 * 8192, 4.5), output_bytes=_bytes(128256 * 8192, 6.5625),
)


def gpu(total_gb: float, used_gb: float = 0.4, name: str = "GPU0") -> Device:
    """A GPU with the desktop and the CUDA context already using `used_gb`."""
    return Device(name, int((total_gb - used_gb) * GB), int(total_gb * GB))


def _assert_within_limits(plan, devices, margin=DEFAULT_MARGIN_BYTES):
    for used, device in zip(plan.device_bytes, devices):
        assert used <= max(0, device.free_bytes - margin)
    assert plan.gpu_fits


def test_no_gpu_keeps_everything_in_ram():
    plan = plan_offload(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM, [], RAM, 4096, 512)
    assert plan.target_gpu_layers == 0 and plan.target_tensor_split == ()
    assert plan.draft_device is None and plan.draft_gpu_layers == 0
    assert not plan.op_offload and plan.device_bytes == ()
    both_files = QWEN25_14B_Q4KM.file_bytes + QWEN25_05B_Q4KM.file_bytes
    both_kv = kv_cache_bytes(QWEN25_14B_Q4KM, 4096) + kv_cache_bytes(QWEN25_05B_Q4KM, 4096)
    assert both_files + both_kv < plan.ram_bytes < both_files + both_kv + 3 * GB
    assert plan.fits and plan.warnings == ()


def kv_cache_bytes(model: ModelSize, n_ctx: int, kv_type: str | None = None) -> int:
    return model.n_layer * kv_bytes_per_layer(model, n_ctx, kv_type)


def test_kv_cache_follows_the_formula():
    # 2 (K, V) * 48 layers * 4096 cells * 8 kv heads * 128 dims * 2 bytes (f16)
    assert kv_cache_bytes(QWEN25_14B_Q4KM, 4096) == 2 * 48 * 4096 * 1024 * 2
    assert kv_cache_bytes(QWEN25_14B_Q4KM, 4000) == kv_cache_bytes(QWEN25_14B_Q4KM, 4096)  # padded
    # --kv-type: ggml's blocks of 32 values, q8_0 in 34 bytes, q4_0 in 18
    assert kv_cache_bytes(QWEN25_14B_Q4KM, 4096, "q8_0") == 2 * 48 * 4096 * 1024 * 34 // 32
    assert kv_cache_bytes(QWEN25_14B_Q4KM, 4096, "q4_0") == 2 * 48 * 4096 * 1024 * 18 // 32


def test_a_quantized_kv_cache_leaves_room_for_more_layers():
    """Where llama.cpp's simulation cannot run (a shape planned before the download), the
    planner's own formula counts the target's cache at --kv-type's bytes: more layers fit."""
    card = [Device("GPU0", 10 * GB, 10 * GB)]
    f16 = plan_offload(QWEN25_14B_Q4KM, None, card, RAM, 32768, 512)
    q8 = plan_offload(QWEN25_14B_Q4KM, None, card, RAM, 32768, 512, kv_type="q8_0")
    assert 0 < f16.target_gpu_layers < q8.target_gpu_layers
    assert q8.device_bytes[0] <= 10 * GB - DEFAULT_MARGIN_BYTES


@pytest.mark.parametrize(
    ("total_gb", "expected"),
    [(8, range(15, 45)), (12, [49]), (24, [49])],
)
def test_qwen_14b_with_its_draft_on_consumer_gpus(total_gb, expected):
    devices = [gpu(total_gb)]
    plan = plan_offload(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM, devices, RAM, 4096, 512)
    assert plan.draft_device == 0 and plan.draft_gpu_layers == 25  # the draft goes first
    assert plan.target_gpu_layers in expected
    assert plan.target_tensor_split == (float(plan.target_gpu_layers),)
    assert plan.op_offload
    _assert_within_limits(plan, devices)
    assert plan.fits and plan.warnings == ()


def test_planned_layers_are_the_most_that_fit_with_op_offload():
    devices = [gpu(8)]
    plan = plan_offload(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM, devices, RAM, 4096, 512)
    assert plan.op_offload
    more = plan_offload(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM, devices, RAM, 4096, 512,
                        gpu_layers_override=plan.target_gpu_layers + 1)
    # one more layer fits only by giving up the room for op offload's weight copies, which a
    # 500-token tree pass needs far more
    assert more.gpu_fits and not more.op_offload
    two_more = plan_offload(QWEN25_14B_Q4KM, QWEN25_05B_Q4KM, devices, RAM, 4096, 512,
                            gpu_layers_override=plan.target_gpu_layers + 3)
    assert not two_more.gpu_fits and "GPU0" in two_more.warnings[0]


def test_llama_70b_on_a_24gb_gpu_splits_with_ram():
    devices = [gpu(24)]
    plan = plan_offload(LLAMA31_70B_Q4KM, None, devices, 64 * GB, 8192, 512)
    assert 20 < plan.target_gpu_layers < 60
    assert plan.target_cpu_layers == 81 - plan.target_gpu_layers
    _assert_within_limits(plan, devices)
    on_gpu_weights = sum(LLAMA31_70B_Q4KM.layer_bytes[-(plan.target_gpu_layers - 1):]) + LLAMA31_70B_Q4KM.output_bytes
    assert plan.ram_bytes > LLAMA31_70B_Q4KM.file_bytes - on_gpu_weights
    assert plan.ram_fits


def test_insufficient_ram_is_flagged_not_hidden():
    plan = plan_offload(LLAMA31_70B_Q4KM, None, [gpu(24)], 16 * GB, 8192, 512)
    assert plan.gpu_fits and not plan.ram_fits and not plan.fits
    assert any(w.startswith("RAM:") for w in plan.warnings)
    assert plan.to_dict()["warnings"] == list(plan.warnings)


def test_a_draft_that_does_not_fit_stays_in_ram():
    devices = [Device("small", 1 * GB, 2 * GB)]
    plan = plan_offload(QWEN25_14B_Q4KM, LLAMA31_70B_Q4KM, devices, 128 * GB, 4096, 64)
    assert plan.draft_device is None and plan.draft_gpu_layers == 0
    assert plan.ram_bytes > LLAMA31_70B_Q4KM.file_bytes + QWEN25_14B_Q4KM.input_bytes
    _assert_within_limits(plan, devices)


def test_draft_goes_to_the_roomiest_gpu():
    devices = [gpu(8, name="small"), gpu(24, name="big")]
    plan = plan_offload(LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM, devices, 64 * GB, 4096, 512)
    assert plan.draft_device == 1
    _assert_within_limits(plan, devices)


def test_gpu_layers_override_wins_but_reports_memory():
    devices = [gpu(8)]
    plan = plan_offload(QWEN25_14B_Q4KM, None, devices, RAM, 4096, 512, gpu_layers_override=-1)
    assert plan.overridden and plan.target_gpu_layers == 49
    assert not plan.gpu_fits and plan.device_bytes[0] > QWEN25_14B_Q4KM.file_bytes - QWEN25_14B_Q4KM.input_bytes
    assert any("loading may fail" in w for w in plan.warnings)

    plan = plan_offload(QWEN25_14B_Q4KM, None, [gpu(24)], RAM, 4096, 512, gpu_layers_override=10)
    assert plan.target_gpu_layers == 10 and plan.fits and plan.warnings == ()

    plan = plan_offload(QWEN25_14B_Q4KM, None, [], RAM, 4096, 512, gpu_layers_override=20)
    assert plan.target_gpu_layers == 0 and "no GPU" in plan.warnings[0]


def _llama_cpp_layer_devices(n_layer: int, gpu_layers: int, tensor_split) -> list[int]:
    """Which device llama.cpp puts each slot on (-1 = CPU), with its float32 arithmetic."""
    splits = np.cumsum(np.asarray(tensor_split, dtype=np.float32), dtype=np.float32)
    splits = splits / np.float32(splits[-1])
    start = max(n_layer + 1 - gpu_layers, 0)
    act = min(gpu_layers, n_layer + 1)
    devices = []
    for il in range(n_layer + 1):
        if il < start:
            devices.append(-1)
        else:
            x = np.float32(il - start) / np.float32(act)
            devices.append(int(np.searchsorted(splits, x, side="right")))
    return devices


def test_several_gpus_get_the_slots_llama_cpp_will_give_them():
    devices = [gpu(6, name="a"), gpu(4, name="b"), gpu(3, name="c")]
    plan = plan_offload(LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM, devices, 64 * GB, 4096, 512)
    _assert_within_limits(plan, devices)
    counts = [int(c) for c in plan.target_tensor_split]
    assert sum(counts) == plan.target_gpu_layers and all(counts)
    placed = _llama_cpp_layer_devices(80, plan.target_gpu_layers, plan.target_tensor_split)
    assert [placed.count(k) for k in range(3)] == counts
    assert placed == sorted(placed)  # contiguous, in device order


def test_compute_buffer_grows_with_the_tree_and_shrinks_with_flash_attention():
    small = compute_buffer_bytes(QWEN25_14B_Q4KM, 4096, 64)
    big = compute_buffer_bytes(QWEN25_14B_Q4KM, 4096, 512)
    assert big == 8 * small
    assert compute_buffer_bytes(QWEN25_14B_Q4KM, 4096, 512, flash_attn=True) < big


memory_gb = st.floats(0.0, 48.0)


@settings(max_examples=150, deadline=None)
@given(
    free=st.lists(memory_gb, min_size=1, max_size=3),
    grow_device=st.integers(0, 2),
    extra=st.floats(0.01, 16.0),
    n_ctx=st.sampled_from([512, 2048, 4096, 16384]),
    tree=st.sampled_from([16, 64, 256, 512]),
    with_draft=st.booleans(),
    target=st.sampled_from([QWEN25_14B_Q4KM, LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM]),
)
def test_plans_never_exceed_memory_and_more_memory_never_means_fewer_layers(
    free, grow_device, extra, n_ctx, tree, with_draft, target
):
    draft = QWEN25_05B_Q4KM if with_draft else None
    devices = [Device(f"GPU{i}", int(f * GB), int(f * GB) + GB) for i, f in enumerate(free)]
    plan = plan_offload(target, draft, devices, RAM, n_ctx, tree)
    _assert_within_limits(plan, devices)
    assert 0 <= plan.target_gpu_layers <= target.n_layer + 1

    assume(grow_device < len(devices))
    bigger = list(devices)
    grown = bigger[grow_device]
    bigger[grow_device] = Device(grown.name, grown.free_bytes + int(extra * GB), grown.total_bytes)
    more = plan_offload(target, draft, bigger, RAM, n_ctx, tree)
    _assert_within_limits(more, bigger)
    # a roomier GPU may newly take the draft, and device 0 may newly afford op offload's weight
    # copies; each costs GPU memory on purpose. Otherwise layers only grow.
    if more.draft_device == plan.draft_device:
        assert more.op_offload >= plan.op_offload
        if more.op_offload == plan.op_offload:
            assert more.target_gpu_layers >= plan.target_gpu_layers


def test_model_size_from_gguf_tensors():
    tensors = {
        "token_embd.weight": 1000,
        "blk.0.attn_q.weight": 100, "blk.0.ffn_up.weight": 300, "blk.0.attn_norm.weight": 4,
        "blk.1.attn_q.weight": 100, "blk.1.ffn_up.weight": 320,
        "output_norm.weight": 4, "output.weight": 1500,
    }
    size = placement.size_from_tensors(tensors, 4000, 2, n_embd=64, n_vocab=32000, n_head=8, n_head_kv=2, n_ff=256)
    assert size.layer_bytes == (404, 420) and size.n_layer == 2
    assert size.input_bytes == 1000 and size.output_bytes == 1504
    assert size.n_embd_k_gqa == size.n_embd_v_gqa == 2 * 8  # 2 kv heads of 64 / 8 dims
    assert (size.n_vocab, size.n_head, size.n_ff, size.file_bytes) == (32000, 8, 256, 4000)
    assert size.largest_tensor_bytes == 320


def test_model_size_with_tied_embeddings_and_stated_head_sizes():
    tensors = {"token_embd.weight": 800, "blk.0.attn_k.weight": 50, "output_norm.weight": 2}
    size = placement.size_from_tensors(tensors, 852, 1, n_embd=640, n_vocab=3, n_head=4, n_head_kv=1,
                                       key_length=256, value_length=256)
    assert size.output_bytes == 802  # llama.cpp keeps a copy of the embedding as the output
    assert size.input_bytes == 800 and size.file_bytes == 852
    assert size.n_embd_k_gqa == 256  # the key length the file states, not n_embd / n_head = 160
    assert size.n_ff == 0  # unknown: the planner estimates it


def test_a_real_gemma_file_gives_its_stated_head_size(offline_models):
    """Gemma 3's heads are 256 wide although n_embd / n_head is 160 (llama.cpp reads key_length)."""
    size = placement.model_size(offline_models.gemma_q4)
    assert size.n_embd_k_gqa == size.n_embd_v_gqa == 256 and size.n_ctx_train == 32768


def test_the_placement_line_names_rpc_workers_as_such():
    from specrun.hardware.placement import _devices_named
    card, worker = Device("CUDA0", GB, GB), Device("RPC0", GB, GB, "10.0.0.2:50052")
    assert _devices_named([card]) == "GPU"
    assert _devices_named([worker, worker]) == "RPC workers"  # (a worker's CPU is no GPU)
    assert _devices_named([worker, card]) == "GPUs and RPC workers"
