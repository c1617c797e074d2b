"""Hybrid memory (llama.cpp's llama_memory_hybrid): a KV cache for the attention layers and a
recurrent memory for the state-space (Mamba-2, short-convolution) layers of one model.

Both parts see every operation, planned on both before either changes (the Composite), so a
partial `seq_rm` that the recurrent part refuses (it cannot cut a state back without rollback
snapshots) leaves the KV cache untouched too, and a range before the state's last position,
which the recurrent part ignores (llama.cpp), is refused rather than cut from the KV cache
alone. A recurrent state is copied whole and replaces
the destination's, so a hybrid `seq_cp` does the same in the KV cache: the range must hold all
of the source, and the destination's cells go first. Positions are those both parts still hold:
seq_pos_min = max of the parts' minimums, seq_pos_max = min of their maximums. Batches are cut
with the stricter split of the two (split KV streams need sequential sequence sets, recurrent
states equal-length ones). State files hold both parts and load all or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtool.memory.base import Commit, MemoryPart, MemoryRefused, MemoryStatus, SeqCp, SeqOp, SeqRm, pos_range
from kvtool.memory.composite import Composite, CompositeContext
from kvtool.memory.swa_kv_cache import SWAKVCache

if TYPE_CHECKING:
    from kvtool.batch import Split, UBatch
    from kvtool.memory.recurrent import RecurrentSpec
    from kvtool.memory.sizes import MemoryBreakdown
    from kvtool.memory.spec import KVSpec, MemoryParams


class SWAKVPart(SWAKVCache):
    """A sliding-window KV pair as the attention part of a hybrid: planned and stepped as one
    part over the hybrid's split of the batch."""

    @property
    def split(self) -> Split:
        return max(p.split for p in self.parts.values())

    def prepare(self, ubatches: list[UBatch]) -> object | None:
        plans = [p.prepare(ubatches) for p in self.parts.values()]
        return None if any(plan is None for plan in plans) else plans

    def context(self, ubatches: list[UBatch], plan: object) -> CompositeContext:
        assert isinstance(plan, list)
        ctxs = {name: p.context(ubatches, pl) for (name, p), pl in zip(self.parts.items(), plan, strict=True)}
        return CompositeContext(ctxs, self._route, MemoryStatus.SUCCESS)


class HybridMemory(Composite):
    """Parts "recurrent" then "attn": the recurrent part is asked first, as llama.cpp does (its
    refusals are the usual ones); cells in use are the attention part's."""

    kind = "hybrid"

    def __init__(self, attn: MemoryPart, recurrent: MemoryPart) -> None:
        super().__init__({"recurrent": recurrent, "attn": attn})
        self.attn = attn
        self.recurrent = recurrent

    def n_used(self) -> int:
        return self.attn.n_used()

    def plan(self, op: SeqOp) -> Commit:
        if isinstance(op, SeqCp) and op.src != op.dst:
            return self._plan_cp(op)
        if isinstance(op, SeqRm) and op.seq_id >= 0:
            self._check_rm(op)
        return super().plan(op)

    def _check_rm(self, op: SeqRm) -> None:
        """A recurrent memory takes a range before its state's last position as removing
        nothing (llama.cpp), but the attention part would remove those cells: refused, so the
        two parts keep holding the same tokens."""
        lo, hi = pos_range(op.p0, op.p1)
        if not lo < hi <= self.recurrent.seq_pos_max(op.seq_id):  # -1 for an unknown sequence
            return
        a0, a1 = self.attn.seq_pos_min(op.seq_id), self.attn.seq_pos_max(op.seq_id)
        if a1 >= 0 and lo <= a1 and hi > a0:
            raise MemoryRefused(
                f"hybrid memory: positions [{lo}, {hi}) of sequence {op.seq_id} cannot be removed"
            )

    def _plan_cp(self, op: SeqCp) -> Commit:
        """dst becomes a copy of all of src, in both parts. A recurrent state is copied whole
        and replaces dst's, so the attention part must do the same: a range that leaves out
        some of src's cells is refused, and dst's own cells go first (in one stream they
        would otherwise stay beside src's)."""
        rec = self.recurrent.plan(op)
        lo, hi = pos_range(op.p0, op.p1)
        p_min, p_max = self.attn.seq_pos_min(op.src), self.attn.seq_pos_max(op.src)
        if p_max >= 0 and not lo <= p_min <= p_max < hi:
            raise MemoryRefused(
                f"a hybrid memory copies whole sequences: [{lo}, {hi}) cuts sequence {op.src}"
            )
        rm = self.attn.plan(SeqRm(op.dst, -1, -1))
        cp = self.attn.plan(SeqCp(op.src, op.dst, -1, -1))

        def run() -> None:
            rec()
            rm()
            cp()

        return run


@dataclass(frozen=True)
class HybridSpec:
    """The attention layers (a KVSpec) and the recurrent layers (a RecurrentSpec) of a model."""

    attn: KVSpec
    recurrent: RecurrentSpec

    def build(self, params: MemoryParams) -> HybridMemory:
        attn = self.attn.build(params)
        part: MemoryPart = SWAKVPart(attn.base, attn.swa) if isinstance(attn, SWAKVCache) else attn
        return HybridMemory(part, self.recurrent.build(params))

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        # the parts in HybridMemory's order and names
        return self.recurrent.memory_breakdown(params).named("recurrent") + self.attn.memory_breakdown(
            params
        ).named("attn")
