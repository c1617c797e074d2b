"""Memory-mapped files that may be truncated while mapped (kernels/mmap_guard.c): a read past
the new end reads zeros instead of killing the process with SIGBUS, and is counted, so the
reader can refuse what it computed. Without the compiled kernels nothing is guarded."""

from __future__ import annotations

import mmap

import numpy as np

from kvtool.kernels import cpu_lib


def guard(mm: mmap.mmap) -> int | None:
    """Guards the whole map; returns its address (the key of `faults` and `unguard`), or None
    when it cannot be guarded (no compiled kernels, every slot taken, an empty map)."""
    lib = cpu_lib.lib()
    if lib is None or len(mm) == 0:
        return None
    addr = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)  # a read-only map has no ctypes view
    return addr if lib.kvg_guard(addr, len(mm)) == 0 else None


def unguard(addr: int) -> None:
    lib = cpu_lib.lib()
    if lib is not None:
        lib.kvg_unguard(addr)


def faults(addr: int) -> int:
    """Reads of the guarded map at `addr` that found their page gone (0 when none)."""
    lib = cpu_lib.lib()
    return max(0, int(lib.kvg_faults(addr))) if lib is not None else 0
