"""RecurrentMemory against a plain-Python model: a toy recurrence whose state after a token list
is recomputed from scratch, so every cp/rm/rollback/state operation can be checked exactly."""

from __future__ import annotations

import pytest
import torch

from kvtool.batch import Batch, BatchAllocator, DecodeError
from kvtool.errors import StateError
from kvtool.memory.recurrent import RecurrentMemory, RecurrentSpec, RSLayerSpec
from kvtool.memory.spec import MemoryParams
from kvtool.state.container import FORMAT, VERSION, read_container, write_container
from kvtool.state.io import StateReader, StateWriter

N_SEQ = 4
LAYERS = {0: RSLayerSpec((2, 3), (3,)), 2: RSLayerSpec((2, 3), (3,))}  # layer ids need not be 0..n-1


def embed(tok: int, il: int) -> torch.Tensor:
    return torch.tensor([tok, tok * 0.5 + il, -tok * 0.25], dtype=torch.float32)


def step(conv: torch.Tensor, ssm: torch.Tensor, tok: int, il: int) -> tuple[torch.Tensor, torch.Tensor]:
    e = embed(tok, il)
    return torch.stack([conv[1], e]), 0.9 * ssm + e + 0.1 * conv[0]


def fold(tokens: list[int], il: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the state after `tokens`, from zeros."""
    conv, ssm = torch.zeros(2, 3), torch.zeros(3)
    for t in tokens:
        conv, ssm = step(conv, ssm, t, il)
    return conv, ssm


def forward(mem_ctx, ub, fail_at_layer: int | None = None) -> None:  # type: ignore[no-untyped-def]
    """What a recurrent model does with its views: per sequence block, the trailing states."""
    T = ub.n_seq_tokens
    for il in sorted(LAYERS):
        if il == fail_at_layer:
            raise RuntimeError("forward failed")
        v = mem_ctx.layer_view(il)
        convs, ssms = [], []
        for b in range(ub.n_seqs):
            conv, ssm, trail_c, trail_s = v.conv[b], v.ssm[b], [], []
            for t in ub.token[b * T : (b + 1) * T].tolist():
                conv, ssm = step(conv, ssm, t, il)
                trail_c.append(conv)
                trail_s.append(ssm)
            convs.append(torch.stack(trail_c[-v.n_states :]))
            ssms.append(torch.stack(trail_s[-v.n_states :]))
        c, s = torch.stack(convs), torch.stack(ssms)
        v.store(c[:, 0] if v.n_states == 1 else c, s[:, 0] if v.n_states == 1 else s)


def decode(
    mem: RecurrentMemory, entries: list[tuple[int, int]], n_ubatch: int = 512, fail_ub: int = -1
) -> None:
    """entries: (token, seq); positions follow the memory."""
    b = Batch()
    for tok, seq in entries:
        b.add(tok, None, [seq], True)
    alloc = BatchAllocator(b, 1000, N_SEQ, mem)
    ctx = mem.init_batch(alloc, n_ubatch)
    while True:
        ctx.apply()
        forward(ctx, ctx.ubatch, fail_at_layer=2 if ctx.i == fail_ub else None)  # type: ignore[attr-defined]
        if not ctx.next():
            break


class Ref:
    """Plain-Python model of the memory: each sequence's tokens and position."""

    def __init__(self) -> None:
        self.toks: dict[int, list[int]] = {}
        self.pos: dict[int, int] = {}

    def add(self, seq: int, toks: list[int]) -> None:
        self.toks.setdefault(seq, []).extend(toks)
        self.pos[seq] = self.pos.get(seq, -1) + len(toks)

    def check(self, mem: RecurrentMemory) -> None:
        for s in range(N_SEQ):
            want = self.pos.get(s, -1)
            assert (mem.seq_pos_min(s), mem.seq_pos_max(s)) == (want, want), s
            if s in self.toks:
                slot = int(mem.cells.tail[s])
                for il in LAYERS:
                    conv, ssm = fold(self.toks[s], il)
                    torch.testing.assert_close(mem.states.t["conv"][il][slot], conv)
                    torch.testing.assert_close(mem.states.t["ssm"][il][slot], ssm)


def make(k: int = 0) -> RecurrentMemory:
    class P:
        n_seq_max = N_SEQ
        n_rs_seq = k
        device = "cpu"

    return RecurrentSpec(LAYERS).build(P())


def snapshot(mem: RecurrentMemory) -> list[torch.Tensor]:
    return [t.clone() for ts in mem.states.t.values() for t in ts.values()] + [
        torch.from_numpy(a.copy()) for a in (mem.cells.tail, mem.cells.pos, mem.cells.n_hist)
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("n_ubatch", [512, 3, 1])
def test_interleaved_prompts_and_decode(n_ubatch: int) -> None:
    mem, ref = make(), Ref()
    prompts = {0: [5, 6, 7], 1: [8, 9, 10, 11, 12], 2: [13]}
    entries = [(p[i], s) for i in range(5) for s, p in prompts.items() if i < len(p)]
    decode(mem, entries, n_ubatch)
    for s, p in prompts.items():
        ref.add(s, p)
    ref.check(mem)
    for t in range(3):
        decode(mem, [(20 + t, 0), (30 + t, 1), (40 + t, 2)], n_ubatch)
        for s, base in ((0, 20), (1, 30), (2, 40)):
            ref.add(s, [base + t])
        ref.check(mem)
    assert mem.n_used() == 3


def test_seq_cp_shares_until_a_write() -> None:
    mem, ref = make(), Ref()
    decode(mem, [(t, 0) for t in [3, 4, 5, 6]])
    mem.seq_cp(0, 1, -1, -1)
    assert mem.n_used() == 1 and mem.cells.tail[0] == mem.cells.tail[1]
    ref.add(0, [3, 4, 5, 6])
    ref.add(1, [3, 4, 5, 6])
    ref.check(mem)
    decode(mem, [(7, 1)])  # seq 1 writes: it gets a copy, seq 0's state stays
    ref.add(1, [7])
    ref.check(mem)
    assert mem.n_used() == 2
    decode(mem, [(8, 0), (9, 1)])  # both in one ubatch
    ref.add(0, [8])
    ref.add(1, [9])
    ref.check(mem)
    mem.seq_cp(1, 0, 0, 3)  # the range is ignored (llama.cpp): the whole state is shared
    ref.toks[0], ref.pos[0] = list(ref.toks[1]), ref.pos[1]
    ref.check(mem)
    assert mem.n_used() == 1


def test_seq_rm_whole_partial_and_outside() -> None:
    mem, ref = make(), Ref()
    decode(mem, [(t, 0) for t in range(3, 19)] + [(t, 1) for t in range(3, 8)])
    ref.add(0, list(range(3, 19)))
    ref.add(1, list(range(3, 8)))
    before = snapshot(mem)
    assert mem.seq_rm(0, 10, -1) is False  # the oracle's rm_tail: refused, nothing changes
    assert mem.seq_rm(0, 3, 12) is True  # as llama.cpp: only the state's position counts
    assert same(before, snapshot(mem))
    assert mem.seq_rm(0, 16, -1) is True  # nothing at or after 16
    assert mem.seq_rm(0, 0, 10) is True  # the state's position 15 is outside: kept
    assert same(before, snapshot(mem))
    with pytest.raises(DecodeError):  # positions must continue at 16
        BatchAllocator(_batch_at(3, 10, 0), 1000, N_SEQ, mem)
    assert mem.seq_rm(-1, 2, 5) is False
    assert mem.seq_rm(0, -1, -1) is True
    del ref.toks[0], ref.pos[0]
    ref.check(mem)
    assert mem.n_used() == 1
    assert mem.seq_rm(-1, -1, -1) is True
    assert [mem.seq_pos_max(s) for s in range(N_SEQ)] == [-1] * N_SEQ and mem.n_used() == 0


def _batch_at(tok: int, pos: int, seq: int) -> Batch:
    b = Batch()
    b.add(tok, pos, [seq], True)
    return b


def test_seq_add_div_move_only_the_position() -> None:
    mem = make(2)
    decode(mem, [(t, 0) for t in range(3, 9)])  # pos 5
    mem.seq_cp(0, 1, -1, -1)
    states = snapshot(mem)[:4]
    mem.seq_add(0, 0, -1, 10)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0), mem.seq_pos_max(1)) == (15, 15, 5)
    mem.seq_add(0, 0, 10, 3)  # 15 is outside [0, 10)
    assert mem.seq_pos_max(0) == 15
    mem.seq_div(0, 0, -1, 2)
    assert mem.seq_pos_max(0) == 7
    assert same(states, snapshot(mem)[:4])
    assert not mem.seq_can_resume(0, 7)  # seq_div scattered the snapshot positions
    assert mem.seq_can_resume(1, 5) and mem.seq_can_resume(1, 4) and not mem.seq_can_resume(1, 3)
    assert mem.can_shift() is False


def test_seq_keep_and_clear() -> None:
    mem = make()
    decode(mem, [(3, 0), (4, 1), (5, 2)])
    mem.seq_keep(1)
    assert [mem.seq_pos_max(s) for s in range(N_SEQ)] == [-1, 0, -1, -1] and mem.n_used() == 1
    mem.clear(True)
    assert mem.n_used() == 0 and all(t.abs().sum() == 0 for ts in mem.states.t.values() for t in ts.values())


@pytest.mark.parametrize("n_ubatch", [512, 2])
def test_rollback_within_k(n_ubatch: int) -> None:
    k = 3
    mem, ref = make(k), Ref()
    toks = list(range(3, 11))
    decode(mem, [(t, 0) for t in toks], n_ubatch)  # pos 7
    assert mem.seq_can_resume(0, 5) and not mem.seq_can_resume(0, 4) and mem.seq_can_resume(0, 0)
    assert mem.seq_rm(0, 4, -1) is False  # 4 tokens back: beyond K
    assert mem.seq_rm(0, 6, -1) is True  # 2 back
    ref.add(0, toks[:6])
    ref.check(mem)
    assert mem.seq_rm(0, 5, -1) is True  # one more: the window still holds it
    ref.toks[0], ref.pos[0] = toks[:5], 4
    ref.check(mem)
    assert mem.seq_rm(0, 4, -1) is False  # 3 used up
    decode(mem, [(t, 0) for t in [50, 51]], n_ubatch)
    ref.add(0, [50, 51])
    ref.check(mem)
    assert mem.seq_rm(0, 6, -1) is True  # back to after pos 5 = after token 50
    ref.toks[0], ref.pos[0] = [*toks[:5], 50], 5
    ref.check(mem)


def test_rollback_after_single_token_decodes_and_shared_state() -> None:
    mem, ref = make(2), Ref()
    decode(mem, [(3, 0)])
    for t in (4, 5, 6):
        decode(mem, [(t, 0)])
    mem.seq_cp(0, 1, -1, -1)
    assert mem.seq_rm(1, 2, -1) is True  # seq 1 rolls back alone: seq 0 keeps its state
    ref.add(0, [3, 4, 5, 6])
    ref.add(1, [3, 4])
    ref.check(mem)
    assert mem.seq_rm(0, 1, -1) is False  # 3 back with K = 2


def test_failed_batch_is_undone_by_removing_what_it_wrote() -> None:
    mem, ref = make(1), Ref()
    decode(mem, [(3, 0), (4, 0), (5, 1)])
    mem.seq_cp(1, 2, -1, -1)
    ref.add(0, [3, 4])
    ref.add(1, [5])
    ref.add(2, [5])
    with pytest.raises(RuntimeError):  # ubatch 1 (of 1-token ubatches) fails after layer 0
        decode(mem, [(6, 0), (7, 1), (8, 0), (9, 1)], n_ubatch=2, fail_ub=1)
    assert mem.seq_rm(0, 2, -1) is True and mem.seq_rm(1, 1, -1) is True  # what Context does
    ref.check(mem)
    decode(mem, [(6, 0)])
    ref.add(0, [6])
    ref.check(mem)
    assert mem.seq_rm(0, 2, -1) is True  # K = 1 allows one token back (not the undo)
    assert mem.seq_rm(1, 0, -1) is True


def test_completed_batch_cannot_be_undone_without_snapshots() -> None:
    mem = make(0)
    decode(mem, [(3, 0), (4, 0)])
    decode(mem, [(5, 0)])
    assert mem.seq_rm(0, 2, -1) is False  # as llama.cpp with n_rs_seq = 0


def test_shared_token_is_refused() -> None:
    mem = make()
    b = Batch()
    b.add(3, 0, [0, 1], True)
    with pytest.raises(DecodeError, match="recurrent"):
        mem.init_batch(BatchAllocator(b, 1000, N_SEQ, mem), 512)


def _save(mem: RecurrentMemory, seq: int | None) -> StateReader:
    w = StateWriter()
    mem.state_write(w, seq)
    state, tensors = read_container(
        write_container({"format": FORMAT, "version": VERSION, "memory": w.layout}, w.tensors)
    )
    return StateReader(state["memory"], tensors)


def test_state_round_trip_into_another_sequence() -> None:
    mem, ref = make(), Ref()
    decode(mem, [(t, 0) for t in range(3, 15)] + [(40, 1)])
    r = _save(mem, 0)
    assert r.layout["kind"] == "recurrent"
    mem.clear(True)
    r.layout = dict(r.layout)
    mem.state_read(r, 2)()
    assert not r.tensors  # every tensor was read
    ref.add(2, list(range(3, 15)))
    ref.check(mem)
    decode(mem, [(50, 2)])
    ref.add(2, [50])
    ref.check(mem)


def test_state_round_trip_all_sequences() -> None:
    mem, ref = make(), Ref()
    decode(mem, [(3, 0), (4, 1), (5, 1)])
    mem.seq_cp(1, 3, -1, -1)
    r = _save(mem, None)
    other = make(2)
    decode(other, [(9, 2)])
    other.state_read(r, None)()
    ref.add(0, [3])
    ref.add(1, [4, 5])
    ref.add(3, [4, 5])
    ref.check(other)


def test_bad_state_changes_nothing() -> None:
    mem = make()
    decode(mem, [(3, 0), (4, 1)])
    before = snapshot(mem)
    other = RecurrentMemory({0: RSLayerSpec((2, 3), (4,))}, N_SEQ)
    with pytest.raises(StateError, match="recurrent layers differ"):
        mem.state_read(_save(other, None), None)
    r = _save(mem, None)
    with pytest.raises(StateError, match="several sequences"):
        mem.state_read(r, 1)
    r = _save(mem, 0)
    r.layout = {**r.layout, "kind": "kv"}
    with pytest.raises(StateError, match="'kv' memory"):
        mem.state_read(r, 1)
    assert same(before, snapshot(mem))


def test_memory_breakdown_counts_every_slot_and_snapshot() -> None:
    """n_seq_max slots of F32 states, each with n_rs_seq snapshots; the spec says so before."""
    (part,) = make(0).memory_breakdown().parts
    assert (part.kind, part.n_cells, part.used) == ("recurrent", N_SEQ, (0,))
    assert part.nbytes == N_SEQ * 4 * 2 * (6 + 3)
    assert make(3).memory_breakdown().states == N_SEQ * 4 * 4 * 2 * (6 + 3)
    spec = RecurrentSpec(LAYERS)
    params = MemoryParams(n_ctx_seq=256, n_seq_max=N_SEQ, n_ubatch=8, n_rs_seq=3)
    assert spec.memory_breakdown(params) == spec.build(params).memory_breakdown()
