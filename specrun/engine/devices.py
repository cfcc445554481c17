"""The devices and backends llama.cpp's ggml sees (GPU names, free and total memory), and the
devices of RPC workers added beside them (engine.rpc), each with the worker's address as its host.

llama-cpp-python does not bind ggml's device API; a few ctypes declarations on the libggml
shipped beside libllama do.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as C

from specrun.engine.backend import ensure_backend
from specrun.errors import EngineError

_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class DeviceInfo:
    """One compute device as libggml reports it: name, kind ('cpu', 'gpu', ...), memory in bytes,
    and the RPC worker it is on ("HOST:PORT"; "" on this machine)."""

    __slots__ = ("name", "description", "kind", "backend", "free_bytes", "total_bytes", "host")

    def __init__(self, name: str, description: str, kind: str, backend: str, free_bytes: int, total_bytes: int,
                 host: str = ""):
        self.name, self.description, self.kind, self.backend = name, description, kind, backend
        self.free_bytes, self.total_bytes = int(free_bytes), int(total_bytes)
        self.host = host

    def to_dict(self) -> dict:
        return {slot: getattr(self, slot) for slot in self.__slots__}

    def __repr__(self) -> str:
        return f"DeviceInfo({self.to_dict()!r})"


_ggml = None


class InitParams(ctypes.Structure):  # ggml_init_params
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def ggml_lib():
    """Return libggml (the copy libllama already loaded), with the device functions declared."""
    global _ggml
    if _ggml is not None:
        return _ggml
    ensure_backend()
    lib_dir = Path(C.llama_cpp._lib._name).parent
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:
        raise EngineError(f"libggml not found beside libllama in {lib_dir}")
    ptr, size_t, char_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    signatures = {
        "ggml_backend_dev_count": ([], size_t),
        "ggml_backend_dev_get": ([size_t], ptr),
        "ggml_backend_dev_name": ([ptr], char_p),
        "ggml_backend_dev_description": ([ptr], char_p),
        "ggml_backend_dev_memory": ([ptr, ctypes.POINTER(size_t), ctypes.POINTER(size_t)], None),
        "ggml_backend_dev_type": ([ptr], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([ptr], ptr),
        "ggml_backend_reg_count": ([], size_t),
        "ggml_backend_reg_get": ([size_t], ptr),
        "ggml_backend_reg_name": ([ptr], char_p),
        "ggml_backend_dev_by_type": ([ctypes.c_int], ptr),
        "ggml_backend_dev_buffer_type": ([ptr], ptr),
        "ggml_backend_reg_by_name": ([char_p], ptr),
        "ggml_backend_reg_get_proc_address": ([ptr, char_p], ptr),
        "ggml_backend_reg_dev_count": ([ptr], size_t),
        "ggml_backend_reg_dev_get": ([ptr, size_t], ptr),
        "ggml_backend_dev_by_name": ([char_p], ptr),
        "ggml_backend_dev_init": ([ptr, char_p], ptr),
        # a tensor in a device's buffer (engine.rpc.fetch_s)
        "ggml_init": ([InitParams], ptr),
        "ggml_free": ([ptr], None),
        "ggml_new_tensor_1d": ([ptr, ctypes.c_int, ctypes.c_int64], ptr),
        "ggml_backend_buft_alloc_buffer": ([ptr, size_t], ptr),
        "ggml_backend_buffer_get_base": ([ptr], ptr),
        "ggml_backend_buffer_free": ([ptr], None),
        "ggml_backend_tensor_alloc": ([ptr, ptr, ptr], ctypes.c_int),
        "ggml_backend_tensor_get": ([ptr, ptr, size_t, size_t], None),
    }
    for fn_name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, restype
    _ggml = lib
    return lib


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", errors="replace") if raw else ""


# The RPC workers' devices added in this process (engine.rpc.connect): (host, device pointer).
_remote: list[tuple[str, int]] = []
GPU_KINDS = ("gpu", "igpu")


def _describe(dev, host: str = "") -> DeviceInfo:
    lib = ggml_lib()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))  # asks the worker, for a remote one
    reg = lib.ggml_backend_dev_backend_reg(dev)
    return DeviceInfo(
        name=_text(lib.ggml_backend_dev_name(dev)),
        description=_text(lib.ggml_backend_dev_description(dev)).strip(),
        kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "unknown"),
        backend=_text(lib.ggml_backend_reg_name(reg)) if reg else "",
        free_bytes=free.value,
        total_bytes=total.value,
        host=host,
    )


def local_devices() -> list[tuple[DeviceInfo, int]]:
    """Return this machine's devices (the CPU included), each with its ggml device pointer."""
    lib = ggml_lib()
    pointers = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    return [(_describe(dev), dev) for dev in pointers]


def list_devices() -> list[DeviceInfo]:
    """Return every device llama.cpp can compute on (the CPU included), with its free/total memory:
    this machine's, then the RPC workers'."""
    return [info for info, _ in local_devices()] + remote_devices()


def remote_devices() -> list[DeviceInfo]:
    """Return the RPC workers' devices added in this process (their memory asked over the network)."""
    return [_describe(dev, host) for host, dev in _remote]


def add_remote_devices(host: str, devices: list[int]) -> None:
    """Add an RPC worker's devices (engine.rpc.connect) to the ones listed and offloaded to."""
    _remote.extend((host, dev) for dev in devices)


def remote_hosts() -> list[str]:
    """Return the RPC workers whose devices were added, in order."""
    return list(dict.fromkeys(host for host, _ in _remote))


def device_by_name(name: str) -> int | None:
    """Return this machine's device called `name` (e.g. "CPU", "CUDA0"), or None."""
    return ggml_lib().ggml_backend_dev_by_name(name.encode()) or None


def local_gpus() -> list[int]:
    """Return this machine's GPUs (integrated ones included), as ggml device pointers."""
    return [dev for info, dev in local_devices() if info.kind in GPU_KINDS]


def offload_devices() -> list[int]:
    """Return the devices a model spread over hosts offloads to, in the order the planner counts
    them (hardware.placement.gpus_of): the RPC workers' first (as llama.cpp orders them), then
    this machine's GPUs."""
    return [dev for _, dev in _remote] + local_gpus()


def cpu_buffer_type() -> int:
    """Return the CPU device's buffer type (where a tensor override keeps weights in RAM)."""
    lib = ggml_lib()
    device = lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not device:
        raise EngineError("llama.cpp reports no CPU device")
    return lib.ggml_backend_dev_buffer_type(device)


def backend_names() -> list[str]:
    """Return the llama.cpp backends compiled in or loaded (e.g. ['CPU'], ['CUDA', 'CPU'])."""
    lib = ggml_lib()
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def system_info() -> str:
    """Return llama.cpp's one-line CPU feature summary (SSE3 = 1 | AVX2 = 1 | ...)."""
    ensure_backend()
    return _text(C.llama_print_system_info()).strip(" |")


def cpu_kernels_batch_invariant(info: str | None = None) -> bool:
    """Whether this build's CPU matrix products take one kernel for every batch size: true without
    llamafile's tinyBLAS, which takes F32/F16/BF16/Q8_0/Q4_0 products over from two tokens a pass
    and sums in another order than the one-token dot products. On such a build, with flash
    attention off and no repacked weights, a chain or a prompt in chunks of any size gives plain
    decoding's logits bit for bit (docs/exactness.md). `info`: llama.cpp's system-info line
    (default: the loaded build's)."""
    return "LLAMAFILE = 1" not in (system_info() if info is None else info)


def runs_batch_invariant() -> bool:
    """Whether specrun computes every pass here with one kernel per op whatever its size: a build
    whose CPU kernels are batch invariant (cpu_kernels_batch_invariant) and no GPU or RPC worker to
    compute on. Then contexts keep flash attention off and models load without repacked weights,
    and a chain, a prompt in chunks or a one-token pass give the same logits bit for bit."""
    return not offload_devices() and cpu_kernels_batch_invariant()
