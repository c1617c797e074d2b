"""The CPU threads decodes run on: set once by the application (llama.cpp's n_threads),
never as a side effect of loading a model or making a context."""

from __future__ import annotations

from kvtool.errors import KvtoolError


def set_n_threads(n: int | None = None) -> int:
    """Sets the threads torch computes with (n > 0; None or 0 keeps the current number) and
    returns the number now in use."""
    if n is not None and n < 0:
        raise KvtoolError(f"the number of threads must be positive, got {n}")
    import torch  # here, not at import: `kvtool --help` must not load torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
