"""`kvtool bench`: llama-bench. Prompt processing (ppN), generation (tgN) and mixed (ppN+tgM)
speed over a sweep of parameters, each test repeated; md, csv, json or jsonl on stdout."""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

import kvtool
from kvtool.commands import app, common
from kvtool.commands.bench.logic import BenchTest, Instance, bench_tests, run_bench_test
from kvtool.commands.bench.report import Printer, record
from kvtool.commands.common.sizes import kv_size_lines
from kvtool.commands.common.values import INT_MAX, MAX_LIST, MAX_THREADS, parse_int_list
from kvtool.common import registry

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

err = common.text.lazy_console(stderr=True)


def _ints(text: list[str], flag: str, lo: int = 0, hi: int = INT_MAX) -> list[int]:
    try:
        values = [v for t in text for v in parse_int_list(t)]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from e
    if len(values) > MAX_LIST:
        raise typer.BadParameter(f"lists more than {MAX_LIST} values", param_hint=flag)
    if values and min(values) < lo:  # parse_int_list reads no negative number
        raise typer.BadParameter(f"must be >= {lo}, got {min(values)}", param_hint=flag)
    if values and max(values) > hi:
        raise typer.BadParameter(f"must be <= {hi}, got {max(values)}", param_hint=flag)
    return values


def _pairs(values: list[str]) -> list[tuple[int, int]]:
    out = []
    for v in values:
        parts = v.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise typer.BadParameter(f"expected PP,TG, got '{v}'", param_hint="-pg")
        out.append((int(parts[0]), int(parts[1])))
    return out


ListOpt = list[str] | None


def _phase_updater(
    progress: Progress, task: TaskID, label: str, reps: int
) -> tuple[Callable[[str, int], None], Callable[[int, int], None]]:
    """The spinner's text: the test, its phase and, within a long prompt, the tokens done."""
    now = [label]

    def phase(what: str, rep: int) -> None:
        now[0] = f"{label}: {f'run {rep}/{reps}' if what == 'run' else what}"
        progress.update(task, description=now[0])

    def tokens(done: int, total: int) -> None:
        progress.update(task, description=f"{now[0]} ({done}/{total} prompt tokens)")

    return phase, tokens


_DEFAULTS = {"n_batch": [2048], "n_ubatch": [512], "type_k": ["f16"], "type_v": ["f16"]}


def _params(inst: Instance, n_ctx: int, kv_unified: bool, swa_full: bool) -> kvtool.ContextParams:
    return kvtool.ContextParams(
        n_ctx=n_ctx,
        n_batch=inst.n_batch,
        n_ubatch=inst.n_ubatch,
        n_seq_max=1,
        kv_unified=kv_unified,
        swa_full=swa_full,
        type_k=inst.type_k,
        type_v=inst.type_v,
    )


def _context(
    m: kvtool.Model, inst: Instance, test: BenchTest, kv_unified: bool, swa_full: bool = False
) -> kvtool.Context:
    """A fresh context just large enough for the test, as llama-bench makes one per test."""
    return kvtool.Context(m, _params(inst, test.n_ctx, kv_unified, swa_full))


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
    type_k: Annotated[
        ListOpt, typer.Option("-ctk", "--cache-type-k", help=common.options.KV_TYPES_HELP + ".")
    ] = None,
    type_v: Annotated[
        ListOpt, typer.Option("-ctv", "--cache-type-v", help=common.options.KV_TYPES_HELP + ".")
    ] = None,
    threads: Annotated[ListOpt, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    reps: Annotated[
        int, typer.Option("-r", "--repetitions", help="Runs of each test.", callback=common.values.bounds(1))
    ] = 5,
    kv_unified: common.options.KvUnifiedOpt = False,
    swa_full: common.options.SwaFullOpt = False,
    device: common.options.DeviceOpt = None,
    list_devices: common.options.ListDevicesOpt = False,
    n_gpu_layers: common.options.NglOpt = None,
    weights: common.options.WeightsOpt = "auto",
    flash_attn: Annotated[
        ListOpt,
        typer.Option(
            "-fa", "--flash-attn", help="on or auto (kvtool's attention is always fused); off is refused."
        ),
    ] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="md, csv, json or jsonl.")] = "md",
    output_err: Annotated[
        str | None, typer.Option("-oe", "--output-err", help="Also print this format on stderr.")
    ] = None,
    no_warmup: Annotated[bool, typer.Option("--no-warmup", help="Skip the warmup runs.")] = False,
    seed: Annotated[int, typer.Option("-s", "--seed", help="Seed of the random tokens.")] = 1,
    no_progress: common.NoProgressOpt = False,
) -> None:
    """Benchmark prompt processing and generation (llama-bench).

    Comma lists, repeated flags and ranges (128-512*2) sweep the parameters."""
    for fmt, flag in ((output, "-o"), (output_err, "-oe")):
        if fmt is not None and fmt not in ("md", "csv", "json", "jsonl"):
            raise typer.BadParameter("md, csv, json or jsonl", param_hint=flag)
    models = [x for m in (model or [registry.DEFAULT_MODEL]) for x in m.split(",") if x]
    dev = common.gpu_layers_device(
        common.devices.device_setting(device, n_gpu_layers), device, n_gpu_layers, err
    )
    if dev != "cpu":  # the device first (llama-bench refuses a bad -dev while parsing)
        kvtool.resolve_device(dev)
    common.check_weights(weights)
    for name in models:  # every -m is a file or a known name before the first test runs
        if name not in registry.KNOWN_MODELS:
            registry.resolve_model(name, fetch=False)
    pp, tg, pg = _ints(n_prompt or ["512"], "-p"), _ints(n_gen or ["128"], "-n"), _pairs(n_pg or [])
    axes: dict[str, list[int] | list[str]] = {
        "n_batch": _ints(n_batch or ["2048"], "-b", 1),
        "n_ubatch": _ints(n_ubatch or ["512"], "-ub", 1),
        "type_k": [t for x in type_k or ["f16"] for t in x.split(",")],
        "type_v": [t for x in type_v or ["f16"] for t in x.split(",")],
        "n_threads": _ints(threads, "-t", 1, MAX_THREADS) if threads else [kvtool.set_n_threads()],
        "n_depth": _ints(n_depth or ["0"], "-d"),
    }
    for fa in flash_attn or []:
        for v in fa.split(","):
            common.options.check_flash_attn(v)
    instances = [[Instance(m, *v) for v in itertools.product(*axes.values())] for m in models]
    for inst in instances[0]:  # every value checked before the header is printed
        _params(inst, 1, kv_unified, swa_full).check()
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
        [(inst, t) for inst in insts for t in bench_tests(pp, tg, pg, inst.n_depth)] for insts in instances
    ]
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    n_jobs, done = sum(len(j) for j in per_model), 0
    for name, jobs in zip(models, per_model, strict=True):  # a model stays loaded for its tests
        m = common.load_model_with_status(
            name,
            common.progress_console(err, no_progress),
            dev,
            weights,
        )
        shown = common.progress_console(err, no_progress)
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            TimeElapsedColumn(),
            console=shown,
            transient=True,
            # off a terminal rich draws nothing, but each stop() of a display would still end
            # with a blank line between the table's rows (2>&1)
            disable=not shown.is_terminal,
            **common.timed_refresh(shown),
        ) as progress:
            task = progress.add_task("bench", total=len(jobs))
            # llama.cpp logs each context's KV size; once per size here, on stderr unless -oe
            # makes stderr a machine-read format
            shown_kv: set[str] = set()
            for inst, test in jobs:
                done += 1
                label = f"benchmark {done}/{n_jobs}: {test.name}"
                phase, tokens = _phase_updater(progress, task, label, reps)
                kvtool.set_n_threads(inst.n_threads)  # llama-bench sets each test's threads
                ctx = _context(m, inst, test, kv_unified, swa_full)
                for line in kv_size_lines(ctx) if output_err is None else []:
                    if line not in shown_kv:  # on stderr, above a live progress display
                        shown_kv.add(line)
                        (err if no_progress else progress.console).print(common.text.plain(line, "dim"))
                r = run_bench_test(ctx, test, reps, rng, not no_warmup, phase, tokens)
                rec = record(r, inst, m, kv_unified)  # once: every format shows the same test_time
                progress.stop()  # transient: the spinner leaves the terminal's line to the row
                for pr in printers:
                    pr.test(rec, test.name, r.samples_ns, r.samples_ts)
                progress.start()
                progress.advance(task)
    for pr in printers:
        pr.footer()
