"""The scheduler's slots: what each holds, which idle one takes a request (llama-server's slot
choice by prompt similarity), and why a request re-processed a prefix some slot held (the reasons
of the KV ledger, kvtool.common.stats.REPROCESS_REASONS)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtool.common.checkpoints import CheckpointParams, SlotCheckpoints
from kvtool.common.prefix import PrefixSource, common_prefix
from kvtool.common.task import Request, Task


@dataclass
class Slot:
    """One sequence of the context and the request it serves."""

    id: int
    seq: int
    held: list[int] = field(default_factory=list)  # what the memory holds at positions 0..
    lost: list[int] = field(default_factory=list)  # what it held before its cells were taken back
    task: Task | None = None
    last: Task | None = None  # the task it served before
    source: PrefixSource | None = None  # where the first n_source held tokens came from
    n_source: int = 0
    pending: list[int] = field(default_factory=list)  # prompt tokens still to decode
    sampled: int = -1  # the answer token to decode next
    n_past: int = 0  # the position the next token takes
    keeps: bool = False  # the idle slot holds a cached prompt (cache_prompt)
    t_last_used: float = 0.0
    checkpoints: SlotCheckpoints = field(default_factory=lambda: SlotCheckpoints(CheckpointParams(n_max=0)))

    @property
    def busy(self) -> bool:
        return self.task is not None


def choose_slot(slots: Sequence[Slot], req: Request, similarity: float) -> Slot | None:
    """llama-server's get_available_slot: the named slot, else the idle slot sharing the largest
    part of the prompt (above `similarity`, -sps), else the least recently used idle one."""
    if req.id_slot >= 0:
        slot = slots[req.id_slot]
        return slot if not slot.busy else None
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    if similarity > 0 and req.cache_prompt:
        sims = [(common_prefix(s.held, req.tokens) / len(req.tokens), -s.t_last_used, s) for s in idle]
        sim, _, best = max(sims, key=lambda x: (x[0], x[1]))
        if sim > similarity:
            return best
    return min(idle, key=lambda s: s.t_last_used)


def reprocess_reason(
    slots: Sequence[Slot],
    slot: Slot,
    req: Request,
    keep: int,
    lcp: int,
    n_mem: int,
    truncatable: bool,
    from_cp: bool = False,
) -> tuple[str, int] | None:
    """Why `slot` kept only `keep` tokens of `req`'s prompt when some slot held (or had held, before
    its cells were taken back) a longer prefix, and how many tokens more; None when none did.
    `lcp`: the prefix `slot` held; `n_mem`: what its memory still had; `truncatable`: whether the
    memory could be cut back to it; `from_cp`: whether `keep` came from a context checkpoint."""
    cap = len(req.tokens) - 1
    held = [(min(common_prefix(s.held, req.tokens), cap), s, False) for s in slots if s is not slot]
    lost = [(min(common_prefix(s.lost, req.tokens), cap), s, True) for s in slots]
    best, holder, was_lost = max([(min(lcp, cap), slot, False), *held, *lost], key=lambda x: x[0])
    if best <= keep:
        return None
    if was_lost:
        reason = "evicted"
    elif not req.cache_prompt:
        reason = "cache_prompt_off"
    elif holder is not slot and holder.busy:
        reason = "slot_busy"
    elif holder is not slot:
        reason = "id_slot" if req.id_slot >= 0 else "below_similarity"
    elif from_cp:
        reason = "checkpoint_too_far_back"
    elif not truncatable:
        reason = "cannot_truncate"
    else:  # the slot's own prefix, lost from the memory
        reason = "evicted" if n_mem < lcp else "cannot_truncate"
    return reason, best - keep
