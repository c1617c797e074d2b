"""`kvtool defrag-sim`: replays a KV workload on the cell bookkeeping alone (no model) under
each slot policy and compares failed allocations, attention spent on holes and compaction
cost. See docs/defrag.md."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

import kvtool
from kvtool.commands import app
from kvtool.commands.common.options import NoProgressOpt, TypeKOpt, TypeVOpt
from kvtool.commands.common.text import console, plain
from kvtool.commands.common.values import bounds
from kvtool.commands.defrag_sim.names import POLICIES
from kvtool.common import files, registry

if TYPE_CHECKING:  # the simulator loads numpy: imported when the verb runs, not for --help
    from kvtool.commands.defrag_sim.report import Cost
    from kvtool.commands.defrag_sim.simulator import SimResult
    from kvtool.commands.defrag_sim.workload import LengthDist, Workload

MAX_SEQ = 64  # KVCells' sequence bitset
PNG = files.FileKind("a PNG image", rb"\x89PNG", "the figure")
# what one run simulates at most: its memory grows with each (numpy arrays per cell and per
# step, Python objects per request)
MAX_CELLS = 1 << 20
MAX_REQUESTS = 200_000
MAX_STEPS = 10_000_000


def _len_dist(text: str, flag: str) -> LengthDist:
    from kvtool.commands.defrag_sim.workload import LengthDist

    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from None


def _check(ok: bool, msg: str, flag: str) -> None:
    if not ok:
        raise typer.BadParameter(msg, param_hint=flag)


@app.command("defrag-sim")
def defrag_sim(
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Replay a trace from `kvtool parallel --trace` (JSON lines)."),
    ] = None,
    clients: Annotated[
        int,
        typer.Option(
            "--clients", help="Synthetic: parallel clients (sequences).", callback=bounds(1, MAX_SEQ)
        ),
    ] = 32,
    requests: Annotated[
        int,
        typer.Option("--requests", help="Synthetic: requests in total.", callback=bounds(1, MAX_REQUESTS)),
    ] = 1000,
    arrival: Annotated[
        str, typer.Option("--arrival", help="Synthetic: closed (a free client starts at once) or poisson.")
    ] = "closed",
    rate: Annotated[
        float,
        typer.Option(
            "--rate", help="Synthetic, poisson: requests per decode step.", callback=bounds(0.0, lo_open=True)
        ),
    ] = 0.5,
    prompt_len: Annotated[
        str,
        typer.Option(
            "--prompt-len", help="Synthetic: prompt tokens, N or KIND:MEAN (fixed|uniform|exp|lognormal)."
        ),
    ] = "lognormal:300",
    gen_len: Annotated[
        str, typer.Option("--gen-len", help="Synthetic: generated tokens, as --prompt-len.")
    ] = "exp:200",
    n_ctx: Annotated[
        int | None,
        typer.Option(
            "-c",
            "--ctx-size",
            "--n-ctx",
            help="KV cells in all (default: the trace's, else 32768).",
            callback=bounds(1, MAX_CELLS),
        ),
    ] = None,
    seed: Annotated[int, typer.Option("-s", "--seed", help="Synthetic: the workload's seed.")] = 42,
    ubatch: Annotated[
        int | None,
        typer.Option(
            "-ub",
            "--ubatch-size",
            help="Tokens per ubatch (default: the trace's, else 512).",
            callback=bounds(1),
        ),
    ] = None,
    kv_unified: Annotated[
        bool | None,
        typer.Option(
            "--kv-unified/--no-kv-unified",
            "-kvu/-no-kvu",
            help="One KV buffer shared by all sequences (default; a trace: as it was recorded), "
            "or one stream each.",
        ),
    ] = None,
    policy: Annotated[
        list[str] | None, typer.Option("--policy", help=f"Only these (repeat): {', '.join(POLICIES)}.")
    ] = None,
    defrag_thold: Annotated[
        float,
        typer.Option(
            "--defrag-thold",
            "-dt",
            help="threshold: compact when holes exceed this part of the span.",
            callback=bounds(0.0, 1.0, hi_open=True),
        ),
    ] = 0.1,
    max_moves: Annotated[
        int, typer.Option("--max-moves", help="Block moves per compaction pass.", callback=bounds(1))
    ] = 256,
    page_size: Annotated[
        int, typer.Option("--page-size", help="paged: cells per page.", callback=bounds(1))
    ] = 16,
    model: Annotated[
        str | None,
        typer.Option(
            "-m",
            "--model",
            help="Count bytes moved for this model (reads its GGUF header only, or loads it for --replay).",
        ),
    ] = None,
    type_k: TypeKOpt = "f16",
    type_v: TypeVOpt = "f16",
    copy_bw: Annotated[
        float | None,
        typer.Option(
            "--copy-bw",
            help="Copy bandwidth in GB/s for move time (default: measured).",
            callback=bounds(0.0, lo_open=True),
        ),
    ] = None,
    replay: Annotated[
        bool,
        typer.Option("--replay", help="Run the first compaction on a real cache of -m and check the logits."),
    ] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the figure to this PNG.")] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="md, csv or json.")] = "md",
    no_progress: NoProgressOpt = False,
) -> None:
    """Compare KV slot policies on a workload (no model: cell bookkeeping only).

    The default is one KV buffer shared by the clients (-kvu), where their requests leave holes
    between each other's cells; with -no-kvu each client has its own stream, holds one request
    at a time, and the policies seldom differ."""
    from kvtool.commands.defrag_sim.policies import Policy
    from kvtool.commands.defrag_sim.report import render, rows
    from kvtool.commands.defrag_sim.simulator import Geometry, simulate, split_ops

    _check(output in ("md", "csv", "json"), "expected md, csv or json", "-o")
    names = list(policy or POLICIES)
    bad = [p for p in names if p not in POLICIES]
    _check(not bad, f"unknown policy {', '.join(bad)} (choose from {', '.join(POLICIES)})", "--policy")
    _check(plot is None or plot.suffix.lower() == ".png", "the figure is a .png file", "--plot")
    if plot is not None:  # before the simulation: a figure it cannot write is one line now
        files.check_writable(plot, PNG)
    w, n_ctx, n_ub, recorded = _workload(
        trace, clients, requests, arrival, rate, prompt_len, gen_len, n_ctx, seed, ubatch
    )
    kv_unified = recorded if kv_unified is None else kv_unified
    _check(n_ctx >= w.n_seq, f"{n_ctx} cells cannot hold {w.n_seq} streams", "-c")
    _check(n_ctx <= MAX_CELLS, f"the trace's {n_ctx} cells are more than {MAX_CELLS} (set -c)", "--trace")
    _check(
        w.n_steps <= MAX_STEPS,
        f"the workload runs {w.n_steps:,} decode steps, more than {MAX_STEPS:,} "
        "(fewer requests or shorter answers)",
        "--trace" if trace is not None else "--requests",
    )
    _check(n_ub >= 1, "must be >= 1", "-ub")
    geo = Geometry(n_ctx, w.n_seq, kv_unified, n_ub)
    _check(
        page_size <= geo.stream_size,
        f"a page is larger than a stream ({geo.stream_size} cells)",
        "--page-size",
    )
    _check(not replay or model is not None, "needs -m MODEL", "--replay")
    cost = _cost(model, copy_bw, type_k, type_v)

    t0, c0 = time.perf_counter(), time.process_time()
    per_seq = None if kv_unified else split_ops(w)
    n_map = 240 if plot is not None else 0
    shown = console(stderr=True)
    status = shown.status("", spinner="dots") if shown.is_terminal and not no_progress else None
    if status is not None:
        status.start()
    try:
        results: list[SimResult] = []
        for i, p in enumerate(names):
            if status is not None:
                status.update(plain(f"simulating {p} ({i + 1}/{len(names)} policies)"))
            results.append(simulate(w, Policy(p, defrag_thold, max_moves, page_size), geo, n_map, per_seq))
    finally:
        if status is not None:
            status.stop()
    print(
        f"defrag-sim: {w.n_requests} requests, {w.n_steps} decode steps, {len(names)} policies in "
        f"{time.perf_counter() - t0:.2f} s ({time.process_time() - c0:.2f} s CPU)",
        file=sys.stderr,
    )

    streams = "unified: 1 stream" if kv_unified else f"split: {geo.n_stream} streams"
    info: dict[str, Any] = {
        "workload": w.name,
        "kv": f"{streams} of {geo.stream_size} cells, n_ubatch {n_ub}",
        "policy settings": f"defrag-thold {defrag_thold}, max-moves {max_moves}, page-size {page_size}",
    }
    if cost is not None:
        info["bytes"] = f"{cost.model}: {cost.cell_bytes} B per cell (K {type_k} + V {type_v}, all layers)"
        info["copy bandwidth"] = f"{cost.copy_bw / 1e9:.2f} GB/s ({cost.bw_source})"
    sys.stdout.write(render(output, rows(results, cost), info))
    if replay:
        assert model is not None
        _replay(model, results, max_moves, type_k, type_v)
    if plot is not None:
        from kvtool.commands.defrag_sim.plot import plot as draw

        with (
            shown.status(plain(f"drawing {plot}"), spinner="dots")
            if shown.is_terminal and not no_progress
            else contextlib.nullcontext()
        ):
            files.write_file(plot, draw(results, f"{w.name}; {info['kv']}"), PNG)
        print(f"defrag-sim: figure written to {plot}", file=sys.stderr)


def _replay(model: str, results: list[SimResult], max_moves: int, type_k: str, type_v: str) -> None:
    from kvtool.commands.common import load_model_with_status
    from kvtool.commands.common.text import console
    from kvtool.commands.defrag_sim.replay import MAX_CELLS, replay

    hit = next((r for r in results if r.first_compaction is not None), None)
    if hit is None or hit.first_compaction is None:
        raise kvtool.KvtoolError("--replay: no policy compacted in this workload (try threshold or on-fail)")
    cells = hit.first_compaction
    if cells.size > MAX_CELLS:
        raise kvtool.KvtoolError(
            f"--replay: a stream of {cells.size} cells is too large (-c: at most {MAX_CELLS})"
        )
    m = load_model_with_status(model, console(stderr=True))
    r = replay(m, cells, max_moves, type_k, type_v)
    same = "equal" if r.bitwise else "DIFFER from"
    print(
        f"replay ({hit.policy.name}, {Path(str(m.path)).name}): {r.n_moves} moves in {r.n_passes} "
        f"passes over {r.n_cells} cells; logits after compaction {same} a cache built in the "
        f"compacted layout (bitwise); max |diff| against before compaction {r.max_diff:.1e}"
    )
    if not r.bitwise:
        raise typer.Exit(1)


def _workload(
    trace: Path | None,
    clients: int,
    requests: int,
    arrival: str,
    rate: float,
    prompt_len: str,
    gen_len: str,
    n_ctx: int | None,
    seed: int,
    ubatch: int | None,
) -> tuple[Workload, int, int, bool]:
    """The workload, n_ctx, n_ubatch, and the layout it was recorded with (synthetic: unified)."""
    from kvtool.commands.defrag_sim.trace import TraceError, read_trace
    from kvtool.commands.defrag_sim.workload import SyntheticParams, synthetic

    if trace is not None:
        try:
            w, header = read_trace(trace)
        except TraceError as e:
            raise typer.BadParameter(str(e), param_hint="--trace") from None
        _check(w.n_seq <= MAX_SEQ, f"at most {MAX_SEQ} sequences", "--trace")
        n_ub = ubatch or header.get("n_ubatch", 512)
        _check(
            isinstance(n_ub, int) and n_ub >= 1, "the header's n_ubatch is not a positive integer", "--trace"
        )
        return w, n_ctx or int(header["n_ctx"]), n_ub, bool(header.get("kv_unified", True))
    _check(arrival in ("closed", "poisson"), "expected closed or poisson", "--arrival")
    n = n_ctx or 32768
    p = SyntheticParams(
        clients,
        requests,
        arrival,
        rate,
        _len_dist(prompt_len, "--prompt-len"),
        _len_dist(gen_len, "--gen-len"),
        n,
        seed,
    )
    return synthetic(p), n, ubatch or 512, True


def _cost(model: str | None, copy_bw: float | None, type_k: str, type_v: str) -> Cost | None:
    from kvtool.commands.defrag_sim.report import Cost, measure_copy_bw

    if model is None:
        return None
    path = registry.resolve_model(model)
    from kvtool.common.cells import read_kv_dims  # numpy, torch: only with -m

    dims = read_kv_dims(path)
    bw, src = (
        (copy_bw * 1e9, "given")
        if copy_bw is not None
        else (measure_copy_bw(), "measured: numpy memcpy here")
    )
    return Cost(dims.cell_bytes(type_k, type_v), bw, f"{path.name} ({dims.arch}, {dims.n_layer} layers)", src)
