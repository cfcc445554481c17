"""This machine as llama.cpp sees it: CPU, RAM, devices and backends, and the fingerprint of the
parts that decide speed (a stored tuning profile is only valid on the same hardware)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from specrun import engine, sysinfo
from specrun.hardware.offload import Device


@dataclass(frozen=True)
class Hardware:
    """What this machine offers llama.cpp. Memory in bytes; `devices` as engine.DeviceInfo dicts."""

    cpu: str
    cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    devices: tuple[dict, ...]
    backends: tuple[str, ...]
    cpu_features: str = ""

    @property
    def gpus(self) -> list:
        """Return the accelerators (not the CPU) as offload.Device, for the offload planner."""

        return [
            Device(d["name"], d["free_bytes"], d["total_bytes"])
            for d in self.devices
            if d["kind"] in ("gpu", "igpu")
        ]

    def fingerprint(self) -> str:
        """Return a short hash of what decides speed: CPU, cores, RAM size, GPUs, backends.

        Free memory changes from run to run and is left out; total RAM and GPU memory are rounded
        to GiB so a kernel reserving a little more does not invalidate a profile. Every stored
        profile's key holds this hash: what goes into it, and how, must not change.
        """
        stable = {
            "cpu": self.cpu,
            "cores": self.cores,
            "ram_gib": round(self.ram_total_bytes / 2**30),
            "gpus": sorted((d["name"], d["description"], round(d["total_bytes"] / 2**30)) for d in self.devices if d["kind"] != "cpu"),
            "backends": sorted(self.backends),
            "cpu_features": self.cpu_features,
        }
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "cpu": self.cpu,
            "cores": self.cores,
            "ram_total_bytes": self.ram_total_bytes,
            "ram_available_bytes": self.ram_available_bytes,
            "devices": [dict(d) for d in self.devices],
            "backends": list(self.backends),
            "cpu_features": self.cpu_features,
            "fingerprint": self.fingerprint(),
        }


def probe_hardware() -> Hardware:
    """Return the CPU, RAM, devices and backends of this machine as llama.cpp sees them."""

    total, available = sysinfo.ram_bytes()
    return Hardware(
        cpu=sysinfo.cpu_name(),
        cores=engine.default_threads(),
        ram_total_bytes=total,
        ram_available_bytes=available,
        devices=tuple(d.to_dict() for d in engine.list_devices()),
        backends=tuple(engine.backend_names()),
        cpu_features=engine.system_info(),
    )
