"""Batches (llama_batch), micro-batches (llama_ubatch) and the batch allocator that validates
a batch against the memory and splits it (llama_batch_allocr)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from kvtool.checks import POS_END, as_int
from kvtool.errors import KvtoolError


class DecodeError(KvtoolError):
    """A decode was refused or failed. `status` follows llama_decode's return codes:
    1 = no memory slot for the batch (retry with a smaller batch or free cells),
    -1 = invalid batch, -3 = compute failure (out of memory). A KeyboardInterrupt during a
    decode propagates as itself, after the memory was rolled back."""

    def __init__(self, message: str, status: int = -1) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Batch:
    """Tokens to decode, each with a position, the sequences it belongs to and whether its
    logits are wanted. Positions left as None are filled from the memory (all or none)."""

    tokens: list[int] = field(default_factory=list)
    pos: list[int | None] = field(default_factory=list)
    seq_ids: list[tuple[int, ...]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(
        self, token: int, pos: int | None = None, seq_ids: Sequence[int] = (0,), logits: bool = False
    ) -> None:
        """Append one token (llama.cpp's common_batch_add). A token, a position or a sequence id
        that is not an int is a TypeError; their ranges are checked when the batch is decoded."""
        if isinstance(seq_ids, str | bytes) or not isinstance(seq_ids, Sequence):
            raise TypeError(f"seq_ids must be a sequence of ints, got {type(seq_ids).__name__}")
        sids = tuple(as_int(s, "a sequence id") for s in seq_ids)
        self.tokens.append(as_int(token, "a token id"))
        self.pos.append(None if pos is None else as_int(pos, "a position"))
        self.seq_ids.append(sids)
        self.logits.append(bool(logits))

    @classmethod
    def from_tokens(
        cls,
        ids: Sequence[int],
        seq_id: int = 0,
        pos0: int | None = 0,
        logits: Literal["last", "all", "none"] = "last",
    ) -> Batch:
        """A batch of consecutive tokens of one sequence starting at `pos0`
        (None: continue after the sequence's last position in memory)."""
        b = cls()
        n = len(ids)
        for i, t in enumerate(ids):
            want = logits == "all" or (logits == "last" and i == n - 1)
            b.add(t, None if pos0 is None else pos0 + i, (seq_id,), want)
        return b

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens.clear()
        self.pos.clear()
        self.seq_ids.clear()
        self.logits.clear()


@dataclass
class UBatch:
    """A micro-batch: the unit one forward pass computes. `idx` maps each row to its batch entry.

    From split_equal, rows are grouped by sequence: n_seqs blocks of n_seq_tokens rows each,
    for the sequences `seq_id_unq` in that order (the per-stream layout of split mode)."""

    token: np.ndarray  # [n_tokens] int64
    pos: np.ndarray  # [n_tokens] int32
    seq_id: np.ndarray  # [n_tokens] int32, the first sequence of each token
    seq_mask: np.ndarray  # [n_tokens] uint64, bit s set when the token belongs to sequence s
    output: np.ndarray  # [n_tokens] bool
    idx: np.ndarray  # [n_tokens] int64, index of the token in the batch
    seq_id_unq: list[int]
    n_seq_tokens: int
    n_seqs: int

    @property
    def n_tokens(self) -> int:
        return len(self.token)


class Split(enum.IntEnum):
    """How a memory needs a batch cut into ubatches (llama_batch_allocr's splits); a larger value
    is stricter, and a composite memory uses the strictest its parts need."""

    SIMPLE = 0  # tokens in batch order
    EQUAL = 1  # the same number of tokens from each of a set of non-overlapping sequence sets
    EQUAL_SEQUENTIAL = 2  # ... whose sequences are consecutive ids (one KV stream each)


class PositionSource(Protocol):
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...


_LOOP_MAX = 16  # batches up to this size are validated token by token


def _ints(values: Sequence[object], what: str) -> np.ndarray:
    """`values` (a Batch field) as int64; a value that is not an int is a TypeError, one past
    int64 a DecodeError."""
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError):
        arr = np.asarray(values, dtype=object)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        for v in values:
            as_int(v, f"a batch's {what}")  # names the first that is not an int
        raise DecodeError(f"a batch's {what} is out of range", -1)  # ints past int64
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise DecodeError(f"a batch's {what} is out of range", -1)
    return arr.astype(np.int64)


class BatchAllocator:
    """Validates a batch, fills positions from memory, and cuts it into micro-batches."""

    def __init__(self, batch: Batch, n_vocab: int, n_seq_max: int, memory: PositionSource | None) -> None:
        if not isinstance(batch, Batch):
            raise TypeError(f"decode takes a kvtool.Batch, got {type(batch).__name__}")
        n = len(batch)
        if n == 0:
            raise DecodeError("empty batch", -1)
        sizes = {len(batch.pos), len(batch.seq_ids), len(batch.logits)}
        if sizes != {n}:  # a Batch built field by field
            raise DecodeError(
                f"batch of {n} tokens has {sorted(sizes)} positions, sequence sets, outputs", -1
            )
        toks = _ints(batch.tokens, "token")
        bad = np.flatnonzero((toks < 0) | (toks >= n_vocab))
        if bad.size:
            raise DecodeError(f"invalid token[{bad[0]}] = {toks[bad[0]]} (n_vocab {n_vocab})", -1)
        if n_seq_max > 64:
            raise DecodeError(f"n_seq_max = {n_seq_max} > 64", -1)
        if set(map(len, batch.seq_ids)) == {1}:  # one sequence per token: checked as arrays
            seq = _ints([s for (s,) in batch.seq_ids], "seq_id")
            bad = np.flatnonzero((seq < 0) | (seq >= n_seq_max))
            if bad.size:
                i = int(bad[0])
                raise DecodeError(f"invalid seq_id[{i}] = {seq[i]} (n_seq_max = {n_seq_max})", -1)
            self.seq_id = seq.astype(np.int32)
            self.seq_mask = np.left_shift(np.uint64(1), seq.astype(np.uint64))
            self.has_coupled = False
        else:
            for i, sids in enumerate(batch.seq_ids):
                if not sids:
                    raise DecodeError(f"token {i} belongs to no sequence", -1)
                for s in sids:
                    if not 0 <= as_int(s, "a sequence id") < n_seq_max:
                        raise DecodeError(f"invalid seq_id[{i}] = {s} (n_seq_max = {n_seq_max})", -1)
            self.seq_id = np.array([s[0] for s in batch.seq_ids], dtype=np.int32)
            self.seq_mask = np.array(
                [sum(1 << s for s in set(sids)) for sids in batch.seq_ids], dtype=np.uint64
            )
            self.has_coupled = any(len(set(s)) > 1 for s in batch.seq_ids)
        self.batch = batch
        self.token = toks
        self.pos = self._positions(batch, memory)
        self.output = np.asarray(batch.logits, dtype=bool)
        self.n_outputs = int(self.output.sum())
        # a few tokens: the loop costs less than setting up the arrays
        if self.has_coupled or n <= _LOOP_MAX or not self._sequences_ok(memory):
            self._validate_sequences(memory, n_seq_max)  # raises with the first broken rule
        self.used = np.zeros(n, dtype=bool)

    @property
    def n_tokens(self) -> int:
        return len(self.token)

    def seq_ids_in_batch(self) -> list[int]:
        return sorted({s for sids in self.batch.seq_ids for s in sids})

    @staticmethod
    def _positions(batch: Batch, memory: PositionSource | None) -> np.ndarray:
        n_missing = batch.pos.count(None)
        if n_missing == 0:
            pos = _ints(batch.pos, "pos")
            bad = np.flatnonzero((pos < 0) | (pos >= POS_END))
            if bad.size:
                i = int(bad[0])
                raise DecodeError(f"invalid pos[{i}] = {pos[i]} (positions are in [0, {POS_END}))", -1)
            return pos.astype(np.int32)
        if n_missing < len(batch.pos):
            raise DecodeError("batch mixes given and missing positions", -1)
        nxt: dict[int, int] = {}
        out = np.empty(len(batch), dtype=np.int32)
        for i, sids in enumerate(batch.seq_ids):
            s0 = sids[0]
            if s0 not in nxt:
                nxt[s0] = memory.seq_pos_max(s0) + 1 if memory is not None else 0
            if nxt[s0] >= POS_END:
                raise DecodeError(f"sequence {s0} is at the last position ({POS_END - 1})", -1)
            out[i] = nxt[s0]
            for s in sids:
                nxt[s] = out[i] + 1
        return out

    def _sequences_ok(self, memory: PositionSource | None) -> bool:
        """`_validate_sequences`'s rules as array ops, for tokens of one sequence each: whether
        all hold (when one does not, the loop finds which, to say so)."""
        order = np.argsort(self.seq_id, kind="stable")  # grouped by sequence, batch order within
        ss, pp = self.seq_id[order], self.pos[order].astype(np.int64)
        same = ss[1:] == ss[:-1]
        if (same & (pp[1:] < pp[:-1])).any():  # decreasing
            return False
        starts = np.flatnonzero(np.concatenate(([True], ~same)))
        lo = pp[starts]  # never decreasing: a sequence's first position is its lowest
        hi = pp[np.concatenate((starts[1:] - 1, [len(pp) - 1]))]
        new = np.concatenate(([True], ~same | (pp[1:] != pp[:-1])))
        if (hi - lo + 1 > np.add.reduceat(new.astype(np.int64), starts)).any():  # not continuous
            return False
        if memory is not None:
            for s, first in zip(ss[starts].tolist(), lo.tolist(), strict=True):
                x = memory.seq_pos_max(s)
                if x >= 0 and first != x + 1:
                    return False
        return True

    def _validate_sequences(self, memory: PositionSource | None, n_seq_max: int) -> None:
        """llama.cpp's rules: each sequence continues at its last stored position + 1, its
        positions are continuous and never decrease, coupled sequences have not diverged."""
        per_seq: dict[int, list[int]] = {}
        sets: dict[int, int] = {}
        for i, sids in enumerate(self.batch.seq_ids):
            p = int(self.pos[i])
            mask = int(self.seq_mask[i])
            for s in sids:
                lst = per_seq.setdefault(s, [])
                if lst and p < lst[-1]:
                    raise DecodeError(f"sequence {s} positions are decreasing (not allowed)", -1)
                lst.append(p)
                cur = sets.get(s, (1 << 64) - 1) & mask
                if cur == 0:
                    raise DecodeError(f"sequence {s} belongs to incompatible sequence sets", -1)
                sets[s] = cur
        for s, ps in per_seq.items():
            lo, hi = min(ps), max(ps)
            if memory is not None:
                x = memory.seq_pos_max(s)
                if x >= 0 and lo != x + 1:
                    raise DecodeError(
                        f"sequence {s}: the memory ends at position X = {x} but the batch starts at "
                        f"Y = {lo}; positions must continue: Y = X + 1",
                        -1,
                    )
            if hi - lo + 1 > len(set(ps)):
                raise DecodeError(f"sequence {s} positions are not continuous", -1)
        if memory is not None and self.has_coupled:
            for sids in self.batch.seq_ids:
                for s1 in sids[1:]:
                    s0 = sids[0]
                    a = (memory.seq_pos_min(s0), memory.seq_pos_max(s0))
                    if a != (memory.seq_pos_min(s1), memory.seq_pos_max(s1)):
                        raise DecodeError(
                            f"sequence {s1} is coupled to {s0} in the batch but they diverged", -1
                        )

    # -- splitting --------------------------------------------------------------------------
    def split(self, n_ubatch: int, how: Split) -> list[UBatch]:
        """Cuts the whole batch into ubatches of at most n_ubatch tokens."""
        out: list[UBatch] = []
        while True:
            if how == Split.SIMPLE:
                ub = self.split_simple(n_ubatch)
            else:
                ub = self.split_equal(n_ubatch, sequential=how == Split.EQUAL_SEQUENTIAL)
            if ub is None:
                return out
            out.append(ub)

    def _ubatch(self, idxs: np.ndarray, n_seq_tokens: int, n_seqs: int) -> UBatch:
        ix = np.asarray(idxs, dtype=np.int64)
        self.used[ix] = True
        seq_unq: list[int] = []
        for s in self.seq_id[ix].tolist():
            if s not in seq_unq:
                seq_unq.append(int(s))
        return UBatch(
            token=self.token[ix],
            pos=self.pos[ix],
            seq_id=self.seq_id[ix],
            seq_mask=self.seq_mask[ix],
            output=self.output[ix],
            idx=ix,
            seq_id_unq=seq_unq,
            n_seq_tokens=n_seq_tokens,
            n_seqs=n_seqs,
        )

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        """The next n_ubatch unused tokens in batch order."""
        free = np.flatnonzero(~self.used)
        if free.size == 0:
            return None
        take = free[:n_ubatch]
        return self._ubatch(take, len(take), len(take))

    def split_equal(self, n_ubatch: int, sequential: bool) -> UBatch | None:
        """Equal numbers of tokens from each of a set of non-overlapping sequence sets;
        with `sequential`, the sets are consecutive sequence ids (one stream each)."""
        if sequential and self.has_coupled:
            raise DecodeError(
                "a token belongs to several sequences, which per-sequence KV streams cannot hold; "
                "use --kv-unified (ContextParams(kv_unified=True))",
                -1,
            )
        free = np.flatnonzero(~self.used)
        if free.size == 0:
            return None
        sets: list[int] = []
        members: dict[int, list[int]] = {}  # the free tokens of each set, in batch order
        taken = 0  # the union of `sets`: they are disjoint, so a set overlaps one iff it meets this
        last = -1
        masks, seq_ids = self.seq_mask[free].tolist(), self.seq_id[free].tolist()
        for i, m, s in zip(free.tolist(), masks, seq_ids, strict=True):
            tokens = members.get(m)
            if tokens is not None:
                tokens.append(i)
            elif not (m & taken or len(sets) >= n_ubatch or (sequential and sets and s != last + 1)):
                sets.append(m)
                members[m] = [i]
                taken |= m
                last = s
        n_seq_tokens = min(min(len(members[m]) for m in sets), max(1, n_ubatch // len(sets)))
        idxs = np.array([i for m in sets for i in members[m][:n_seq_tokens]], dtype=np.int64)
        return self._ubatch(idxs, n_seq_tokens, len(sets))
