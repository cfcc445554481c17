"""The server's heap: glibc's malloc held to a few arenas.

glibc's malloc gives each new thread an arena of its own, up to 8 per core, and an arena keeps
what it freed for its own later use. Each answer decodes in a thread of its own (worker.py), in
the server's process or, with --rpc, in the child that loads the models (isolated.py): over an
hour of mixed requests the heap grew twice as much as with two arenas (docs/benchmarks.md, the
soak).
"""

from __future__ import annotations

import ctypes
import os
import platform

MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # mallopt's parameter (glibc's malloc.h)


def bound_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Have glibc's malloc keep at most `arenas` arenas from now on; return whether it does (not
    off glibc, nor where the user set MALLOC_ARENA_MAX, which glibc then reads itself)."""
    if os.environ.get("MALLOC_ARENA_MAX") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):
        return False
