"""This machine as llama.cpp sees it, and the fingerprint every stored tuning profile is keyed by."""

from __future__ import annotations

from specrun.hardware.machine import Hardware, probe_hardware

GPU = {"name": "CUDA0", "description": "NVIDIA GeForce RTX 4090", "kind": "gpu", "backend": "CUDA",
       "free_bytes": 20 * 2**30, "total_bytes": 24 * 2**30}


def test_device_probe_sees_this_machine():
    hw = probe_hardware()

    assert hw.cores >= 1
    assert hw.ram_total_bytes > 2**30
    assert 0 < hw.ram_available_bytes <= hw.ram_total_bytes
    assert "CPU" in hw.backends
    cpu = [d for d in hw.devices if d["kind"] == "cpu"]
    assert cpu and cpu[0]["name"] == "CPU" and cpu[0]["total_bytes"] > 0
    assert hw.gpus == []  # no GPU on these machines
    assert hw.cpu and hw.cpu != "unknown"
    assert len(hw.fingerprint()) == 16 and hw.fingerprint() == probe_hardware().fingerprint()


def test_fingerprint_changes_with_a_gpu_but_not_with_free_memory():
    hw = probe_hardware()
    with_gpu = Hardware(**{**hw.__dict__, "devices": hw.devices + (GPU,)})
    busier = Hardware(**{**hw.__dict__, "devices": hw.devices + ({**GPU, "free_bytes": 2**30},),
                         "ram_available_bytes": hw.ram_available_bytes // 2})

    assert with_gpu.fingerprint() != hw.fingerprint()
    assert busier.fingerprint() == with_gpu.fingerprint()
    assert [g.name for g in with_gpu.gpus] == ["CUDA0"]
    assert with_gpu.gpus[0].total_bytes == 24 * 2**30


def test_the_fingerprint_of_a_machine_stays_what_stored_profiles_were_keyed_by():
    """Every stored profile's key holds this hash: a fingerprint computed another way would make
    every user's profile unreadable (runs would fall back to the untuned default until a new tune)."""
    cpu = {"name": "CPU", "description": "cpu", "kind": "cpu", "backend": "CPU", "free_bytes": 0, "total_bytes": 0}
    machine = Hardware(cpu="Some CPU", cores=8, ram_total_bytes=16 * 2**30, ram_available_bytes=1,
                       devices=({**GPU, "description": "NVIDIA X", "free_bytes": 1}, cpu), backends=("CUDA", "CPU"),
                       cpu_features="AVX2 = 1 | F16C = 1")

    assert machine.fingerprint() == "f7f90f4501605616"
