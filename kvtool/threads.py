"""The CPU threads decodes run on: set once by the application (llama.cpp's n_threads),
never as a side effect of loading a model or making a context."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvtool.errors import KvtoolError


def set_n_threads(n: int | None = None) -> int:
    """Sets the threads torch computes with (n > 0; None or 0 keeps the current number) and
    returns the number now in use."""
    if n is not None and n < 0:
        raise KvtoolError(f"the number of threads must be positive, got {n}")
    import torch  # here, not at import: `kvtool --help` must not load torch

    from kvtool.kernels import cpu_lib

    if n:
        torch.set_num_threads(n)
        cpu_lib.set_threads(n)
    return torch.get_num_threads()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch computes on `n` threads inside the block, as before it after. A decode of a few
    rows gives its matmuls to the compiled kernel's own threads (kernels/qmatmul.c): torch's
    other ops are too small to share, and its idle workers would only spin against them."""
    import torch

    prev = torch.get_num_threads()
    if n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
