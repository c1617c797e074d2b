"""The compiled CPU kernels (cpu_pool.c, qmatmul.c, attention_cpu.c, rope_store_cpu.c,
decoder_cpu.c): built once per machine, loaded with ctypes.

`cc -O3 -march=native` builds every C file of this folder into one shared object in the user's
cache (`$XDG_CACHE_HOME/kvtool/kernels`), keyed by the sources, the compiler and the CPU's flags;
a build is written to a temporary name and renamed, so concurrent processes are safe. No
compiler, a failed build or `KVTOOL_NATIVE=0` means `lib()` is None and callers keep their torch
paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_DIR = Path(__file__).parent


def _sources() -> list[Path]:
    return sorted(_DIR.glob("*.c"))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtool" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build(cc: str, portable: bool = False) -> Path | None:
    """The shared object for this source, compiler and CPU, built if not yet in the cache;
    `portable` leaves out -march=native (the plain C path, which tests compare with)."""
    srcs = _sources()
    src = b"".join(p.read_bytes() for p in [*srcs, *sorted(_DIR.glob("*.h"))])
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(src + version + _cpu_flags().encode() + bytes([portable])).hexdigest()[:16]
    out = _cache_dir() / f"kvtool-cpu-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        flags = ["-O3", "-fPIC", "-shared", "-pthread", "-std=c11"] + ([] if portable else ["-march=native"])
        cmd = [cc, *flags, "-o", tmp, *map(str, srcs), "-lm"]
        r = subprocess.run(cmd, capture_output=True, timeout=120)
        if r.returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    except (OSError, subprocess.SubprocessError):
        return None
    return out


def load(path: Path) -> ctypes.CDLL | None:
    """The library at `path` with its functions typed, or None if it does not load."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    try:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvq_panels.argtypes = [ctypes.c_int]
        lib.kvq_panels.restype = ctypes.c_int
        lib.kvq_matmul_w.argtypes = [ctypes.c_void_p, ptr, i64, i64, ptr]
        lib.kvq_matmul_w.restype = ctypes.c_int
        lib.kvq_matmul_norm.argtypes = [ctypes.c_void_p, ptr, i64, i64, ptr, ptr, ctypes.c_float]
        lib.kvq_matmul_norm.restype = ctypes.c_int
        lib.kvq_ffn_glu.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_float, ptr]
        lib.kvq_ffn_glu.restype = ctypes.c_int
        lib.kvr_rope_store.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64]
        lib.kvr_rope_store.argtypes += [ctypes.c_int, ptr, i64, ptr, i64, ctypes.c_int, ptr]
        lib.kvr_rope_store.restype = ctypes.c_int
        lib.kvl_layers.argtypes = [ptr, ptr, i64, ptr, i64, ptr, i64]
        lib.kvl_layers.restype = ctypes.c_int
        lib.kvq_set_threads.argtypes = [ctypes.c_int]
        lib.kvq_set_threads.restype = ctypes.c_int
    except AttributeError:  # a library of other sources: a function is missing
        return None
    lib.kvq_set_threads(torch.get_num_threads())
    return lib


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The kernels built for this machine, or None where they cannot be."""
    if os.environ.get("KVTOOL_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    path = build(cc) if cc else None
    return load(path) if path is not None else None


def set_threads(n: int) -> None:
    """Threads the kernels compute with (the caller's included); no-op when they are not loaded."""
    c = lib()
    if c is not None:
        c.kvq_set_threads(n)
