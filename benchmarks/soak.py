"""Soak: `kvtool parallel`'s engine path for a while, with random sequence operations between
its steps; checks that resident memory stays flat, that every cell comes back, and that nothing
fails.

    .venv/bin/python -m benchmarks.soak                  # 32 clients, 10 minutes, a tiny model
    .venv/bin/python -m benchmarks.soak --seconds 60 --split -m path/to/model.gguf

It runs `ParallelSim` (the simulation behind `kvtool parallel`: continuous batching, the
system prompt decoded once and copied to every client with -pps) in this process, in rounds of
`4 x clients` requests on one context until the time is up. Before each step (through the
`on_step` hook of `ParallelSim.run`) it may apply one random operation through the memory's
public API:

- on a live client's sequence: `seq_rm` of all of it (the client goes on from an empty
  sequence, as llama.cpp allows), `seq_rm` of its oldest positions (never the last one, which
  its next token continues), `seq_cp` of all or part of it to a scratch sequence;
- on a scratch sequence: `seq_rm` of all of it or of its newest positions.

Each operation is checked against what it must do (`seq_pos_min/max` before and after). The
chaos runs in-process through `on_step`, a callback parameter of `ParallelSim.run`, rather than
through `kvtool parallel` and a flag: the operations must know where each client is (the
position its next token takes), which only the simulation knows between two steps, and a
chaos flag has no place in a user's command. The simulation keeps a record of
every request it served, so each round starts a new one: a run of hours would otherwise grow
by its own records, which says nothing about the engine.

At the end of each round every client's sequence must hold the system prompt and nothing else;
then every sequence is removed one by one and the memory must hold no cell (a cell that no
sequence owns any more is a leak). Resident memory (/proc/self/status) is sampled every few
seconds. Verdict, each check failing the run (exit 1):

- rss: after the warm-up (default: the first fifth of the run), the samples are cut in two
  halves by time; the median anonymous RSS of the second half may exceed the median of the
  first by at most `--rss-slack` MB (default 4). The median, not the largest sample: a sample
  that lands on a step's transient buffers reads 10 to 30 MB above its neighbours at any time
  of the run, a leak moves the whole curve (the largest samples' difference is printed too).
  Anonymous memory (RssAnon + VmSwap) rather than VmRSS: VmRSS also counts the mapped pages of
  torch's shared libraries, which the kernel drops and reloads as the machine's other processes
  need memory (on the shared machine VmRSS fell by 140 MB within a minute while nothing was
  freed); a leak is anonymous memory. Both are printed;
- cells: every round ended with n_used == 0 and seq_pos_max == -1 for every sequence;
- errors: no exception, no operation that did not do what it must.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import kvtool
from kvtool.commands.parallel.prompts import QUESTIONS
from kvtool.commands.parallel.sim import ParallelParams, ParallelSim

SYSTEM = "A chat between a user and an assistant.\n"


@dataclass
class SoakParams:
    """The run's shape; defaults are issue 14's soak (32 clients, 10 minutes)."""

    seconds: float = 600.0
    n_clients: int = 32
    n_scratch: int = 4  # sequences after the clients' that only the chaos uses
    n_ctx: int = 8192
    n_predict: int = 16
    kv_unified: bool = True
    shared_system: bool = True  # -pps: clients share seq 0's system prompt cells
    p_op: float = 0.5  # chance of one random operation before a step
    sample_every: float = 5.0
    warmup: float | None = None  # seconds; None: a fifth of the run
    rss_slack_mb: float = 4.0
    seed: int = 0
    model: Path | None = None  # None: a tiny random llama written to a temporary folder
    threads: int | None = None


HEADER = " ".join(
    f"{h:>{w}}"
    for h, w in [
        ("t (s)", 8),
        ("RSS (MB)", 9),
        ("anon (MB)", 10),
        ("cells", 6),
        ("requests", 9),
        ("load", 5),
        ("py blocks", 10),
    ]
)


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the run started
    rss_mb: float  # VmRSS
    anon_mb: float  # RssAnon + VmSwap: what the process allocated, whatever the page cache does
    cells: int  # cells in use
    requests: int  # requests answered so far
    load: float  # the machine's 1-minute load average (the soak shares it with whatever runs)
    py_blocks: int  # memory blocks Python's allocator holds: objects that pile up show here

    def line(self) -> str:
        return (
            f"{self.t:8.1f} {self.rss_mb:9.1f} {self.anon_mb:10.1f} {self.cells:6d} {self.requests:9d} "
            f"{self.load:5.1f} {self.py_blocks:10d}"
        )


@dataclass
class SoakReport:
    params: SoakParams
    samples: list[Sample] = field(default_factory=list)
    ops: Counter[str] = field(default_factory=Counter)
    n_rounds: int = 0
    n_requests: int = 0
    n_cache_miss: int = 0
    n_ctx_seq: int = 0
    leaks: list[str] = field(default_factory=list)  # rounds that did not end with every cell free
    errors: list[str] = field(default_factory=list)

    @property
    def warmup(self) -> float:
        p = self.params
        return p.warmup if p.warmup is not None else p.seconds / 5

    def rss_growth_mb(self, stat: Callable[[list[float]], float] = statistics.median) -> float | None:
        """`stat` of the anonymous RSS samples of the second half after warm-up minus `stat` of the
        first half's; None: too few samples."""
        after = [s for s in self.samples if s.t >= self.warmup]
        if len(after) < 4:
            return None
        mid = (after[0].t + after[-1].t) / 2
        first = [s.anon_mb for s in after if s.t < mid]
        second = [s.anon_mb for s in after if s.t >= mid]
        if not first or not second:
            return None
        return stat(second) - stat(first)

    def checks(self) -> dict[str, bool]:
        growth = self.rss_growth_mb()
        return {
            "rss": growth is not None and growth <= self.params.rss_slack_mb,
            "cells": self.n_rounds > 0 and not self.leaks,
            "errors": not self.errors,
        }

    @property
    def ok(self) -> bool:
        return all(self.checks().values())


def memory_mb() -> tuple[float, float]:
    """This process's resident set (VmRSS) and anonymous memory (RssAnon + VmSwap), in MB."""
    kb = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmSwap"):
            kb[key] = int(value.split()[0])
    return kb["VmRSS"] / 1024, (kb["RssAnon"] + kb.get("VmSwap", 0)) / 1024


class Chaos:
    """Random sequence operations between steps, each checked against what it must do."""

    def __init__(self, ctx: kvtool.Context, sim: ParallelSim, scratch: list[int], report: SoakReport) -> None:
        self.mem = ctx.memory
        self.sim = sim
        self.scratch = scratch
        self.report = report
        self.rng = random.Random(report.params.seed + report.n_rounds)

    def range_of(self, s: int) -> tuple[int, int]:
        return self.mem.seq_pos_min(s), self.mem.seq_pos_max(s)

    def expect(self, op: str, got: tuple[int, int], want: tuple[int, int]) -> None:
        self.report.ops[op] += 1
        if got != want:
            self.report.errors.append(f"{op}: positions {got} after it, expected {want}")

    def __call__(self) -> None:
        if self.rng.random() >= self.report.params.p_op:
            return
        live = [c.kv_seq for c in self.sim.clients if c.seq >= 0 and self.mem.seq_pos_max(c.kv_seq) >= 0]
        full = [s for s in self.scratch if self.mem.seq_pos_max(s) >= 0]
        ops: list[Callable[[], None]] = []
        if live:
            s = self.rng.choice(live)
            ops += [lambda: self.rm_all(s), lambda: self.rm_head(s), lambda: self.cp(s)]
        if full:
            s = self.rng.choice(full)
            ops += [lambda: self.rm_all(s), lambda: self.rm_tail(s)]
        if ops:
            self.rng.choice(ops)()

    def rm_all(self, s: int) -> None:
        ok = self.mem.seq_rm(s, -1, -1)
        self.expect("seq_rm all" + (" (scratch)" if s in self.scratch else ""), self.range_of(s), (-1, -1))
        if not ok:
            self.report.errors.append(f"seq_rm({s}, -1, -1) refused")

    def rm_head(self, s: int) -> None:
        """Forgets the oldest positions of a live sequence; the last one stays (the client's next
        token continues it)."""
        lo, hi = self.range_of(s)
        p = self.rng.randint(lo + 1, hi) if hi > lo else hi
        ok = self.mem.seq_rm(s, -1, p)
        self.expect("seq_rm head", self.range_of(s), (p, hi))
        if not ok:
            self.report.errors.append(f"seq_rm({s}, -1, {p}) refused")

    def rm_tail(self, s: int) -> None:
        lo, hi = self.range_of(s)
        p = self.rng.randint(lo, hi)
        ok = self.mem.seq_rm(s, p, -1)
        self.expect("seq_rm tail (scratch)", self.range_of(s), (lo, p - 1) if p > lo else (-1, -1))
        if not ok:
            self.report.errors.append(f"seq_rm({s}, {p}, -1) refused")

    def cp(self, src: int) -> None:
        """Copies all or part of a live sequence into an emptied scratch sequence."""
        dst = self.rng.choice(self.scratch)
        self.mem.seq_rm(dst, -1, -1)
        lo, hi = self.range_of(src)
        if self.rng.random() < 0.5:
            self.mem.seq_cp(src, dst, -1, -1)
            self.expect("seq_cp all", self.range_of(dst), (lo, hi))
        else:
            p0 = self.rng.randint(lo, hi)
            p1 = self.rng.randint(p0 + 1, hi + 1)
            self.mem.seq_cp(src, dst, p0, p1)
            self.expect("seq_cp part", self.range_of(dst), (p0, p1 - 1))


def end_round(ctx: kvtool.Context, report: SoakReport, n_sys: int) -> None:
    """Checks what a round leaves, then frees every sequence one by one: no cell may remain."""
    p, mem = report.params, ctx.memory
    want = (0, n_sys - 1) if p.shared_system else (-1, -1)
    for c in range(1, p.n_clients + 1):
        got = (mem.seq_pos_min(c), mem.seq_pos_max(c))
        if got != want:
            report.leaks.append(f"round {report.n_rounds}: client seq {c} holds {got}, expected {want}")
    for s in range(ctx.params.n_seq_max):
        mem.seq_rm(s, -1, -1)
    held = [s for s in range(ctx.params.n_seq_max) if mem.seq_pos_max(s) >= 0]
    if ctx.n_used_cells() or held:
        report.leaks.append(f"round {report.n_rounds}: {ctx.n_used_cells()} cells in use, seqs {held}")


def soak(p: SoakParams, log: Callable[[Sample], None] | None = None) -> SoakReport:
    """Runs the soak; `log` sees every sample as it is taken."""
    prev = kvtool.set_n_threads(p.threads)
    try:
        if p.model is not None:
            return _run(p, kvtool.Model(p.model), log)
        from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama  # a checkout's helper

        with tempfile.TemporaryDirectory() as tmp:
            path = write_tiny_llama(Path(tmp) / "tiny-llama.gguf", TinyLlama(n_ctx_train=p.n_ctx))
            return _run(p, kvtool.Model(path), log)
    finally:
        kvtool.set_n_threads(prev)  # a caller in the same process (a test) keeps its threads


def _run(p: SoakParams, model: kvtool.Model, log: Callable[[Sample], None] | None) -> SoakReport:
    report = SoakReport(p)
    n_seq_max = p.n_clients + 1 + p.n_scratch
    cp = kvtool.ContextParams(n_ctx=p.n_ctx, n_seq_max=n_seq_max, kv_unified=p.kv_unified)
    with warnings.catch_warnings():  # an n_ctx that does not split evenly: the report gives n_ctx_seq
        warnings.simplefilter("ignore", UserWarning)
        ctx = kvtool.Context(model, cp)
    report.n_ctx_seq = ctx.n_ctx_seq
    scratch = list(range(p.n_clients + 1, n_seq_max))
    params = ParallelParams(
        p.n_clients,
        4 * p.n_clients,
        p.n_predict,
        shared_system=p.shared_system,
        system=SYSTEM,
        prompts=QUESTIONS,
        sampler=kvtool.SamplerParams(seed=p.seed),
    )
    t0 = time.perf_counter()
    next_sample = 0.0

    def sample(done: int) -> None:
        nonlocal next_sample
        s = Sample(
            time.perf_counter() - t0,
            *memory_mb(),
            ctx.n_used_cells(),
            done,
            os.getloadavg()[0],
            sys.getallocatedblocks(),
        )
        report.samples.append(s)
        next_sample = s.t + p.sample_every
        if log is not None:
            log(s)

    sample(0)
    while time.perf_counter() - t0 < p.seconds and not report.errors:
        params.prompt_seed = p.seed + report.n_rounds
        sim = ParallelSim(ctx, params)
        chaos = Chaos(ctx, sim, scratch, report)
        done = report.n_requests

        def step(sim: ParallelSim = sim, chaos: Chaos = chaos, done: int = done) -> None:
            chaos()
            if time.perf_counter() - t0 >= next_sample:
                sample(done + len(sim.records))

        try:
            summary = sim.run(on_step=step)
        except Exception as e:  # the verdict reports it; the traceback goes to stderr
            traceback.print_exc()
            report.errors.append(f"round {report.n_rounds}: {type(e).__name__}: {e}")
            break
        report.n_requests += len(summary.records)
        report.n_cache_miss += summary.n_cache_miss
        end_round(ctx, report, len(sim.system_tokens))
        report.n_rounds += 1
    sample(report.n_requests)
    return report


def print_report(r: SoakReport) -> None:
    p = r.params
    print(
        f"soak: {p.n_clients} clients, {r.n_rounds} rounds, {r.n_requests} requests, "
        f"{r.n_cache_miss} cache misses, kv_unified = {int(p.kv_unified)}, n_ctx = {p.n_ctx}, "
        f"n_ctx_seq = {r.n_ctx_seq}"
    )
    print("operations: " + ", ".join(f"{k} {v}" for k, v in sorted(r.ops.items())))
    growth, peak = r.rss_growth_mb(), r.rss_growth_mb(max)
    if growth is None or peak is None:
        print(f"anonymous RSS after warm-up ({r.warmup:.0f} s): n/a (too few samples)")
    else:
        print(
            f"anonymous RSS after warm-up ({r.warmup:.0f} s), second half - first half: "
            f"median {growth:+.1f} MB, max {peak:+.1f} MB"
        )
    for line in r.leaks[:5] + r.errors[:5]:
        print(f"  {line}")
    checks = r.checks()
    print("verdict: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))


def plot(r: SoakReport, path: Path) -> None:
    """The curve as a PNG: memory (MB) and cells in use over time, the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in r.samples]
    fig, mem = plt.subplots(figsize=(8, 3.6), dpi=110)
    mem.plot(t, [s.rss_mb for s in r.samples], label="VmRSS (MB)", color="tab:gray")
    mem.plot(t, [s.anon_mb for s in r.samples], label="anonymous RSS (MB)", color="tab:blue")
    mem.axvspan(0, r.warmup / 60, color="0.92", label="warm-up")
    mem.set_xlabel("minutes")
    mem.set_ylabel("MB")
    mem.set_ylim(0, max(s.rss_mb for s in r.samples) * 1.15)
    cells = mem.twinx()
    cells.plot(t, [s.cells for s in r.samples], color="tab:orange", lw=0.6, alpha=0.6, label="cells in use")
    cells.set_ylabel("cells in use")
    cells.set_ylim(0, r.params.n_ctx)
    lines = mem.get_legend_handles_labels()
    more = cells.get_legend_handles_labels()
    mem.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    p = r.params
    mode = "unified" if p.kv_unified else "split"
    mem.set_title(f"soak: {p.n_clients} clients, {mode} KV, {r.n_requests} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SoakParams()
    ap.add_argument("--seconds", type=float, default=d.seconds)
    ap.add_argument("-np", "--clients", type=int, default=d.n_clients)
    ap.add_argument("-c", "--ctx-size", type=int, default=d.n_ctx)
    ap.add_argument("-n", "--n-predict", type=int, default=d.n_predict)
    ap.add_argument("--split", action="store_true", help="one KV stream per sequence (default: unified)")
    ap.add_argument("--no-pps", action="store_true", help="each request decodes the system prompt")
    ap.add_argument("--every", type=float, default=d.sample_every, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=float, default=None, help="seconds (default: a fifth of the run)")
    ap.add_argument("--rss-slack", type=float, default=d.rss_slack_mb, help="MB")
    ap.add_argument("-s", "--seed", type=int, default=d.seed)
    ap.add_argument("-m", "--model", type=Path, default=None, help="a GGUF (default: a tiny random llama)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="write the curve to this PNG")
    a = ap.parse_args(argv)
    if a.seconds <= 0 or a.clients < 1 or a.every <= 0:
        ap.error("need --seconds > 0, --clients >= 1, --every > 0")
    p = SoakParams(
        seconds=a.seconds,
        n_clients=a.clients,
        n_ctx=a.ctx_size,
        n_predict=a.n_predict,
        kv_unified=not a.split,
        shared_system=not a.no_pps,
        sample_every=a.every,
        warmup=a.warmup,
        rss_slack_mb=a.rss_slack,
        seed=a.seed,
        model=a.model,
        threads=a.threads,
    )
    print(HEADER, flush=True)
    report = soak(p, lambda s: print(s.line(), flush=True))
    print_report(report)
    if a.plot is not None and report.samples:
        plot(report, a.plot)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
