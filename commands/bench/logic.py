"""The measuring logic behind `kvtool bench` (llama-bench): random tokens, timed decodes, and
the numbers of its reports. Printing lives in report.py; this is testable without the CLI."""

from __future__ import annotations

import math
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import kvtool


def cpu_info() -> str:
    """The CPU's model name, as llama-bench reports it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def first_token(model: kvtool.Model, rng: random.Random) -> int:
    """BOS when the model adds one (as llama-bench starts each prompt), else a random token."""
    bos = model.tokenize("", add_special=True)
    return bos[0] if bos else rng.randrange(model.n_vocab)


# -- llama-bench --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instance:
    """One parameter set of the sweep (what llama-bench calls a cmd_params_instance)."""

    model: str
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    n_threads: int
    n_depth: int


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench test: a prompt of n_prompt and/or n_gen generated tokens after n_depth."""

    n_prompt: int
    n_gen: int
    n_depth: int = 0

    @property
    def name(self) -> str:
        if self.n_gen == 0:
            s = f"pp{self.n_prompt}"
        elif self.n_prompt == 0:
            s = f"tg{self.n_gen}"
        else:
            s = f"pp{self.n_prompt}+tg{self.n_gen}"
        return s + (f" @ d{self.n_depth}" if self.n_depth > 0 else "")

    @property
    def n_ctx(self) -> int:
        return self.n_prompt + self.n_gen + self.n_depth


def bench_tests(
    n_prompt: list[int], n_gen: list[int], n_pg: list[tuple[int, int]], depth: int
) -> list[BenchTest]:
    """llama-bench's order for one parameter set: prompt tests, generation tests, then pp+tg pairs."""
    tests = [BenchTest(p, 0, depth) for p in n_prompt if p > 0]
    tests += [BenchTest(0, g, depth) for g in n_gen if g > 0]
    tests += [BenchTest(p, g, depth) for p, g in n_pg if p > 0 or g > 0]
    return tests


def run_prompt(
    ctx: kvtool.Context,
    n_prompt: int,
    rng: random.Random,
    on_tokens: Callable[[int, int], None] | None = None,
) -> None:
    """Decodes n_prompt random tokens on sequence 0 after its last position, in n_batch chunks
    (the same decodes as decode_tokens), telling `on_tokens(done, total)` after each."""
    toks = [first_token(ctx.model, rng)] + [rng.randrange(ctx.model.n_vocab) for _ in range(n_prompt - 1)]
    pos0 = ctx.memory.seq_pos_max(0) + 1
    if pos0 + n_prompt > ctx.n_ctx_seq:
        kvtool.decode_tokens(ctx, toks, 0, pos0)  # raises ContextFullError before decoding
    for i in range(0, n_prompt, ctx.n_batch):
        chunk = toks[i : i + ctx.n_batch]
        last = i + len(chunk) == n_prompt
        ctx.decode(
            kvtool.Batch.from_tokens(chunk, seq_id=0, pos0=pos0 + i, logits="last" if last else "none")
        )
        if on_tokens is not None:
            on_tokens(i + len(chunk), n_prompt)


def run_gen(ctx: kvtool.Context, n_gen: int, rng: random.Random) -> None:
    """Decodes n_gen single random tokens on sequence 0, one decode each."""
    tok = first_token(ctx.model, rng)
    for _ in range(n_gen):
        ctx.decode(kvtool.Batch.from_tokens([tok], seq_id=0, pos0=None, logits="last"))
        tok = rng.randrange(ctx.model.n_vocab)


@dataclass
class BenchResult:
    """The samples of one test; t/s per sample is (n_prompt + n_gen) / seconds, as llama-bench."""

    test: BenchTest
    samples_ns: list[int] = field(default_factory=list)

    @property
    def samples_ts(self) -> list[float]:
        n = self.test.n_prompt + self.test.n_gen
        return [1e9 * n / t for t in self.samples_ns]

    @property
    def avg_ns(self) -> int:
        return sum(self.samples_ns) // len(self.samples_ns) if self.samples_ns else 0

    @property
    def stddev_ns(self) -> int:
        return int(stdev([float(x) for x in self.samples_ns]))

    @property
    def avg_ts(self) -> float:
        ts = self.samples_ts
        return sum(ts) / len(ts) if ts else 0.0

    @property
    def stddev_ts(self) -> float:
        return stdev(self.samples_ts)


def stdev(xs: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for fewer than two samples."""
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(max(0.0, sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)))


def run_bench_test(
    ctx: kvtool.Context,
    test: BenchTest,
    reps: int,
    rng: random.Random,
    warmup: bool = True,
    on_phase: Callable[[str, int], None] | None = None,
    on_tokens: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """llama-bench's loop for one test: a warmup, then `reps` timed runs, each on a memory that
    holds only the n_depth prefix. The prefix is decoded once (untimed) and later runs cut the
    memory back to it, which leaves the same cells as llama-bench's saved-state restore."""
    phase = on_phase or (lambda _name, _rep: None)
    if warmup:
        phase("warmup", 0)
        if test.n_prompt > 0:
            run_prompt(ctx, test.n_prompt, rng, on_tokens)
        if test.n_gen > 0:
            run_gen(ctx, 1, rng)
    ctx.clear()
    if test.n_depth > 0:
        phase("depth", 0)
        run_prompt(ctx, test.n_depth, rng, on_tokens)
    result = BenchResult(test)
    for rep in range(reps):
        if test.n_depth > 0:
            ctx.memory.seq_rm(0, test.n_depth, -1)
        else:
            ctx.clear()
        phase("run", rep + 1)
        t0 = time.perf_counter_ns()
        if test.n_prompt > 0:
            run_prompt(ctx, test.n_prompt, rng, on_tokens)
        if test.n_gen > 0:
            run_gen(ctx, test.n_gen, rng)
        result.samples_ns.append(time.perf_counter_ns() - t0)
    return result
