"""Context checkpoints (llama-server's --ctx-checkpoints): a slot whose memory cannot be cut back
to any position (a sliding-window cache forgets old positions, a recurrent state holds only its
latest one) keeps its sequence's state at chosen prompt positions, so a later prompt that shares
a prefix resumes from the nearest checkpoint at or before the point where it differs instead of
from zero. A checkpoint is the sequence's state in kvtool's state format (Context.state_seq_*):
the same bytes a slot save writes, so a memory of any kind round-trips exactly.

Where: `n_tail` tokens before the end of each prompt (llama-server's offset of 4: a regenerated
or edited last turn shares everything before the chat template's closing tokens), and every
`min_step` tokens inside a long prompt. How many: at most `n_max` per slot, the oldest dropped
first. Memories that can be cut back anywhere (attention-only) need none and get none."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import kvtool
from kvtool.common.prefix import common_prefix


@dataclass
class CheckpointParams:
    """llama-server's -ctxcp/--ctx-checkpoints and -cms/--checkpoint-min-step."""

    n_max: int = 32  # checkpoints per slot (0: none)
    min_step: int = 8192  # tokens between two mid-prompt checkpoints (0: only the end-of-prompt one)
    n_tail: int = 4  # the end-of-prompt checkpoint holds all but this many prompt tokens


@dataclass(frozen=True)
class Checkpoint:
    """The state of a sequence holding the first `n_tokens` tokens of a prompt."""

    n_tokens: int
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def needs_checkpoints(ctx: kvtool.Context) -> bool:
    """Whether some part of the memory cannot be cut back to any position: a sliding window
    (unless it is full size) or a recurrent state."""
    kinds = {p.kind for p in ctx.memory_breakdown().parts}
    return "recurrent" in kinds or ("sliding_window" in kinds and not ctx.params.swa_full)


@dataclass
class SlotCheckpoints:
    """One slot's checkpoints, in order of position, and the tokens they are prefixes of."""

    params: CheckpointParams
    tokens: list[int] = field(default_factory=list)
    items: list[Checkpoint] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.items)

    def clear(self) -> None:
        self.tokens, self.items = [], []

    def put(self, tokens: Sequence[int], items: Sequence[Checkpoint]) -> None:
        """Takes checkpoints of `tokens` restored from a state (the most recent that fit)."""
        n = self.params.n_max
        self.tokens = list(tokens)
        self.items = list(items[len(items) - n :]) if n > 0 else []

    def load(self, ctx: kvtool.Context, seq: int, tokens: Sequence[int], n_max: int, n_min: int = 0) -> int:
        """Loads into `seq` the latest checkpoint holding a prefix of `tokens` no longer than
        `n_max` and longer than `n_min`; its length, or 0 (`seq` as it was) when there is none
        or the memory has no room for it."""
        cp = self.nearest(tokens, n_max)
        if cp is None or cp.n_tokens <= n_min:
            return 0
        try:
            ctx.state_seq_set_data(cp.data, seq)
        except kvtool.StateError:
            return 0
        return cp.n_tokens

    def rewind(self, ctx: kvtool.Context, seq: int, tokens: Sequence[int], held: Sequence[int]) -> list[int]:
        """Before kvtool.resume_seq: when `seq` (holding `held`) cannot be cut back to its common
        prefix with `tokens`, loads the nearest checkpoint; returns what `seq` then holds."""
        keep = min(common_prefix(held, tokens), len(tokens) - 1, ctx.memory.seq_pos_max(seq) + 1)
        if keep == 0 or ctx.can_resume(seq, keep):
            return list(held)
        n = self.load(ctx, seq, tokens, keep)
        return list(tokens[:n]) if n else list(held)

    def nearest(self, tokens: Sequence[int], n: int) -> Checkpoint | None:
        """The latest checkpoint holding a prefix of `tokens` no longer than `n`."""
        n = min(n, common_prefix(self.tokens, tokens))
        return next((c for c in reversed(self.items) if c.n_tokens <= n), None)

    def start(self, tokens: Sequence[int]) -> None:
        """The slot starts a prompt: checkpoints that are no prefix of it are dropped."""
        n = common_prefix(self.tokens, tokens)
        self.items = [c for c in self.items if c.n_tokens <= n]
        self.tokens = list(tokens)

    def next_stop(self, n_past: int) -> int:
        """The next position after `n_past` where a checkpoint is due (-1: none before the
        prompt's end)."""
        p = self.params
        if p.n_max <= 0:
            return -1
        stops = [len(self.tokens) - p.n_tail]
        if p.min_step > 0:
            stops.append((n_past // p.min_step + 1) * p.min_step)
        due = [s for s in stops if n_past < s <= len(self.tokens) - p.n_tail]
        return min(due, default=-1)

    def due(self, n_past: int) -> bool:
        """Whether a checkpoint is due with `n_past` prompt tokens decoded and more to go."""
        p = self.params
        if p.n_max <= 0 or n_past <= 0 or n_past > len(self.tokens) - p.n_tail:
            return False
        if any(c.n_tokens == n_past for c in self.items):
            return False
        return n_past == len(self.tokens) - p.n_tail or (p.min_step > 0 and n_past % p.min_step == 0)

    def add(self, ctx: kvtool.Context, seq: int, n_past: int) -> Checkpoint:
        """Keeps the state of `seq`, which holds the first `n_past` prompt tokens."""
        cp = Checkpoint(n_past, ctx.state_seq_get_data(seq))
        before = [c for c in self.items if c.n_tokens < n_past]
        self.items = [*before[max(0, len(before) - self.params.n_max + 1) :], cp]
        return cp
