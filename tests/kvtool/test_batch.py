"""Batch validation and splitting (llama_batch_allocr's rules)."""

from __future__ import annotations

import random

import pytest

from kvtool.batch import Batch, BatchAllocator, DecodeError


class Mem:
    def __init__(self, last: dict[int, int]) -> None:
        self.last = last

    def seq_pos_min(self, s: int) -> int:
        return 0 if s in self.last else -1

    def seq_pos_max(self, s: int) -> int:
        return self.last.get(s, -1)


def alloc(b: Batch, last: dict[int, int] | None = None, n_seq_max: int = 4) -> BatchAllocator:
    return BatchAllocator(b, n_vocab=100, n_seq_max=n_seq_max, memory=Mem(last or {}))


def test_positions_filled_from_memory() -> None:
    b = Batch()
    for t, s in [(5, 0), (6, 1), (7, 0)]:
        b.add(t, None, [s], False)
    a = alloc(b, {0: 9})
    assert a.pos.tolist() == [10, 0, 11]


@pytest.mark.parametrize(
    ("tokens", "pos", "seqs", "last", "msg"),
    [
        ([100], [0], [0], {}, "invalid token"),
        ([1], [0], [4], {}, "invalid seq_id"),
        ([1], [3], [0], {0: 5}, r"Y = X \+ 1"),
        ([1, 2], [0, 2], [0, 0], {}, "not continuous"),
        ([1, 2], [1, 0], [0, 0], {}, "decreasing"),
    ],
)
def test_invalid_batches(tokens, pos, seqs, last, msg) -> None:  # type: ignore[no-untyped-def]
    b = Batch()
    for t, p, s in zip(tokens, pos, seqs, strict=True):
        b.add(t, p, [s], True)
    with pytest.raises(DecodeError, match=msg) as e:
        alloc(b, last)
    assert e.value.status == -1


def test_split_simple_keeps_batch_order() -> None:
    b = Batch.from_tokens(list(range(10)), logits="all")
    a = alloc(b)
    ubs = []
    while (ub := a.split_simple(4)) is not None:
        ubs.append(ub.idx.tolist())
    assert ubs == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_split_equal_sequential_groups_consecutive_sequences() -> None:
    b = Batch()
    lens = {0: 3, 1: 5, 2: 2, 3: 4}
    for i in range(5):
        for s, n in lens.items():
            if i < n:
                b.add(1, i, [s], True)
    a = alloc(b)
    seen = []
    while (ub := a.split_equal(8, sequential=True)) is not None:
        assert ub.seq_id_unq == list(range(ub.seq_id_unq[0], ub.seq_id_unq[0] + ub.n_seqs))
        assert ub.n_tokens == ub.n_seqs * ub.n_seq_tokens
        for k, s in enumerate(ub.seq_id_unq):
            block = ub.seq_id[k * ub.n_seq_tokens : (k + 1) * ub.n_seq_tokens]
            assert (block == s).all()
        seen += ub.idx.tolist()
    assert sorted(seen) == list(range(len(b)))


def test_split_equal_sequential_rejects_shared_tokens() -> None:
    b = Batch()
    b.add(1, 0, [0, 1], True)
    a = alloc(b)
    with pytest.raises(DecodeError, match="kv-unified"):
        a.split_equal(8, sequential=True)


def _rules_hold(pos: list[int], seqs: list[int], last: dict[int, int]) -> bool:
    """llama_batch_allocr's sequence rules, one token at a time (the plain model), and kvtool's
    own: a position is never negative."""
    per: dict[int, list[int]] = {}
    for p, s in zip(pos, seqs, strict=True):
        if p < 0:
            return False
        if per.get(s) and p < per[s][-1]:
            return False
        per.setdefault(s, []).append(p)
    for s, ps in per.items():
        if last.get(s, -1) >= 0 and ps[0] != last[s] + 1:
            return False
        if max(ps) - min(ps) + 1 > len(set(ps)):
            return False
    return True


def test_array_checks_agree_with_the_rules_token_by_token() -> None:
    # batches of one sequence per token longer than 16 are checked as arrays
    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(600):
        n_seq = rng.randint(1, 4)
        last = {s: rng.choice([-1, 3, 10]) for s in range(n_seq)}
        nxt = {s: last[s] + 1 for s in range(n_seq)}
        pos, seqs = [], []
        n = rng.randint(17, 40)  # above the size the allocator checks token by token
        broken = rng.randrange(2 * n)  # half of the batches break a rule at this token
        for i in range(n):
            s = rng.randrange(n_seq)
            p = nxt[s] + (rng.choice([1, -1, 2, -2, -3]) if i == broken else 0)
            nxt[s] = p + 1
            pos.append(p)
            seqs.append(s)
        b = Batch()
        for p, s in zip(pos, seqs, strict=True):
            b.add(1, p, [s], False)
        ok = _rules_hold(pos, seqs, last)
        seen[ok] += 1
        if ok:
            alloc(b, last)
        else:
            with pytest.raises(DecodeError):
                alloc(b, last)
    assert min(seen.values()) > 100  # both verdicts were exercised
