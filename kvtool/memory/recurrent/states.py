"""The tensors of a recurrent memory: per layer the current conv/ssm state of every slot and,
with rollback, each slot's snapshots (the states after its previous positions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtool.memory.recurrent.view import RSLayerSpec

Snapshot = dict[str, dict[int, torch.Tensor]]  # tensor name -> layer -> one slot's data


class RSStates:
    """`conv`/`ssm` `[n_slot, *shape]` and `hconv`/`hssm` `[n_slot, n_rs_seq, *shape]` (most
    recent first) per layer, F32. Who reads which slot is RSCells' business."""

    def __init__(
        self, layers: dict[int, RSLayerSpec], n_slot: int, n_rs_seq: int, device: torch.device
    ) -> None:
        self.n_rs_seq = n_rs_seq

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.float32, device=device)

        n, k = n_slot, n_rs_seq
        self.t: dict[str, dict[int, torch.Tensor]] = {
            "conv": {il: zeros(n, *s.conv_shape) for il, s in layers.items()},
            "ssm": {il: zeros(n, *s.ssm_shape) for il, s in layers.items()},
            "hconv": {il: zeros(n, k, *s.conv_shape) for il, s in layers.items()},
            "hssm": {il: zeros(n, k, *s.ssm_shape) for il, s in layers.items()},
        }

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.t.values() for t in ts.values())

    def snapshot(self, slot: int) -> Snapshot:
        return {name: {il: t[slot].clone() for il, t in ts.items()} for name, ts in self.t.items()}

    def restore(self, slot: int, snap: Snapshot) -> None:
        for name, ts in self.t.items():
            for il, t in ts.items():
                t[slot].copy_(snap[name][il])

    def zero(self, slot: int) -> None:
        for name in ("conv", "ssm"):  # snapshots are only read below n_hist, which is 0 here
            for t in self.t[name].values():
                t[slot].zero_()

    def zero_all(self) -> None:
        for ts in self.t.values():
            for t in ts.values():
                t.zero_()

    def copy(self, src: int, dst: int) -> None:
        for ts in self.t.values():
            for t in ts.values():
                t[dst].copy_(t[src])

    def rollback(self, slot: int, r: int) -> None:
        """The state after r tokens fewer becomes current; older snapshots move up."""
        for name in ("conv", "ssm"):
            for il, cur in self.t[name].items():
                hist = self.t["h" + name][il]
                cur[slot].copy_(hist[slot, r - 1])
                hist[slot] = torch.cat([hist[slot, r:], torch.zeros_like(hist[slot, :r])])

    def store(
        self, il: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, n_states: int
    ) -> None:
        """Writes layer il's states after a ubatch into `slots` (see RSView.store); with
        rollback, the earlier trailing states and the replaced ones become snapshots."""
        for name, new in (("conv", conv), ("ssm", ssm)):
            cur = self.t[name][il]
            shape = cur.shape[1:]
            if new.shape[1:] == shape and n_states == 1:
                new = new.unsqueeze(1)
            want = (len(slots), n_states, *shape)
            if tuple(new.shape) != want:
                raise ValueError(f"{name} state of layer {il}: got {tuple(new.shape)}, want {want}")
            new = new.to(torch.float32)
            if self.n_rs_seq > 0:
                hist = self.t["h" + name][il]
                recent = new[:, :-1].flip(1)  # most recent first
                cand = torch.cat([recent, cur[slots].unsqueeze(1), hist[slots]], dim=1)
                hist[slots] = cand[:, : self.n_rs_seq]
            cur[slots] = new[:, -1]
