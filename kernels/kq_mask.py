"""llama.cpp's KQ mask: which keys each query of a ubatch sees, as a dense additive mask (0 where
a query sees a key, -inf where it does not) prepared once for every layer that attends with it.
The torch attention (kernels/attention_ref.py) reads it; the Triton kernel reads it or, on CUDA,
the cell metadata it is built from (kernels/visibility.py)."""

from __future__ import annotations

import torch


class KQMask:
    """A dense visibility mask prepared once for every layer that attends with it (one ubatch).

    `mask` [n_stream, n_q, n_kv] is additive: 0 where a query sees a key, -inf where it does
    not. The rows that see no key are found here, once, not per layer (a host sync each), and
    the grouped-query layout `attention_ref` computes with is built once per group size.
    """

    def __init__(self, mask: torch.Tensor, *, find_empty: bool = True) -> None:
        """`find_empty=False`: the caller knows that every row sees a key (nothing to look for)."""
        self.mask = mask
        self.empty: torch.Tensor | None = None  # [S, n_q, 1] bool, None: every row sees a key
        if find_empty:
            empty = torch.isneginf(mask).all(dim=-1, keepdim=True)
            self.empty = empty if bool(empty.any()) else None
        bias = mask if self.empty is None else mask.masked_fill(self.empty, 0.0)
        self._bias = bias.float()  # [S, n_q, n_kv]: a row that sees nothing is zeroed out after
        self._grouped: dict[int, torch.Tensor] = {}
        self._blocks: dict[int, list[tuple[int, int, int, int, KQMask]]] = {}

    def blocks(self, rows: int) -> list[tuple[int, int, int, int, KQMask]]:
        """(q0, q1, k0, k1, mask) per block of `rows` query rows: the keys [k0, k1) that some row
        of the block sees in some stream, and the block's mask over them; blocks that see no key
        are left out (their rows give zeros). Built once per ubatch and block size, on first use."""
        blocks = self._blocks.get(rows)
        if blocks is None:
            n_q = self.mask.shape[1]
            seen = ~torch.isneginf(self.mask)  # [S, n_q, n_kv]
            blocks = self._blocks[rows] = []
            for q0 in range(0, n_q, rows):
                q1 = min(q0 + rows, n_q)
                keys = torch.nonzero(seen[:, q0:q1].any(dim=1).any(dim=0)).flatten()
                if keys.numel():
                    k0, k1 = int(keys[0]), int(keys[-1]) + 1
                    part = self.mask[:, q0:q1, k0:k1]
                    blocks.append((q0, q1, k0, k1, KQMask(part, find_empty=self.empty is not None)))
        return blocks

    def grouped(self, group: int) -> torch.Tensor:
        """[S, 1, group * n_q, n_kv]: the mask of the rows `attention_ref` gives one KV head,
        row i * n_q + j being query j with the i-th head of the group."""
        m = self._grouped.get(group)
        if m is None:
            S, n_q, n_kv = self._bias.shape
            m = self._bias.unsqueeze(1)  # [S, 1, n_q, n_kv]
            if n_q > 1 and group > 1:  # one query: its row broadcasts over the group's heads
                m = m.expand(S, group, n_q, n_kv).reshape(S, 1, group * n_q, n_kv)
            self._grouped[group] = m
        return m


def as_kq_mask(mask: torch.Tensor | KQMask) -> KQMask:
    """`mask` prepared (a KQMask is returned as it is)."""
    return mask if isinstance(mask, KQMask) else KQMask(mask)
