"""Captured decode steps (kvtool/graphs.py) on a machine without a GPU.

A CUDA graph runs what it captured on whatever its input tensors hold at replay. `Rerun`
stands in for it on the CPU: its replay calls the captured closure again, on the tensors the
capture saw. A step that took anything from the host or from a later ubatch except through
those tensors (a position read back, a table row chosen in Python, a view of the ubatch's
arrays) gives other logits than the op-by-op context beside it. While the closure runs, a
dispatch mode refuses every op that reads a device tensor back to the host, which a capture
cannot hold. The engine takes the CUDA attention path (visibility from cell metadata) on CPU
tensors. tests/kvtool/test_device_cuda.py runs the real graphs on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvtool
from kvtool import graphs
from kvtool.kernels import attention as attention_mod
from kvtool.kernels import store_kv as store_kv_mod
from kvtool.memory import kv_cache_context
from tests.kvtool.device_engine_checks import greedy_steps
from tests.kvtool.test_oracle_tiny import DATA

_READS_BACK = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item"}


class NoReadBack(TorchDispatchMode):
    """Fails on any op that makes the host wait for a tensor's value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        assert name not in _READS_BACK, f"a captured step reads a tensor back ({name})"
        return func(*args, **(kwargs or {}))


class Rerun:
    """CudaGraph's stand-in: the capture runs the closure once, each replay runs it again,
    refusing any read-back while it runs (`strict`)."""

    strict = True

    def __init__(self, fn: Callable[[], torch.Tensor], shared: dict[str, object]) -> None:
        self.fn = fn
        self.replay()

    def replay(self) -> torch.Tensor:
        with NoReadBack() if self.strict else contextlib.nullcontext():
            return self.fn()


class Lax(Rerun):
    """Rerun without the read-back check: for the reference attention, which reads its mask
    back on the CPU (only the Triton kernels are what a GPU runs)."""

    strict = False


@pytest.fixture
def cells_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA attention path on CPU tensors: the cache hands layers cell metadata, and
    attention and store_kv run their Triton kernels (in the interpreter, as on a GPU)."""
    monkeypatch.setattr(kv_cache_context, "visibility_from_cells", lambda device: True)
    monkeypatch.setattr(attention_mod, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(store_kv_mod, "use_triton", lambda *tensors: True)


@pytest.fixture
def rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs, "enabled", lambda device, wanted: wanted)
    monkeypatch.setattr(graphs, "CudaGraph", Rerun)


@pytest.fixture
def lax(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs re-run as `Lax`, the cells path with the reference attention (fast, no interpreter)."""
    monkeypatch.setattr(graphs, "enabled", lambda device, wanted: wanted)
    monkeypatch.setattr(graphs, "CudaGraph", Lax)
    monkeypatch.setattr(kv_cache_context, "visibility_from_cells", lambda device: True)


def _tiny(arch: str) -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf", weights="f32")


def _pair(arch: str, **params: object) -> tuple[kvtool.Context, kvtool.Context]:
    m = _tiny(arch)
    p = dict(n_ctx=1024, n_seq_max=4) | params
    return (
        kvtool.Context(m, kvtool.ContextParams(**p, cuda_graphs=True)),  # type: ignore[arg-type]
        kvtool.Context(m, kvtool.ContextParams(**p, cuda_graphs=False)),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: a sliding window, two RoPE bases
@pytest.mark.parametrize("unified", [False, True])
def test_replayed_steps_match_op_by_op(arch: str, unified: bool, cells_path: None, rerun: None) -> None:
    g, e = _pair(arch, kv_unified=unified)
    assert g.graphs is not None and e.graphs is None
    n = 0
    steps = {"rm_at": 6, "reload_at": 9}
    for got, want in zip(greedy_steps(g, 3, 5, 12, **steps), greedy_steps(e, 3, 5, 12, **steps), strict=True):
        np.testing.assert_array_equal(got, want)
        n += 1
    assert n == 13
    # one key a span of cells (split streams: 3 streams decode together): first sight op by op,
    # the second captured, then replayed; the steps after seq_rm and after a state reload keep
    # the key (same shapes)
    assert g.graphs.n_captured == 1 and g.graphs.n_replayed == 11, (g.graphs.n_captured, g.graphs.n_replayed)
    assert g.graphs.on


def test_a_new_span_of_cells_is_a_new_graph(lax: None) -> None:
    # 250 prompt tokens and 12 steps cross the 256-cell boundary: a second graph
    g, e = _pair("llama", n_ctx=512, n_seq_max=1)
    for got, want in zip(greedy_steps(g, 1, 250, 12), greedy_steps(e, 1, 250, 12), strict=True):
        np.testing.assert_array_equal(got, want)
    assert g.graphs is not None
    assert len(g.graphs.graphs) == 2 and g.graphs.n_captured == 2, list(g.graphs.graphs)
    spans = sorted(k[1][2] for k in g.graphs.graphs)  # type: ignore[index]
    assert spans == [256, 512]


def test_a_full_window_reuses_its_cells_under_one_graph(lax: None) -> None:
    # Gemma 3's sliding-window cache (256 cells, window 8) fills at position 256 and then
    # writes over cells that left the window: the cell layout changes under the same key
    g, e = _pair("gemma3", n_ctx=1024, n_seq_max=2, n_ubatch=64)  # a window cache of 256 cells
    n = 0
    for got, want in zip(greedy_steps(g, 2, 250, 20), greedy_steps(e, 2, 250, 20), strict=True):
        np.testing.assert_array_equal(got, want)
        n += 1
    assert g.graphs is not None and g.graphs.on and n == 21
    assert g.memory.parts["swa"].n_cells == 256  # type: ignore[attr-defined]
    assert g.graphs.n_replayed >= 16, (g.graphs.n_captured, g.graphs.n_replayed)


def test_prompts_and_partial_outputs_are_not_captured(lax: None) -> None:
    g, _ = _pair("llama", n_seq_max=1)
    assert g.graphs is not None
    for i in range(4):  # the same 4-row shape each time, only the last row an output
        b = kvtool.Batch()
        for j in range(4):
            b.add(j + 1, 4 * i + j, [0], j == 3)
        g.decode(b)
    prompt = kvtool.Batch()
    for j in range(graphs.MAX_ROWS + 1):
        prompt.add(j % 50, 16 + j, [0], True)
    for _ in range(3):
        g.memory.seq_rm(0, 16, -1)
        g.decode(prompt)
    assert g.graphs.n_captured == 0 and not g.graphs.seen


def test_recurrent_models_run_op_by_op(lax: None) -> None:
    m = _tiny("mamba2")
    ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=256, cuda_graphs=True))
    assert ctx.graphs is not None
    for i in range(4):
        kvtool.decode_tokens(ctx, [i + 1], 0, i)
    assert ctx.graphs.n_captured == 0 and not ctx.graphs.seen


class Wrong(Lax):
    def replay(self) -> torch.Tensor:
        return super().replay() + 1.0


class Broken:
    def __init__(self, fn: Callable[[], torch.Tensor], shared: dict[str, object]) -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


@pytest.mark.parametrize(("backend", "why"), [(Wrong, "differs from op-by-op"), (Broken, "capturing a")])
def test_a_bad_graph_turns_graphs_off(backend: type, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache_context, "visibility_from_cells", lambda device: True)
    monkeypatch.setattr(graphs, "enabled", lambda device, wanted: wanted)
    monkeypatch.setattr(graphs, "CudaGraph", backend)
    g, e = _pair("llama", n_seq_max=2)
    with pytest.warns(UserWarning, match=f"{why}.*: decoding without CUDA graphs"):
        for got, want in zip(greedy_steps(g, 2, 3, 6), greedy_steps(e, 2, 3, 6), strict=True):
            np.testing.assert_array_equal(got, want)  # the step that failed was computed op by op
    assert g.graphs is not None and not g.graphs.on and not g.graphs.graphs


def test_graphs_are_for_cuda_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS", raising=False)
    assert graphs.enabled(cuda, True) and not graphs.enabled(cuda, False) and not graphs.enabled(cpu, True)
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "1")
    assert not graphs.enabled(cuda, True)
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "0")
    assert graphs.enabled(cuda, True)
    ctx = kvtool.Context(_tiny("llama"), kvtool.ContextParams(n_ctx=256))
    assert ctx.graphs is None  # on the CPU
