"""A ubatch's inputs on the model's device (llama.cpp's graph inputs, `llm_graph_input_*`).

An attention model's forward splits in two: `inputs(ub)` copies what the forward reads of the
ubatch to the device (token ids, positions) and makes the RoPE tables cover the positions;
`compute(inp, ub, mctx)` is device work only, reading the ubatch's data through `inp` and the
memory's views. That is what lets a CUDA graph (kvtool/graphs.py) replay `compute` on a later
ubatch once that ubatch's inputs are copied into the captured tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from kvtool.batch import UBatch
from kvtool.models.rope import RopeParams, position_bounds


@dataclass(frozen=True)
class ForwardInputs:
    token: torch.Tensor  # [n] token ids on the device
    pos: torch.Tensor  # [n] positions on the device
    bounds: tuple[int, int]  # the smallest and largest position, known on the host
    # what else `compute` depends on beyond the tensors' shapes, for ubatches whose rows are
    # all outputs (the only ones captured): the row count and the RoPE tables' lengths (a
    # grown table is a new tensor); None: positions off the tables
    key: Hashable | None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that change from one ubatch to the next."""
        return [self.token, self.pos]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> ForwardInputs:
        """These inputs reading `tensors` (as `tensors()` lists them) instead."""
        token, pos = tensors
        return replace(self, token=token, pos=pos)


def forward_inputs(ub: UBatch, device: torch.device, ropes: Sequence[RopeParams]) -> ForwardInputs:
    """The ubatch's token ids and positions on `device`, every table of `ropes` covering them."""
    token = torch.from_numpy(ub.token).to(device)
    pos = torch.from_numpy(ub.pos).to(device)
    bounds = position_bounds(ub.pos)
    sizes = [r.reserve(bounds, pos.device) for r in ropes]  # pos.device: with its index
    key = None if None in sizes else (ub.n_tokens, *sizes)
    return ForwardInputs(token, pos, bounds, key)
