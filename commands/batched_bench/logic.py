"""The measuring logic behind `kvtool batched-bench` (llama-batched-bench): B sequences, each
with a PP-token prompt (or one shared prompt copied with seq_cp), then TG steps of one token per
sequence. Printing lives in the command; this is testable without the CLI."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import kvtool


@dataclass(frozen=True)
class BatchedResult:
    """One row of llama-batched-bench: PP prompt tokens, TG steps, B sequences."""

    pp: int
    tg: int
    pl: int
    pps: bool
    n_kv: int
    t_pp: float
    t_tg: float

    @property
    def t(self) -> float:
        return self.t_pp + self.t_tg

    @property
    def speed_pp(self) -> float:
        return (self.pp if self.pps else self.pl * self.pp) / self.t_pp if self.t_pp > 0 else 0.0

    @property
    def speed_tg(self) -> float:
        return self.pl * self.tg / self.t_tg if self.t_tg > 0 else 0.0

    @property
    def speed(self) -> float:
        n = (self.pp if self.pps else self.pl * self.pp) + self.pl * self.tg
        return n / self.t if self.t > 0 else 0.0


def batched_n_kv(pp: int, tg: int, pl: int, pps: bool, unified: bool) -> int:
    """Cells the run needs (llama.cpp's n_ctx_req): a shared prompt is stored once in a unified
    cache but once per stream in split mode, where seq_cp copies it into each stream."""
    if pps:
        return (pp if unified else pl * pp) + pl * tg
    return pl * (pp + tg)


def batched_skip_reason(ctx: kvtool.Context, pp: int, tg: int, pl: int, pps: bool) -> str | None:
    """Why the combination cannot run in this context, or None if it fits."""
    unified = ctx.params.kv_unified
    need = batched_n_kv(pp, tg, pl, pps, unified)
    if need > ctx.n_ctx:
        return f"needs {need} cells, n_ctx = {ctx.n_ctx}"
    if pl > ctx.params.n_seq_max:
        return f"B = {pl} > n_seq_max = {ctx.params.n_seq_max}"
    if not unified and pp + tg > ctx.n_ctx_seq:
        return f"needs {pp + tg} cells per sequence, each stream holds {ctx.n_ctx_seq}"
    return None


def batched_warmup(ctx: kvtool.Context, rng: random.Random) -> None:
    """16 random tokens on sequence 0, as llama-batched-bench warms up."""
    ctx.clear()
    b = kvtool.Batch()
    for i in range(16):
        b.add(rng.randrange(ctx.model.n_vocab), i, (0,), False)
    kvtool.decode_batch(ctx, b)


def batched_run(
    ctx: kvtool.Context, pp: int, tg: int, pl: int, pps: bool, rng: random.Random, tg_separate: bool = False
) -> BatchedResult:
    """Prompt phase: pl prompts of pp random tokens (or one, copied to every sequence with
    seq_cp after the clock stops, when `pps`). Generation phase: tg steps of one token per
    sequence in one batch (or each sequence alone, `tg_separate`)."""
    n_vocab = ctx.model.n_vocab
    b = kvtool.Batch()
    for s in range(1 if pps else pl):
        for i in range(pp):
            b.add(rng.randrange(n_vocab), i, (s,), i == pp - 1)
    ctx.clear()
    t0 = time.perf_counter()
    kvtool.decode_batch(ctx, b)
    t_pp = time.perf_counter() - t0
    if pps:
        for s in range(1, pl):
            ctx.memory.seq_cp(0, s, -1, -1)
    t0 = time.perf_counter()
    if tg_separate:
        for s in range(pl):
            for i in range(tg):
                kvtool.decode_batch(ctx, kvtool.Batch([rng.randrange(n_vocab)], [pp + i], [(s,)], [True]))
    else:
        for i in range(tg):
            step = kvtool.Batch()
            for s in range(pl):
                step.add(rng.randrange(n_vocab), pp + i, (s,), True)
            kvtool.decode_batch(ctx, step)
    t_tg = time.perf_counter() - t0
    n_kv = batched_n_kv(pp, tg, pl, pps, ctx.params.kv_unified)
    return BatchedResult(pp, tg, pl, pps, n_kv, t_pp, t_tg)
