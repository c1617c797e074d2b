"""CUDA graphs of decode steps (llama.cpp's CUDA graphs; `GGML_CUDA_DISABLE_GRAPHS=1` turns
them off there and here).

A decode step of a small model on a GPU is a few hundred short kernels, and launching them one
by one from Python costs more than running them. A context on CUDA captures a step's
`compute` (kvtool/models/inputs.py) once per shape and replays it: a step's inputs (token ids,
positions, the cache rows and cell metadata its memory builds) are copied into the tensors the
graph was captured with, and the graph runs them all in one launch.

A step is keyed by everything its work depends on besides those tensors' values: the model's
key (rows, RoPE table lengths) and the memory's (streams, attended cells, window). A
key is captured the second time it is seen (the first runs op by op, as a warm-up), only for
ubatches of up to MAX_ROWS rows that are all outputs (decode steps); prompts run op by op. The
first two replays of each graph are checked against op-by-op compute (recomputing a step only
rewrites the same K/V rows): a graph that disagrees turns graphs off for the context, with a
warning, and decoding goes on op by op.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

if TYPE_CHECKING:
    from kvtool.batch import UBatch
    from kvtool.memory.base import LayerView, MemoryContext
    from kvtool.model import Model
    from kvtool.models.inputs import ForwardInputs

MAX_ROWS = 64  # ubatches of more rows (prompts) are computed op by op
MAX_GRAPHS = 32  # graphs kept per context, least recently used dropped
N_CHECKED = 2  # replays of each graph checked against op-by-op compute
_TOLERANCE = 1e-3  # of the largest logit: the same kernels on the same data, up to GEMM order


def enabled(device: torch.device, wanted: bool) -> bool:
    """Whether a context on `device` captures decode steps."""
    return wanted and device.type == "cuda" and os.environ.get("GGML_CUDA_DISABLE_GRAPHS", "") in ("", "0")


class Graph(Protocol):
    """A captured computation: `replay()` reruns it on whatever its inputs hold now."""

    def replay(self) -> torch.Tensor: ...


class CudaGraph:
    """`fn` captured in a CUDA graph after one warm-up run on a side stream (torch's recipe).

    The graphs of one context share a memory pool (`shared["pool"]`): they never run at once
    and every replay's output is copied out before the next, so one step's worth of memory
    serves them all (a Gemma 3 step of 64 rows holds 67 MB of logits alone)."""

    def __init__(self, fn: Callable[[], torch.Tensor], shared: dict[str, Any]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # lazy initialisations (cuBLAS workspaces, Triton modules) happen outside capture
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        pool = shared.setdefault("pool", torch.cuda.graph_pool_handle())
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


# captures a closure (CudaGraph); the dict is the context's, shared by all of its captures
Capture: TypeAlias = Callable[[Callable[[], torch.Tensor], dict[str, Any]], Graph]


class _Captured:
    """One graph with the tensors it reads: the step's inputs it was captured with (kept
    alive here: the graph reads their memory) and the closure's views of the memory."""

    def __init__(self, graph: Graph, inputs: list[torch.Tensor]) -> None:
        self.graph = graph
        self.inputs = inputs
        self.checked = 0

    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        for dst, src in zip(self.inputs, inputs, strict=True):
            if dst is not src:
                dst.copy_(src)
        return self.graph.replay()


class _Views:
    """A memory context's layer views as the capture saw them: a graph's closure must not
    depend on the context object living on (its ubatch is done once the batch moves on)."""

    def __init__(self, mctx: MemoryContext) -> None:
        self.mctx = mctx
        self.views: dict[int, LayerView] = {}
        self.ubatch = mctx.ubatch

    def layer_view(self, il: int) -> LayerView:
        v = self.views.get(il)
        if v is None:
            v = self.views[il] = self.mctx.layer_view(il)
        return v


class DecodeGraphs:
    """A context's captured decode steps (see the module's docstring)."""

    def __init__(self, model: Model, capture: Capture | None = None) -> None:
        self.model = model
        self.capture = capture or CudaGraph
        self.shared: dict[str, Any] = {}  # what the captures share (CudaGraph: a memory pool)
        self.graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self.seen: set[Hashable] = set()
        self.on = True
        self.n_captured = 0
        self.n_replayed = 0

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """`model.forward(ub, mctx)`, from a graph where the step has one."""
        inp = self.model.inputs(ub) if self.on and ub.n_tokens <= MAX_ROWS and ub.output.all() else None
        if inp is None:
            return self.model.forward(ub, mctx)
        mem = mctx.graph_inputs() if inp.key is not None else None
        if mem is None:
            return self.model.compute(inp, ub, mctx)
        key = (inp.key, mem[0])
        tensors = inp.tensors() + mem[1]
        g = self.graphs.get(key)
        if g is not None and [t.shape for t in g.inputs] == [t.shape for t in tensors]:
            self.graphs.move_to_end(key)
            return self._replay(g, tensors, inp, ub, mctx)
        if key not in self.seen:  # first sight: op by op, which also warms the kernels up
            self.seen.add(key)
            return self.model.compute(inp, ub, mctx)
        return self._capture(key, inp, mem[1], ub, mctx)

    def _capture(
        self, key: Hashable, inp: ForwardInputs, mem: list[torch.Tensor], ub: UBatch, mctx: MemoryContext
    ) -> torch.Tensor:
        own = [t.clone() for t in inp.tensors()]  # may be views of the ubatch's arrays or tables
        static, views = inp.with_tensors(own), _Views(mctx)
        try:
            graph = self.capture(lambda: self.model.compute(static, views.ubatch, views), self.shared)  # type: ignore[arg-type]
        except Exception as e:
            self._off(f"capturing a decode step failed ({(str(e).splitlines() or [type(e).__name__])[0]})")
            return self.model.compute(inp, ub, mctx)
        g = _Captured(graph, own + mem)
        self.graphs[key] = g
        self.n_captured += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return self._replay(g, own + mem, inp, ub, mctx)

    def _replay(
        self, g: _Captured, tensors: list[torch.Tensor], inp: ForwardInputs, ub: UBatch, mctx: MemoryContext
    ) -> torch.Tensor:
        out = g.replay(tensors)
        self.n_replayed += 1
        if g.checked < N_CHECKED:
            g.checked += 1
            want = self.model.compute(inp, ub, mctx)  # rewrites the same K/V rows
            err = float((out - want).abs().max()) if out.shape == want.shape else float("inf")
            if not err <= _TOLERANCE * max(1.0, float(want.abs().max())):
                self._off(f"a replayed decode step differs from op-by-op compute by {err:.3g}")
                return want
        return out

    def _off(self, why: str) -> None:
        warnings.warn(f"{why}: decoding without CUDA graphs", stacklevel=3)
        self.on = False
        self.graphs.clear()
