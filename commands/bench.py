"""`kvtool bench`: llama-bench. Prompt processing (ppN), generation (tgN) and mixed (ppN+tgM)
speed over a sweep of parameters, each test repeated; md, csv, json or jsonl on stdout."""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, TextIO

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

import kvtool
from kvtool import (
    BenchResult,
    BenchTest,
    bench_tests,
    cpu_info,
    model_desc,
    parse_int_list,
    run_bench_test,
    threads_in_use,
)
from kvtool.commands import app
from kvtool.commands.common import KvUnifiedOpt, SwaFullOpt, load_model_with_status

err = Console(stderr=True, highlight=False, soft_wrap=True)

FIELDS = (
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "type_k",
    "type_v",
    "kv_unified",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
)
_INT = {"build_number", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "n_prompt"}
_INT |= {"n_gen", "n_depth", "avg_ns", "stddev_ns"}
_FLOAT = {"avg_ts", "stddev_ts"}
_BOOL = {"kv_unified"}
# Markdown column widths (negative: left-aligned) and names, as llama-bench prints them.
_WIDTH = {"model": -30, "size": 10, "params": 10, "backend": -10, "n_threads": 7, "n_batch": 7}
_WIDTH |= {"n_ubatch": 8, "type_k": 6, "type_v": 6, "kv_unified": 10, "test": 15, "t/s": 20}
_SHOWN = {"n_threads": "threads", "kv_unified": "kvu"}


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


def _version() -> str:
    try:
        return f"kvtool-{metadata.version('kvtool')}"
    except metadata.PackageNotFoundError:
        return "kvtool-dev"


def record(r: BenchResult, inst: Instance, m: kvtool.Model, kv_unified: bool) -> dict[str, object]:
    """The llama-bench fields kvtool has, typed (ints, bools, floats rounded as llama-bench's %f)."""
    return {
        "build_commit": _version(),
        "build_number": 0,
        "cpu_info": cpu_info(),
        "gpu_info": "",
        "backends": "CPU",
        "model_filename": str(m.path),
        "model_type": model_desc(m),
        "model_size": m.size_bytes(),
        "model_n_params": m.n_params(),
        "n_batch": inst.n_batch,
        "n_ubatch": inst.n_ubatch,
        "n_threads": inst.n_threads,
        "type_k": inst.type_k,
        "type_v": inst.type_v,
        "kv_unified": kv_unified,
        "n_prompt": r.test.n_prompt,
        "n_gen": r.test.n_gen,
        "n_depth": r.test.n_depth,
        "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "avg_ns": r.avg_ns,
        "stddev_ns": r.stddev_ns,
        "avg_ts": round(r.avg_ts, 6),
        "stddev_ts": round(r.stddev_ts, 6),
    }


def _csv_value(field: str, v: object) -> str:
    if field in _BOOL:
        s = str(int(bool(v)))
    elif field in _FLOAT:
        s = f"{v:.6f}"
    else:
        s = str(v)
    return '"' + s.replace('"', '""') + '"'


class Printer:
    """Writes tests as they finish, in one of llama-bench's formats."""

    def __init__(self, fmt: str, md_fields: list[str], file: TextIO) -> None:
        self.fmt = fmt
        self.file = file
        self.md_fields = md_fields
        self.first = True

    def _print(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.file, flush=True)

    def header(self) -> None:
        if self.fmt == "csv":
            self._print(",".join(FIELDS))
        elif self.fmt == "json":
            self._print("[")
        elif self.fmt == "md":
            self._print("|" + "".join(f" {_SHOWN.get(f, f):{_align(f)}} |" for f in self.md_fields))
            self._print(
                "|"
                + "".join(f" {'-' * (abs(_w(f)) - 1)}{':' if _w(f) > 0 else '-'} |" for f in self.md_fields)
            )

    def test(self, rec: dict[str, object], name: str, samples_ns: list[int], samples_ts: list[float]) -> None:
        if self.fmt == "csv":
            self._print(",".join(_csv_value(f, rec[f]) for f in FIELDS))
        elif self.fmt in ("json", "jsonl"):
            obj = {**rec, "samples_ns": samples_ns, "samples_ts": samples_ts}
            if self.fmt == "jsonl":
                self._print(json.dumps(obj, ensure_ascii=False))
            else:
                text = json.dumps(obj, indent=2, ensure_ascii=False).replace("\n", "\n  ")
                self._print(("" if self.first else ",\n") + "  " + text, end="")
        else:
            self._print(
                "|" + "".join(f" {_md_value(f, {**rec, 'test': name}):{_align(f)}} |" for f in self.md_fields)
            )
        self.first = False

    def footer(self) -> None:
        if self.fmt == "json":
            self._print("\n]")
        elif self.fmt == "md":
            self._print(f"\nbuild: {_version()}")


def _w(field: str) -> int:
    return _WIDTH.get(field, max(len(field), 10))


def _align(field: str) -> str:
    w = _w(field)
    return f"<{-w}" if w < 0 else f">{w}"


def _md_value(field: str, rec: dict[str, object]) -> str:
    size, n_params = int(rec["model_size"]), int(rec["model_n_params"])  # type: ignore[call-overload]
    if field == "model":
        return str(rec["model_type"])
    if field == "size":
        return f"{size / 2**20:.2f} MiB" if size < 2**30 else f"{size / 2**30:.2f} GiB"
    if field == "params":
        return f"{n_params / 1e6:.2f} M" if n_params < 1e9 else f"{n_params / 1e9:.2f} B"
    if field == "backend":
        return str(rec["backends"])
    if field == "test":
        return str(rec["test"])
    if field == "t/s":
        return f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f}"
    return str(int(rec[field])) if field in _BOOL else str(rec[field])  # type: ignore[call-overload]


def _ints(text: list[str], flag: str) -> list[int]:
    try:
        return [v for t in text for v in parse_int_list(t)]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from e


def _pairs(values: list[str]) -> list[tuple[int, int]]:
    out = []
    for v in values:
        parts = v.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise typer.BadParameter(f"expected PP,TG, got '{v}'", param_hint="-pg")
        out.append((int(parts[0]), int(parts[1])))
    return out


ListOpt = list[str] | None


def _phase_updater(progress: Progress, task: TaskID, label: str, reps: int) -> Callable[[str, int], None]:
    def phase(what: str, rep: int) -> None:
        progress.update(task, description=f"{label}: {f'run {rep}/{reps}' if what == 'run' else what}")

    return phase


_DEFAULTS = {"n_batch": [2048], "n_ubatch": [512], "type_k": ["f32"], "type_v": ["f32"]}


def _context(
    m: kvtool.Model, inst: Instance, test: BenchTest, kv_unified: bool, swa_full: bool = False
) -> kvtool.Context:
    """A fresh context just large enough for the test, as llama-bench makes one per test."""
    params = kvtool.ContextParams(
        n_ctx=test.n_ctx,
        n_batch=inst.n_batch,
        n_ubatch=inst.n_ubatch,
        n_seq_max=1,
        kv_unified=kv_unified,
        swa_full=swa_full,
        type_k=inst.type_k,
        type_v=inst.type_v,
    )
    import torch  # interim: threads are set by the command (the engine/tool split lands next)

    torch.set_num_threads(inst.n_threads)
    return kvtool.Context(m, params)


@app.command("bench")
def bench(
    model: Annotated[
        ListOpt, typer.Option("-m", "--model", help="Model name or GGUF path (repeatable).")
    ] = None,
    n_prompt: Annotated[ListOpt, typer.Option("-p", "--n-prompt", help="Prompt sizes (default 512).")] = None,
    n_gen: Annotated[ListOpt, typer.Option("-n", "--n-gen", help="Generation sizes (default 128).")] = None,
    n_pg: Annotated[ListOpt, typer.Option("-pg", help="PP,TG: a prompt then a generation.")] = None,
    n_depth: Annotated[ListOpt, typer.Option("-d", "--n-depth", help="Tokens in the KV cache first.")] = None,
    n_batch: Annotated[ListOpt, typer.Option("-b", "--batch-size", help="Logical batch sizes.")] = None,
    n_ubatch: Annotated[ListOpt, typer.Option("-ub", "--ubatch-size", help="Physical batch sizes.")] = None,
    type_k: Annotated[ListOpt, typer.Option("-ctk", "--cache-type-k", help="f32, f16, bf16.")] = None,
    type_v: Annotated[ListOpt, typer.Option("-ctv", "--cache-type-v", help="f32, f16, bf16.")] = None,
    threads: Annotated[ListOpt, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="Runs of each test.")] = 5,
    kv_unified: KvUnifiedOpt = False,
    swa_full: SwaFullOpt = False,
    output: Annotated[str, typer.Option("-o", "--output", help="md, csv, json or jsonl.")] = "md",
    output_err: Annotated[
        str | None, typer.Option("-oe", "--output-err", help="Also print this format on stderr.")
    ] = None,
    no_warmup: Annotated[bool, typer.Option("--no-warmup", help="Skip the warmup runs.")] = False,
    seed: Annotated[int, typer.Option("-s", "--seed", help="Seed of the random tokens.")] = 1,
) -> None:
    """Benchmark prompt processing and generation (llama-bench).

    Comma lists, repeated flags and ranges (128-512*2) sweep the parameters."""
    for fmt, flag in ((output, "-o"), (output_err, "-oe")):
        if fmt is not None and fmt not in ("md", "csv", "json", "jsonl"):
            raise typer.BadParameter("md, csv, json or jsonl", param_hint=flag)
    if reps < 1:
        raise typer.BadParameter("at least 1", param_hint="-r")
    models = [x for m in (model or [kvtool.DEFAULT_MODEL]) for x in m.split(",") if x]
    pp, tg, pg = _ints(n_prompt or ["512"], "-p"), _ints(n_gen or ["128"], "-n"), _pairs(n_pg or [])
    axes = {
        "n_batch": _ints(n_batch or ["2048"], "-b"),
        "n_ubatch": _ints(n_ubatch or ["512"], "-ub"),
        "type_k": [t for x in type_k or ["f32"] for t in x.split(",")],
        "type_v": [t for x in type_v or ["f32"] for t in x.split(",")],
        "n_threads": _ints(threads, "-t") if threads else [threads_in_use()],
        "n_depth": _ints(n_depth or ["0"], "-d"),
    }
    # like llama-bench, a column appears when its parameter is not at the default
    md_fields = ["model", "size", "params", "backend", "n_threads"]
    md_fields += [f for f, dflt in _DEFAULTS.items() if axes[f] != dflt]
    md_fields += (["kv_unified"] if kv_unified else []) + ["test", "t/s"]
    printers = [Printer(output, md_fields, sys.stdout)]
    if output_err is not None:
        printers.append(Printer(output_err, md_fields, sys.stderr))
    for pr in printers:
        pr.header()
    rng = random.Random(seed)
    per_model = [
        [(inst, t) for inst in insts for t in bench_tests(pp, tg, pg, inst.n_depth)]
        for insts in ([Instance(m, *v) for v in itertools.product(*axes.values())] for m in models)
    ]
    n_jobs, done = sum(len(j) for j in per_model), 0
    for name, jobs in zip(models, per_model, strict=True):  # a model stays loaded for its tests
        m = load_model_with_status(name, err)
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as progress:
            task = progress.add_task("bench", total=len(jobs))
            for inst, test in jobs:
                done += 1
                label = f"benchmark {done}/{n_jobs}: {test.name}"
                phase = _phase_updater(progress, task, label, reps)
                r = run_bench_test(
                    _context(m, inst, test, kv_unified, swa_full), test, reps, rng, not no_warmup, phase
                )
                for pr in printers:
                    pr.test(record(r, inst, m, kv_unified), test.name, r.samples_ns, r.samples_ts)
                progress.advance(task)
    for pr in printers:
        pr.footer()
