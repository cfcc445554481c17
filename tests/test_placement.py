"""GPU placement from real model metadata and made-up devices (this machine has no GPU)."""

from specrun.engine import DeviceInfo
from specrun.hardware import placement

GB = 1 << 30


def _gpu(free_gb: float) -> DeviceInfo:
    return DeviceInfo("GPU0", "fake GPU", "gpu", "CUDA", int(free_gb * GB), int(free_gb * GB))


def test_model_size_from_real_metadata(offline_models):
    size = placement.model_size(offline_models.smollm2_f32)
    assert size.n_layer == 30
    assert size.n_vocab == 49152
    assert abs(size.file_bytes - offline_models.smollm2_f32.stat().st_size) == 0
    assert 0 < size.input_bytes < size.file_bytes


def test_no_gpu_keeps_everything_in_ram(offline_models):
    cpu = DeviceInfo("CPU", "cpu", "cpu", "CPU", 0, 0)
    assert placement.gpu_layers(offline_models.smollm2_f32, offline_models.smollm2_q4, 4096, 65, devices=[cpu]) == (0, 0)


def test_big_gpu_takes_all_layers_and_the_draft(offline_models):
    target, draft = placement.gpu_layers(
        offline_models.smollm2_f32, offline_models.smollm2_q4, 4096, 65, devices=[_gpu(24)], ram_free_bytes=16 * GB
    )
    assert target == 31  # 30 blocks + the output layer
    assert draft > 0


def test_small_gpu_splits_the_target(offline_models):
    target, _ = placement.gpu_layers(
        offline_models.smollm2_f32, offline_models.smollm2_q4, 2048, 65, devices=[_gpu(0.9)], ram_free_bytes=16 * GB
    )
    assert 0 < target < 31


def test_override_wins(offline_models):
    target, _ = placement.gpu_layers(
        offline_models.smollm2_f32, None, 2048, 65, override=5, devices=[_gpu(24)], ram_free_bytes=16 * GB
    )
    assert target == 5
