"""This machine as llama.cpp sees it, and the fingerprint every stored tuning profile is keyed by."""

from __future__ import annotations

import subprocess
import sys

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


LINK_ORDER = """
import ctypes
import specrun.engine  # noqa: F401  (loads llama.cpp's libraries the way every run does)

class Info(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

names = []
Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)
callback = Callback(lambda info, size, data: names.append((info.contents.name or b"").decode()) or 0)
ctypes.CDLL(None).dl_iterate_phdr(callback, None)
print("\\n".join(name.rsplit("/", 1)[-1] for name in names))
"""


def test_the_system_cxx_runtime_is_loaded_before_llama_cpp_libraries():
    # A CUDA build's libggml-cuda exports copies of libstdc++'s stream templates; loaded ahead of
    # the real runtime (llama-cpp-python loads its libraries RTLD_GLOBAL, and Python links no
    # libstdc++), they served libllama's calls and a model load segfaulted on a GPU machine.
    # Load order is the global scope's lookup order: libstdc++ must come before every ggml library.
    done = subprocess.run([sys.executable, "-c", LINK_ORDER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.split()
    ggml = [i for i, name in enumerate(loaded) if name.startswith(("libggml", "libllama"))]
    cxx = [i for i, name in enumerate(loaded) if name.startswith("libstdc++")]
    assert ggml and cxx, loaded
    assert cxx[0] < ggml[0], loaded
