"""The CPU threads decodes run on: set once by the application (llama.cpp's n_threads),
never as a side effect of loading a model or making a context."""

from __future__ import annotations

from kvtool.errors import KvtoolError

MAX_THREADS = 512  # GGML_MAX_N_THREADS: OpenMP aborts or crashes with tens of thousands

_n_threads: int | None = None  # what the application set, or torch's count when first asked
_n_threads_batch: int | None = None  # for ubatches of many rows (prompts); None: as _n_threads


def set_n_threads(n: int | None = None, n_batch: int | None = None) -> int:
    """Sets the threads decodes compute with (0 < n <= MAX_THREADS; None or 0 keeps the current
    number) and returns that number: torch's threads and the compiled kernels' pool. `n_batch`
    sets those that ubatches of many rows (prompts) compute with, as llama_set_n_threads'
    n_threads_batch (llama.cpp's -tb); by default they are the same."""
    global _n_threads, _n_threads_batch
    for value in (n, n_batch):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"the number of threads is an int, got {type(value).__name__}")
        if value is not None and not 0 <= value <= MAX_THREADS:
            raise KvtoolError(f"the number of threads must be in [1, {MAX_THREADS}], got {value}")
    if n_batch:
        _n_threads_batch = n_batch
    import torch  # here, not at import: `kvtool --help` must not load torch

    from kvtool.kernels import cpu_lib

    if n:
        _n_threads = n
        torch.set_num_threads(n)
        cpu_lib.set_threads(n)
    return compute_threads()


def compute_threads(batch: bool = False) -> int:
    """The threads heavy work uses: as set by `set_n_threads`, else torch's count when first asked
    (a model with compiled kernels keeps torch itself on one thread between ubatches); `batch`:
    those of a ubatch of many rows."""
    global _n_threads
    if batch and _n_threads_batch is not None:
        return _n_threads_batch
    if _n_threads is None:
        import torch

        _n_threads = torch.get_num_threads()
    return _n_threads
