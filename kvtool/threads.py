"""The CPU threads decodes run on: set once by the application (llama.cpp's n_threads),
never as a side effect of loading a model or making a context."""

from __future__ import annotations

from kvtool.errors import KvtoolError

_n_threads: int | None = None  # what the application set, or torch's count when first asked


def set_n_threads(n: int | None = None) -> int:
    """Sets the threads decodes compute with (n > 0; None or 0 keeps the current number) and
    returns that number: torch's threads and the compiled kernels' pool."""
    global _n_threads
    if n is not None and n < 0:
        raise KvtoolError(f"the number of threads must be positive, got {n}")
    import torch  # here, not at import: `kvtool --help` must not load torch

    from kvtool.kernels import cpu_lib

    if n:
        _n_threads = n
        torch.set_num_threads(n)
        cpu_lib.set_threads(n)
    return compute_threads()


def compute_threads() -> int:
    """The threads heavy work uses: as set by `set_n_threads`, else torch's count when first asked
    (a model with compiled kernels keeps torch itself on one thread between ubatches)."""
    global _n_threads
    if _n_threads is None:
        import torch

        _n_threads = torch.get_num_threads()
    return _n_threads
