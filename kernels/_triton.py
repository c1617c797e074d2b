"""The one place that knows how Triton is found: the optional import, the jit shim, the dispatch.

Triton is in the gpu/test extras only; every kernel has a torch reference that runs without it.
"""

from __future__ import annotations

import os

import torch


def _wanted() -> bool:
    """Triton is imported only where a kernel can run in it: a CUDA device, or its interpreter
    (TRITON_INTERPRET=1, the tests); `load()` imports it anyway (a compile ahead of time for a
    GPU). Elsewhere the import would only cost startup (~0.3 s)."""
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


try:
    if not _wanted():
        raise ImportError("no device runs Triton here")
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# Kernel modules define their kernels with `@jit` whether or not triton is there: with postponed
# annotations `tl.constexpr` is only a string, so an undecorated kernel is never touched.
jit = triton.jit if triton is not None else (lambda fn: fn)


def load() -> None:
    """Imports Triton where no kernel can run in it (compiling the kernels for a GPU on a machine
    without one): call it before importing a kernel module, whose `@jit` then makes Triton
    kernels."""
    global triton, tl, jit
    import triton as triton_module
    import triton.language as tl_module

    triton, tl, jit = triton_module, tl_module, triton_module.jit


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a kernel runs in Triton for these operands: triton is installed and all are on CUDA.

    Everywhere else (CPU, MPS, ...) the torch reference runs; the interpreter is for tests only.
    """
    return triton is not None and all(t.is_cuda for t in tensors)


def _squeeze_scalar_index() -> None:
    """Let Triton 3.6's interpreter use runtime scalars as Python ints under NumPy >= 2.4.

    The interpreter holds a scalar as a one-element array and its `tensor.__index__` calls
    `int()` on it, which NumPy 2.4 refuses; so `range(start, n_kv, BLOCK)` over any kernel
    argument fails (triton-lang/triton#9171). Triton 3.8 squeezes the array first; this
    installs that same `__index__` on the versions before it. Compiled kernels are unaffected.
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


if triton is not None and triton.knobs.runtime.interpret and _version(triton.__version__) < (3, 8):
    _squeeze_scalar_index()
