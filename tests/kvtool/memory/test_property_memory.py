"""Property tests of the memory: hypothesis writes random programs of decodes and sequence ops
(seq_rm, seq_cp, seq_keep, seq_add, seq_div, clear, whole-context and per-sequence state
save/load, compaction, failing decodes and loads) for every memory kind and both KV modes, and
checks after every step, through the public API:

(a) which positions each sequence holds (seq_pos_min/max) and the cells in use, against the
    plain-Python models of tests/helpers/ref_memory.py;
(b) an operation that fails (MemoryRefused, seq_rm answering False, DecodeError, StateError)
    changes nothing: the cells or states and their K/V/recurrent contents are compared;
(c) the logits of a decode equal those of a fresh context decoding the sequence's surviving
    tokens, wherever the memory's semantics say they must: one-layer llama always (a K row
    depends on its token and position only, so any cut, copy or shift is exact); deeper
    models when every cached token was computed over exactly the tokens the sequence now
    holds before it; recurrent states always (a state is the fold of its tokens).

The CI run is bounded and derandomized; `pytest --property-examples N` runs N random programs
per case (the report's long run). Shrunk failures live on as explicit tests in test_property_found.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvtool
from kvtool import Batch, Context, ContextParams, DecodeError, KvtoolError
from tests.helpers.memory_snapshot import snapshot
from tests.helpers.ref_memory import RefMemory, RefRecurrent, RefSWA, Refused
from tests.helpers.tiny_gemma3 import TinyGemma3, write_tiny_gemma3
from tests.helpers.tiny_gguf import TinyLlama, spm_vocab, write_tiny_llama

TINY = Path(__file__).parent.parent.parent / "data" / "tiny" / "models"
N_VOCAB = len(spm_vocab()[0])
N_SEQ = 3
N_SWA = 4  # gemma3's window
KV_ARCHS = ["llama", "gemma3"]
RECURRENT_ARCHS = ["mamba", "mamba2", "rwkv6", "rwkv7"]
HYBRID_ARCHS = ["granitehybrid", "lfm2"]
STATS: dict[str, int] = {"programs": 0, "steps": 0, "failed_ops": 0, "logit_checks": 0}


@dataclass(frozen=True)
class Case:
    arch: str
    unified: bool

    @property
    def kv(self) -> bool:
        return self.arch not in RECURRENT_ARCHS

    @property
    def recurrent(self) -> bool:
        return self.arch not in KV_ARCHS

    @property
    def exact(self) -> bool:
        """One attention layer: every cached row is exact whatever was cut, copied or shifted."""
        return self.arch == "llama"


_MODELS: dict[str, kvtool.Model] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, kvtool.Model]]:
    d = tmp_path_factory.mktemp("property")
    _MODELS["llama"] = kvtool.Model(write_tiny_llama(d / "l1.gguf", TinyLlama(n_layer=1, seed=3)))
    _MODELS["gemma3"] = kvtool.Model(write_tiny_gemma3(d / "g2.gguf", TinyGemma3(n_layer=2, n_swa=N_SWA)))
    for a in RECURRENT_ARCHS + HYBRID_ARCHS:
        _MODELS[a] = kvtool.Model(TINY / f"tiny-{a}.gguf")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls lose to threads on a shared machine
    yield _MODELS
    torch.set_num_threads(n)


def fresh_logits(model: kvtool.Model, tags: list[int]) -> torch.Tensor:
    """The last token's logits when a new context decodes `tags` from position 0."""
    ctx = Context(model, ContextParams(n_ctx=len(tags) + 1, n_seq_max=1))
    ctx.decode(Batch.from_tokens(tags, pos0=0))
    return ctx.logits()[-1].clone()


def placed_logits(model: kvtool.Model, cells: list[tuple[int, int]], query: int, qpos: int) -> torch.Tensor:
    """One-layer models: the logits of `query` at `qpos` over a sequence holding `cells` (tag,
    pos), duplicate positions and gaps allowed: each token is decoded alone, then shared."""
    ctx = Context(model, ContextParams(n_ctx=len(cells) + 2, n_seq_max=64, kv_unified=True))
    for i in range(0, len(cells), 63):
        chunk = cells[i : i + 63]
        b = Batch()
        for k, (t, p) in enumerate(chunk):
            b.add(t, p, [k + 1], False)
        ctx.decode(b)
        for k in range(len(chunk)):
            ctx.memory.seq_cp(k + 1, 0, -1, -1)
            ctx.memory.seq_rm(k + 1, -1, -1)
    ctx.decode(Batch.from_tokens([query], pos0=qpos))
    return ctx.logits()[0].clone()


TOKENS = st.integers(3, N_VOCAB - 1)
SEQS = st.integers(0, N_SEQ - 1)
ANY_SEQ = st.integers(-1, N_SEQ)  # -1: every sequence; N_SEQ: out of range
POS = st.one_of(st.just(-1), st.integers(0, 14))


def machine(case: Case) -> type[RuleBasedStateMachine]:
    """The state machine of one memory kind and KV mode."""

    class MemoryMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = _MODELS[case.arch]
            self.ctx: Context | None = None
            STATS["programs"] += 1

        # -- setup: the context's variable parameters -------------------------------------------
        @precondition(lambda self: self.ctx is None)
        @rule(
            defrag=st.sampled_from(["none", "on-fail", "threshold=0.3"]),
            n_rs_seq=st.sampled_from([0, 0, 2]),
            n_ubatch=st.sampled_from([512, 3]),
        )
        def start(self, defrag: str, n_rs_seq: int, n_ubatch: int) -> None:
            self.params = ContextParams(
                n_ctx=256 * (1 if case.unified else N_SEQ),
                n_seq_max=N_SEQ,
                n_ubatch=n_ubatch,
                kv_unified=case.unified,
                defrag=defrag if case.kv else "none",
                n_rs_seq=n_rs_seq if case.recurrent else 0,
            )
            self.ctx = Context(self.model, self.params)
            n = self.ctx.n_ctx_seq
            self.kv = RefMemory(n, N_SEQ, case.unified) if case.kv else None
            if case.arch == "gemma3":  # its window cache holds as many cells: it never forgets
                self.kv = RefSWA(n, N_SEQ, case.unified, N_SWA)
            self.rs = RefRecurrent(N_SEQ, self.params.n_rs_seq) if case.recurrent else None

        # -- helpers ----------------------------------------------------------------------------
        @property
        def mem(self):  # type: ignore[no-untyped-def]
            assert self.ctx is not None
            return self.ctx.memory

        def pos_min_max(self, s: int) -> tuple[int, int]:
            """A composite reports what every part holds: the largest minimum, smallest maximum."""
            parts = [r.pos_min_max(s) for r in (self.kv, self.rs) if r is not None]
            return max(lo for lo, _ in parts), min(hi for _, hi in parts)

        def refused(self, what: str, op) -> None:  # type: ignore[no-untyped-def]
            """`op` must fail (raise a KvtoolError or return False) and change nothing."""
            before = snapshot(self.mem)
            try:
                ok = op()
            except KvtoolError:
                ok = False
            assert ok is False, f"{what} was expected to fail"
            assert snapshot(self.mem) == before, f"the failed {what} changed the memory"
            STATS["failed_ops"] += 1

        def seq_op(self, what: str, ref_ops: list, op) -> None:  # type: ignore[no-untyped-def]
            """Runs the references' op on copies first: when one refuses, the memory must too."""
            import copy

            saved = (copy.deepcopy(self.kv), copy.deepcopy(self.rs))
            try:
                for r in ref_ops:
                    r()
            except Refused:
                self.kv, self.rs = saved
                self.refused(what, op)
                return
            res = op()
            assert res is None or res is True, f"{what} failed: {res}"

        def teardown(self) -> None:
            """(c) at the end of every program: each sequence's next token, against a fresh decode."""
            if self.ctx is None:
                return
            per = {s: [5] for s in range(N_SEQ) if self.pos_min_max(s)[1] >= 0}
            if per:
                self._decode(per, False, True)

        # -- (a) after every step ---------------------------------------------------------------
        @invariant()
        def positions_match(self) -> None:
            if self.ctx is None:
                return
            STATS["steps"] += 1
            got = [(self.mem.seq_pos_min(s), self.mem.seq_pos_max(s)) for s in range(N_SEQ)]
            if isinstance(self.kv, RefSWA):  # the window forgets on its own: follow it, check the base
                base = [(self.mem.base.seq_pos_min(s), self.mem.base.seq_pos_max(s)) for s in range(N_SEQ)]
                assert base == [RefMemory.pos_min_max(self.kv, s) for s in range(N_SEQ)], (
                    "base cache positions"
                )
                for s, (lo, _) in enumerate(got):
                    assert lo == -1 or lo in self.kv.win.positions(s), (
                        "the window starts at a position it held"
                    )
                    self.kv.forget(s, lo)
            want = [self.pos_min_max(s) for s in range(N_SEQ)]
            assert got == want, "seq_pos_min/max"
            want_used = self.kv.n_used() if self.kv is not None else self.rs.n_used()  # type: ignore[union-attr]
            assert self.mem.n_used() == want_used, "n_used"

        # -- decodes ----------------------------------------------------------------------------
        @precondition(lambda self: self.ctx is not None)
        @rule(
            parts=st.lists(st.tuples(SEQS, st.lists(TOKENS, min_size=1, max_size=4)), min_size=1, max_size=3),
            interleave=st.booleans(),
            check=st.booleans(),
        )
        def decode(self, parts: list[tuple[int, list[int]]], interleave: bool, check: bool) -> None:
            per: dict[int, list[int]] = {}
            for s, tags in parts:
                per.setdefault(s, []).extend(tags)
            self._decode(per, interleave, check)

        @precondition(lambda self: self.ctx is not None and case.kv)
        @rule(s=SEQS, n=st.integers(100, 300), tag=TOKENS)
        def decode_long(self, s: int, n: int, tag: int) -> None:
            """A long prompt: fills a stream, or fails for want of room and changes nothing."""
            self._decode({s: [(tag + 7 * i) % (N_VOCAB - 3) + 3 for i in range(n)]}, False, False)

        def _fits(self, per: dict[int, list[int]]) -> bool | None:
            """Whether the batch must fit (None: the contiguous policies may fail on holes)."""
            if self.kv is None:
                return True
            need: dict[int, int] = {}
            for s, tags in per.items():
                st_ = 0 if case.unified else s
                need[st_] = need.get(st_, 0) + len(tags)
            free = [self.kv.n_free(s) >= n for s, n in need.items()]
            if not all(free):
                return False
            return True if self.params.defrag in ("none", "on-fail") else None

        def _decode(self, per: dict[int, list[int]], interleave: bool, check: bool) -> None:
            b = Batch()
            p0 = {s: self.pos_min_max(s)[1] + 1 for s in per}
            order = [(s, i) for s in per for i in range(len(per[s]))]
            if interleave:
                order.sort(key=lambda x: (x[1], x[0]))
            last = {s: len(tags) - 1 for s, tags in per.items()}
            for s, i in order:
                b.add(per[s][i], p0[s] + i, [s], i == last[s])
            fits = self._fits(per)
            if fits is False:
                self.ctx.update()  # type: ignore[union-attr]  # decode applies pending work first
                if self.kv is not None:
                    self.kv.update()
                self.refused("a decode without room", lambda: self.ctx.decode(b))  # type: ignore[union-attr]
                return
            try:
                self.ctx.decode(b)  # type: ignore[union-attr]
            except DecodeError as e:
                assert fits is None and e.status == 1, f"decode failed: {e}"
                return
            if self.kv is not None:
                self.kv.update()
                for s, tags in per.items():
                    for i, t in enumerate(tags):
                        self.kv.decode(s, t, p0[s] + i)
            if self.rs is not None:
                for s, tags in per.items():
                    self.rs.decode(s, tags, p0[s])
            if isinstance(self.kv, RefSWA):
                for s in per:
                    need = self.kv.must_hold(s)
                    assert need is not None and self.mem.seq_pos_min(s) <= need, (
                        "the window forgot a position it sees"
                    )
            if check:
                rows = {s: k for k, s in enumerate(s for s, i in order if i == last[s])}
                for s in per:
                    self._check_logits(s, self.ctx.logits()[rows[s]])  # type: ignore[union-attr]

        # -- (c) logits against a fresh decode ---------------------------------------------------
        def _check_logits(self, s: int, got: torch.Tensor) -> None:
            kv, rs = self.kv, self.rs
            if case.exact:
                assert kv is not None
                toks = kv.tokens(s)
                want = placed_logits(
                    self.model, [(t.tag, t.pos) for t in toks[:-1]], toks[-1].tag, toks[-1].pos
                )
            elif kv is not None:
                if not kv.faithful(s):
                    return
                tags = [t.tag for t in kv.tokens(s)]
                if rs is not None and rs.seqs[s].hist != tags:
                    return  # a hybrid whose two parts hold different histories: checked by (a)
                want = fresh_logits(self.model, tags)
            else:
                assert rs is not None
                want = fresh_logits(self.model, rs.seqs[s].hist)
            STATS["logit_checks"] += 1
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)

        @precondition(lambda self: self.ctx is not None)
        @rule(s=SEQS, tag=TOKENS)
        def decode_bad_position(self, s: int, tag: int) -> None:
            """A batch that skips a position is refused (Y = X + 1) and changes nothing."""
            p = self.pos_min_max(s)[1]
            if p < 0:
                return
            self.ctx.update()  # type: ignore[union-attr]
            if self.kv is not None:
                self.kv.update()
            self.refused(
                "a decode skipping a position", lambda: self.ctx.decode(Batch.from_tokens([tag], s, p + 2))
            )  # type: ignore[union-attr]

        # -- sequence ops -----------------------------------------------------------------------
        @precondition(lambda self: self.ctx is not None)
        @rule(s=ANY_SEQ, p0=POS, p1=POS)
        def seq_rm(self, s: int, p0: int, p1: int) -> None:
            refs = [r for r in (self.rs, self.kv) if r is not None]
            if s >= N_SEQ:
                self.refused("seq_rm of an unknown sequence", lambda: self.mem.seq_rm(s, p0, p1))
                return
            if self.kv is not None and self.rs is not None and s >= 0:
                refs = [self._hybrid_rm(s, p0, p1), *refs]
            self.seq_op(
                f"seq_rm({s}, {p0}, {p1})",
                [
                    r if callable(r) and not hasattr(r, "seq_rm") else (lambda r=r: r.seq_rm(s, p0, p1))
                    for r in refs
                ],
                lambda: self.mem.seq_rm(s, p0, p1),
            )

        @precondition(lambda self: self.ctx is not None)
        @rule(src=SEQS, dst=st.integers(0, N_SEQ), p0=POS, p1=POS)
        def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
            ops = []
            if dst >= N_SEQ:
                ops.append(self._raise)
            if self.rs is not None:
                ops.append(lambda: self.rs.seq_cp(src, dst, p0, p1))  # type: ignore[union-attr]
            if self.kv is not None and self.rs is not None and src != dst:
                ops.append(lambda: self._hybrid_cp(src, dst, p0, p1))
            elif self.kv is not None:
                ops.append(lambda: self._kv_cp(src, dst, p0, p1))
            self.seq_op(f"seq_cp({src}, {dst}, {p0}, {p1})", ops, lambda: self.mem.seq_cp(src, dst, p0, p1))

        def _hybrid_rm(self, s: int, p0: int, p1: int):  # type: ignore[no-untyped-def]
            """A range before the state's last position is refused where the KV part holds some."""
            assert self.kv is not None and self.rs is not None
            lo, hi = RefMemory._range(p0, p1)
            last = self.rs.pos_min_max(s)[1]
            ps = self.kv.positions(s)
            hit = bool(ps) and lo <= max(ps) and hi > min(ps)  # the KV part's span meets the range

            def check() -> None:
                if lo < hi <= last and hit:
                    raise Refused("a range the recurrent part would ignore")

            return check

        def _hybrid_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
            """A hybrid copies all of src, replacing dst (its recurrent part can do no less)."""
            assert self.kv is not None
            lo, hi = RefMemory._range(p0, p1)
            ps = self.kv.positions(src)
            if ps and not lo <= min(ps) <= max(ps) < hi:
                raise Refused("a part of a hybrid sequence")
            self.kv.seq_rm(dst, -1, -1)
            self._kv_cp(src, dst, -1, -1)

        def _kv_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
            if not self.kv.seq_cp(src, dst, p0, p1):  # type: ignore[union-attr]
                raise Refused("no room in dst's stream")

        @staticmethod
        def _raise() -> None:
            raise Refused("out of range")

        @precondition(lambda self: self.ctx is not None)
        @rule(s=st.integers(0, N_SEQ))
        def seq_keep(self, s: int) -> None:
            ops = [self._raise] if s >= N_SEQ else []
            ops += [lambda r=r: r.seq_keep(s) for r in (self.rs, self.kv) if r is not None]
            self.seq_op(f"seq_keep({s})", ops, lambda: self.mem.seq_keep(s))

        def _shift_ops(self, s: int) -> list:  # type: ignore[type-arg]
            ops = [self._raise] if s >= N_SEQ else []
            return ops

        @precondition(lambda self: self.ctx is not None)
        @rule(s=st.integers(0, N_SEQ), p0=POS, p1=POS, d=st.integers(-4, 4))
        def seq_add(self, s: int, p0: int, p1: int, d: int) -> None:
            ops = self._shift_ops(s)
            ops += [lambda r=r: r.seq_add(s, p0, p1, d) for r in (self.rs, self.kv) if r is not None]
            self.seq_op(f"seq_add({s}, {p0}, {p1}, {d})", ops, lambda: self.mem.seq_add(s, p0, p1, d))

        @precondition(lambda self: self.ctx is not None)
        @rule(s=st.integers(0, N_SEQ), p0=POS, p1=POS, d=st.integers(-1, 3))
        def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
            ops = self._shift_ops(s)
            if d < 1:
                ops.append(self._raise)
            ops += [lambda r=r: r.seq_div(s, p0, p1, d) for r in (self.rs, self.kv) if r is not None]
            self.seq_op(f"seq_div({s}, {p0}, {p1}, {d})", ops, lambda: self.mem.seq_div(s, p0, p1, d))

        @precondition(lambda self: self.ctx is not None)
        @rule(data=st.booleans())
        def clear(self, data: bool) -> None:
            self.mem.clear(data)
            if self.kv is not None:
                self.kv.seq_rm(-1, -1, -1)
            if self.rs is not None:
                self.rs.clear()

        @precondition(lambda self: self.ctx is not None)
        @rule(optimize=st.booleans())
        def update(self, optimize: bool) -> None:
            """Pending shifts, and compaction (every stream with holes when optimized)."""
            self.ctx.update(optimize)  # type: ignore[union-attr]
            if self.kv is not None:
                self.kv.update()

        # -- state ------------------------------------------------------------------------------
        @precondition(lambda self: self.ctx is not None)
        @rule()
        def state_context(self) -> None:
            """The whole context saved and loaded into a new one."""
            data = self.ctx.state_get_data()  # type: ignore[union-attr]
            new = Context(self.model, self.params)
            new.state_set_data(data)
            self.ctx = new
            if self.rs is not None:
                self.rs.loaded()

        @precondition(lambda self: self.ctx is not None)
        @rule(src=SEQS, dst=SEQS)
        def state_seq(self, src: int, dst: int) -> None:
            """A sequence's state saved and loaded into another sequence (or itself)."""
            data = self.ctx.state_seq_get_data(src)  # type: ignore[union-attr]
            ops = []
            if self.kv is not None:
                n = len(self.kv.tokens(src))
                room = (
                    self.kv.n_free(dst) + len(self.kv.tokens(dst))
                    if not case.unified
                    else (self.kv.n_free(0) + sum(1 for t in self.kv.stream(0) if t.seqs == {dst}))
                )
                if n > room:
                    ops.append(self._raise)
                ops.append(lambda: self.kv.seq_load(src, dst))  # type: ignore[union-attr]
            if self.rs is not None:
                ops.append(lambda: self.rs.seq_load(src, dst))  # type: ignore[union-attr]
            self.seq_op(
                f"state_seq({src} -> {dst})", ops, lambda: self.ctx.state_seq_set_data(data, dst) and None
            )  # type: ignore[union-attr]

        @precondition(lambda self: self.ctx is not None)
        @rule(src=SEQS, dst=SEQS, cut=st.integers(1, 64), whole=st.booleans())
        def state_load_truncated(self, src: int, dst: int, cut: int, whole: bool) -> None:
            """A truncated state is refused and changes nothing."""
            if whole:
                data = self.ctx.state_get_data()  # type: ignore[union-attr]
                self.refused("a truncated state", lambda: self.ctx.state_set_data(data[:-cut]))  # type: ignore[union-attr]
            else:
                data = self.ctx.state_seq_get_data(src)  # type: ignore[union-attr]
                self.refused(
                    "a truncated sequence state", lambda: self.ctx.state_seq_set_data(data[:-cut], dst)
                )  # type: ignore[union-attr]

    return MemoryMachine


CASES = [Case(a, u) for a in KV_ARCHS + HYBRID_ARCHS + RECURRENT_ARCHS for u in (True, False)]
CI_EXAMPLES = {"llama": 20, "gemma3": 15, "granitehybrid": 10, "lfm2": 10}  # recurrent: 10


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.arch}-{'unified' if c.unified else 'split'}")
def test_memory_programs(models: dict[str, kvtool.Model], case: Case, request: pytest.FixtureRequest) -> None:
    long_run: int = request.config.getoption("property_examples")  # 0: the CI run
    n = long_run or CI_EXAMPLES.get(case.arch, 10)
    STATS.update(programs=0, steps=0, failed_ops=0, logit_checks=0)
    run_state_machine_as_test(
        machine(case),
        settings=settings(
            max_examples=n,
            stateful_step_count=15 if not long_run else 25,
            derandomize=not long_run,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        ),
    )
    if long_run:
        print(f"\n{case}: {STATS}")
