"""What the operating system says about this machine: CPU name and flags, RAM, how busy the CPU is.

Read from /proc on Linux, with portable fallbacks; every reader returns a neutral value rather
than failing, because these figures only inform (profile keys, warnings, memory plans).
"""

from __future__ import annotations

import functools
import os
import platform
import time


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.readlines()
    except OSError:
        return []


def cpu_name() -> str:
    """Return the CPU's model name."""
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """Return the CPU feature flags the kernel reports (empty when unknown)."""
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def repacking_crashes() -> bool:
    """Whether llama.cpp's weight repacking (its "extra buffer types") must stay off here: on a CPU
    with AMX, ggml's AMX matmul of the vendored llama.cpp crashes on multi-token batches of Q4_1
    weights (specrun loads without it; llama.cpp's own tools need `--no-repack`)."""
    return "amx_int8" in cpu_flags()


def ram_bytes() -> tuple[int, int]:
    """Return (total, available) system RAM; available falls back to free pages; (0, 0) if unknown."""
    fields: dict[str, int] = {}
    for line in _read_lines("/proc/meminfo"):
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # meminfo counts kB
    if "MemTotal" in fields:
        return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0, 0


def cpu_busy_fraction(seconds: float = 0.5) -> float | None:
    """Return the share of all CPU time used over a short sleep (by others: we sleep), or None."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in _read_lines("/proc/stat")[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (ValueError, IndexError):
        return None
    total = total1 - total0
    return (total - (idle1 - idle0)) / total if total > 0 else None
