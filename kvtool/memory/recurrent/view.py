"""What a recurrent layer's state is made of (RSLayerSpec) and what it computes with for one
ubatch (RSView): the types models, memories and their contexts share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RSLayerSpec:
    """The per-sequence state of one recurrent layer (without the sequence dimension)."""

    conv_shape: tuple[int, ...]  # Mamba: (d_conv - 1, channels); RWKV: token shift (2, n_embd)
    ssm_shape: tuple[int, ...]  # Mamba: (d_inner, d_state); Mamba-2: (n_head, head_dim, d_state)

    def numel(self) -> int:
        n_conv = n_ssm = 1
        for d in self.conv_shape:
            n_conv *= d
        for d in self.ssm_shape:
            n_ssm *= d
        return n_conv + n_ssm


@dataclass
class RSView:
    """What a recurrent layer computes with for the current ubatch (sequence b = block b).

    `conv`/`ssm` are the states before the ubatch (zeros for a sequence with no state yet).
    `store` takes the states after it: `[n_seqs, *shape]` when `n_states == 1`, otherwise
    `[n_seqs, n_states, *shape]`, the states after each of the ubatch's trailing `n_states`
    tokens of each sequence, oldest first (the memory keeps them as rollback snapshots)."""

    conv: torch.Tensor  # [n_seqs, *conv_shape] f32
    ssm: torch.Tensor  # [n_seqs, *ssm_shape] f32
    n_states: int = 1
    sink: Callable[[torch.Tensor, torch.Tensor], None] = field(default=lambda c, s: None, repr=False)

    def store(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Writes the states after the ubatch (see the class docstring for the shapes)."""
        self.sink(conv, ssm)
