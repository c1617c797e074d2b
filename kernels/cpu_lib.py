"""The compiled CPU kernels (cpu_pool.c, qmatmul.c, attention_cpu.c, rope_store_cpu.c,
kv_quant_cpu.c, decoder_cpu.c) and the guard of mapped model files (mmap_guard.c): built once
per machine, loaded with ctypes.

`cc -O3` for this CPU (`-march=native` on x86, `-mcpu=native` on ARM, as llama.cpp's native
builds) builds every C file of this folder into one shared object in the user's cache
(`$XDG_CACHE_HOME/kvtool/kernels`), keyed by the sources, the compiler and the CPU's features
(/proc/cpuinfo where there is one, else the compiler's own macros for the native target); a
build is written to a temporary name and renamed, so concurrent processes are safe. A compiler
that refuses the native flag gets a portable build; no compiler or a failed build means `lib()`
is None and torch computes every op (kvtool/backend chooses once per model). Each of these says
so in one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_DIR = Path(__file__).parent


def _sources() -> list[Path]:
    return sorted(_DIR.glob("*.c"))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtool" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags as Linux lists them ("" where /proc/cpuinfo is not there)."""
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


def native_flags() -> list[str]:
    """The flag that targets this CPU: x86's -march=native, ARM's -mcpu=native."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64") or machine.startswith("arm"):
        return ["-mcpu=native"]
    return []


def _target(cc: str, portable: bool) -> bytes | None:
    """What a build depends on besides the sources: the compiler's version and the CPU
    features it targets (the flags Linux lists, else the compiler's predefined macros for the
    native target, which name them on any system). None: the compiler does not run."""
    flags = [] if portable else native_flags()
    features = _cpu_flags().encode()
    cmd = [cc, "--version"] if features else [cc, *flags, "-dM", "-E", "-x", "c", os.devnull]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout + features + platform.machine().encode() + bytes([portable])


def build(cc: str, portable: bool = False) -> Path | None:
    """The shared object for this source, compiler and CPU, built if not yet in the cache;
    `portable` leaves out the native flag (the plain C path, which tests compare with)."""
    return _build(cc, portable)[0]


def _build(cc: str, portable: bool) -> tuple[Path | None, str]:
    """(the shared object, "") or (None, why it could not be built)."""
    srcs = _sources()
    src = b"".join(p.read_bytes() for p in [*srcs, *sorted(_DIR.glob("*.h"))])
    target = _target(cc, portable)
    if target is None:
        return None, f"{cc} does not run"
    key = hashlib.sha256(src + target).hexdigest()[:16]
    out = _cache_dir() / f"kvtool-cpu-{key}.so"
    if out.exists():
        return out, ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        flags = ["-O3", "-fPIC", "-shared", "-pthread", "-std=c11"] + ([] if portable else native_flags())
        cmd = [cc, *flags, "-o", tmp, *map(str, srcs), "-lm"]
        r = subprocess.run(cmd, capture_output=True, timeout=300)
        if r.returncode != 0:
            os.unlink(tmp)
            return None, _first_error(r.stderr.decode(errors="replace")) or f"{cc} exited {r.returncode}"
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    except (OSError, subprocess.SubprocessError) as e:
        return None, str(getattr(e, "strerror", None) or e)
    return out, ""


def _first_error(output: str) -> str:
    """The compiler's first error line, for a one-line warning."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower()]
    return (errors or lines or [""])[0][:200]


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
        lib.kvq_pair_format.argtypes = [ctypes.c_int]
        lib.kvq_pair_format.restype = ctypes.c_int
        lib.kvq_matmul_w.argtypes = [ctypes.c_void_p, ptr, i64, i64, ptr]
        lib.kvq_matmul_w.restype = ctypes.c_int
        lib.kvq_matmul_norm.argtypes = [ctypes.c_void_p, ptr, i64, i64, ptr, ptr, ctypes.c_float]
        lib.kvq_matmul_norm.restype = ctypes.c_int
        lib.kvq_ffn_glu.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_float, ptr]
        lib.kvq_ffn_glu.restype = ctypes.c_int
        lib.kvr_rope_store.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64]
        lib.kvr_rope_store.argtypes += [
            ctypes.c_int,
            ctypes.c_float,
            ptr,
            i64,
            ptr,
            i64,
            ctypes.c_int,
            ctypes.c_int,
            i64,
            i64,
            ptr,
        ]
        lib.kvr_rope_store.restype = ctypes.c_int
        lib.kvb_quantize_row.argtypes = [ctypes.c_int, ptr, i64, ptr]
        lib.kvb_quantize_row.restype = ctypes.c_int
        lib.kvl_layers.argtypes = [ptr, ptr, i64, ptr, i64, ptr, i64]
        lib.kvl_layers.restype = ctypes.c_int
        lib.kvq_set_threads.argtypes = [ctypes.c_int]
        lib.kvq_set_threads.restype = ctypes.c_int
        lib.kvq_simd.argtypes = []
        lib.kvq_simd.restype = ctypes.c_char_p
        lib.kvg_guard.argtypes = [ptr, i64]
        lib.kvg_guard.restype = ctypes.c_int
        lib.kvg_unguard.argtypes = [ptr]
        lib.kvg_unguard.restype = None
        lib.kvg_faults.argtypes = [ptr]
        lib.kvg_faults.restype = i64
    except AttributeError:  # a library of other sources: a function is missing
        return None
    lib.kvq_set_threads(torch.get_num_threads())
    return lib


_FALLBACK = "quantized matmuls run on torch's int4 kernel and attention on torch's (slower)"


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The kernels built for this machine, or None where they cannot be (with a warning that
    says why and what runs instead)."""
    cc = _compiler()
    if cc is None:
        warnings.warn(f"no C compiler ($CC, cc, gcc, clang) for the CPU kernels: {_FALLBACK}", stacklevel=2)
        return None
    path, why = _build(cc, portable=False)
    if path is None and native_flags():
        path, why_portable = _build(cc, portable=True)
        if path is not None:
            flag = " ".join(native_flags())
            warnings.warn(f"CPU kernels built without {flag} ({why}): the portable C code runs", stacklevel=2)
        else:
            why = why_portable
    if path is None:
        warnings.warn(f"the CPU kernels did not build ({why}): {_FALLBACK}", stacklevel=2)
        return None
    loaded = load(path)
    if loaded is None:
        warnings.warn(f"the CPU kernels in {path} did not load: {_FALLBACK}", stacklevel=2)
    return loaded


def simd() -> str:
    """The instruction set the loaded kernels compute with: "avx512-vnni", "avx2", "neon-dotprod",
    "neon" or "portable" (plain C), or "none" where they are not loaded (torch computes)."""
    c = lib()
    return "none" if c is None else c.kvq_simd().decode()


def set_threads(n: int) -> None:
    """Threads the kernels compute with (the caller's included); no-op when they are not loaded."""
    c = lib()
    if c is not None:
        c.kvq_set_threads(n)
