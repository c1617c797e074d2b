"""Compiling Triton kernels for an H100 (sm_90) on a machine without a GPU.

The interpreter runs kernels as Python and accepts code the compiler rejects (a loop-carried
value changing type, a branch the compiler cannot lower); compiling ahead of time, with the
ptxas that Triton ships, catches that without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def compile_sm90(fn, signature: dict[str, str], constexprs: dict[str, object], **options) -> None:  # type: ignore[no-untyped-def]
    """Compiles one @triton.jit kernel for sm_90 (run it in `compile_in_subprocess`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn, signature, constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], fn.__name__


def compile_in_subprocess(module: str, function: str, cache: Path) -> None:
    """Runs `module.function()` (which compiles kernels) in a process without TRITON_INTERPRET and
    with a fresh Triton cache, so it compiles for real; `_triton.load()` imports triton there all
    the same (kernels/_triton does only where a kernel can run, else they are plain functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(cache)}
    load = "from kvtool.kernels import _triton; _triton.load()"
    code = f"{load}; from {module} import {function}; {function}()"
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
