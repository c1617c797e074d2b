"""`kvtool parallel`: llama-parallel. Simulates -np clients sending -ns requests to a server,
served here by one context with continuous batching, or by a remote OpenAI-compatible
endpoint (--server URL)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeAlias

import typer
from rich import box
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

import kvtool
from kvtool.commands import app, common
from kvtool.commands.defrag_sim.names import TRACE_KIND
from kvtool.commands.parallel.http import HttpParallelSim, check_server
from kvtool.commands.parallel.prompts import MAX_JUNK, QUESTIONS, SYSTEM_PROMPT, read_prompts
from kvtool.commands.parallel.sim import Client, ParallelParams, ParallelSim, ParallelSummary, RequestRecord
from kvtool.common import files

if TYPE_CHECKING:
    from kvtool.commands.defrag_sim.trace import TraceRecorder

err = common.text.console(stderr=True)
out = common.text.console()

Sim: TypeAlias = ParallelSim | HttpParallelSim


def _view(sim: Sim, total: int) -> Group:
    """The live view: progress, speed and what each client is doing."""
    el = max(sim.now(), 1e-9)
    head = Text(
        f"requests {len(sim.records)}/{total}   {sim.n_tokens / el:.1f} t/s   "
        f"cache misses {sim.n_cache_miss}   {el:.1f} s",
        style="bold",
    )
    table = Table(box=box.SIMPLE, pad_edge=False)
    for col in ("client", "request", "phase", "tokens"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for st in sim.status():
        idle = st.seq < 0
        table.add_row(
            str(st.client), "-" if idle else str(st.seq), st.phase, "-" if idle else str(st.n_decoded)
        )
    return Group(head, table)


def _started(c: Client) -> None:
    line = (
        f"Client {c.id:3d}, seq {c.seq:4d}, junk = {c.n_junk:4d}, prompt = {c.n_prompt}, started decoding ..."
    )
    out.print(Text(line, style="red"))


def _missed(n_batch: int) -> None:
    err.print(f"parallel: no KV cells for the batch, retrying with n_batch = {n_batch}", style="yellow")


def _finished(r: RequestRecord, n_seq: int) -> None:
    n_prompt = f"{r.n_prompt:4d}" if r.n_prompt >= 0 else "   ?"  # a failed request's is unknown
    line = (
        f"Client {r.client:3d}, seq {r.seq:3d}/{n_seq:3d}, prompt {n_prompt} t, "
        f"response {r.n_decoded:4d} t, "
        f"time {r.time:5.2f} s, speed {r.speed:5.2f} t/s, cache miss {r.cache_miss} "
    )
    if r.ttft is not None:
        line += f"(first token after {r.ttft:.2f} s) "
    out.print(Text(line, style="red" if r.stop != "error" else "bold red"))
    out.print()
    out.print(Text(f"Input:    {r.input}"))
    out.print(Text(f"{'Error' if r.stop == 'error' else 'Response'}: {r.response}", style="magenta"))
    out.print()


def _summary(s: ParallelSummary, prompt_file: str, where: str, n_failed: int) -> None:
    out.print()
    out.print(Text(f"run parameters as of {time.strftime('%Y-%m-%d %H:%M:%S')}", style="magenta"))
    out.print()
    out.print(
        f"parallel: n_parallel = {s.n_clients}, n_sequences = {s.n_sequences}, "
        f"cont_batching = {int(s.cont_batching)}, "
        f"system tokens = {s.n_system_tokens if s.n_system_tokens >= 0 else 'n/a'}"
    )
    out.print(Text(f"External prompt file: {prompt_file}"))
    out.print(Text(f"Model and path used:  {where}"))
    out.print()
    out.print(f"Total prompt tokens: {s.n_prompt:6d}, speed: {s.speed(s.n_prompt):5.2f} t/s")
    out.print(f"Total gen tokens:    {s.n_gen:6d}, speed: {s.speed(s.n_gen):5.2f} t/s")
    out.print(f"Total speed (AVG):   {'':6s}  speed: {s.speed(s.n_prompt + s.n_gen):5.2f} t/s")
    out.print(f"Cache misses:        {s.n_cache_miss:6d}")
    if n_failed:
        out.print(Text(f"Failed requests:     {n_failed:6d}", style="bold red"))


# what --json may replace: a summary it wrote before (or an empty file)
_JSON_KIND = files.FileKind("a kvtool parallel summary", rb'\{\s*"mode"', "the summary")


@app.command("parallel")
@common.flags
def parallel(
    load: common.LoadFlags = common.LoadFlags(),
    n_parallel: Annotated[
        int,
        typer.Option(
            "-np",
            "--parallel",
            help="Simultaneous clients (each a sequence, beside the system prompt's).",
            callback=common.values.bounds(1, common.values.MAX_SEQ - 1),
        ),
    ] = 1,
    n_sequences: Annotated[
        int,
        typer.Option(
            "-ns",
            "--sequences",
            help="Requests in total.",
            callback=common.values.bounds(0, common.values.INT_MAX),
        ),
    ] = 1,
    n_predict: Annotated[
        int,
        typer.Option(
            "-n",
            "--n-predict",
            help="Max tokens per answer (<= 0: no limit).",
            callback=common.values.bounds(-1),
        ),
    ] = 128,
    context: common.ContextFlags = common.ContextFlags(),
    compaction: common.DefragFlags = common.DefragFlags(),
    cont_batching: common.ContBatchingOpt = True,
    pps: Annotated[
        bool, typer.Option("-pps", help="Decode the system prompt once and seq_cp it to every client.")
    ] = False,
    junk: Annotated[
        int,
        typer.Option(
            "--junk", help="Up to N-1 filler turns per prompt.", callback=common.values.bounds(0, MAX_JUNK)
        ),
    ] = 1,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Questions, one per line.")] = None,
    system_file: Annotated[
        Path | None,
        typer.Option("--system-file", help="The shared system prompt (default: a ~290-token transcript)."),
    ] = None,
    seed: Annotated[int, typer.Option("-s", "--seed", help="Sampler seed (<0: random per client).")] = -1,
    temp: common.options.TempOpt = 0.8,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="Send the requests to this OpenAI-compatible URL.",
            callback=common.text.user_text,
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout", help="Seconds per server request.", callback=common.values.bounds(0.0, lo_open=True)
        ),
    ] = 600.0,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", help="The key --server asks for (llama-server's --api-key): sent as Bearer."
        ),
    ] = None,
    no_progress: common.NoProgressOpt = False,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the summary and every request here.")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Record KV allocations and frees (JSON lines, for defrag-sim)."),
    ] = None,
) -> None:
    """Simulate clients sending requests to a server (llama-parallel)."""
    for path, kind in ((json_out, _JSON_KIND), (trace, TRACE_KIND)):  # before the run, not after it
        if path is not None:
            files.check_writable(path, kind)
    prompts = list(QUESTIONS)
    if file is not None:
        prompts = read_prompts(common.text.read_text(file, "-f"))
        if not prompts:
            raise typer.BadParameter(f"{file} holds no questions", param_hint="-f")
        out.print(Text(f"questions from {file}:", style="green"))
        for i, q in enumerate(prompts, 1):
            out.print(Text(f"{i:3d} prompt: {q}"))
    system = SYSTEM_PROMPT
    if system_file is not None:
        system = common.text.read_text(system_file, "--system-file")
    sp = kvtool.SamplerParams(seed=seed, temp=temp)
    params = ParallelParams(
        n_parallel,
        n_sequences,
        n_predict,
        cont_batching,
        pps,
        junk,
        prompts=prompts,
        sampler=sp,
        system=system,
    )
    sim: Sim
    rec: TraceRecorder | None = None
    if server is not None and trace is not None:
        raise typer.BadParameter("records a local run, not --server", param_hint="--trace")
    if server is None and api_key is not None:
        raise typer.BadParameter("is the key of a --server: a local run takes none", param_hint="--api-key")
    local = [
        *load.changed(skip=("model", "list_devices")),
        *context.changed(),
        *compaction.changed(),
        *(["-pps"] * pps),
    ]
    if server is not None and local:  # the server's own flags decide these
        raise typer.BadParameter(
            f"sends requests only: {', '.join(local)} set up a local run", param_hint="--server"
        )
    recording = contextlib.ExitStack()  # the trace replaces its file only after a whole run
    with recording:
        if server is not None:
            check_server(server, timeout)
            sim = HttpParallelSim(server, params, model=load.model, timeout=timeout, api_key=api_key)
            where = f"{server} (model '{load.model}')"
            out.print(f"parallel: simulating {n_parallel} clients against {server}")
        else:
            m = common.load_model(load, err)
            # sequence 0 holds the system prompt; the geometry (n_ctx_seq) is printed below
            n_seq_max = n_parallel + 1
            cp = context.params(n_seq_max, compaction.setting())
            ctx = common.make_context(m, cp, None)
            from kvtool.commands.defrag_sim.trace import TraceRecorder  # loads the simulator's numpy

            rec = recording.enter_context(TraceRecorder(trace, ctx)) if trace is not None else None
            sim = ParallelSim(rec.wrap(ctx) if rec is not None else ctx, params)
            where = str(m.path)
            out.print("parallel: simulating parallel requests from clients:")
            out.print(
                f"parallel: n_parallel = {n_parallel}, n_sequences = {n_sequences}, "
                f"cont_batching = {int(cont_batching)}, system tokens = {len(sim.system_tokens)}, "
                f"kv_unified = {int(context.kv_unified)}, n_ctx = {ctx.n_ctx}, n_ctx_seq = {ctx.n_ctx_seq}"
            )
            if pps:
                out.print("parallel: evaluating the system prompt once (seq 0), copied to each client")
        out.print()
        live = not no_progress and err.is_terminal
        with (
            Live(
                get_renderable=lambda: _view(sim, n_sequences),
                console=err,
                refresh_per_second=4,
                transient=True,
                redirect_stdout=sys.stdout.isatty(),
                redirect_stderr=False,
            )
            if live
            else contextlib.nullcontext()
        ):
            if isinstance(sim, ParallelSim):
                summary = sim.run(_started, lambda r: _finished(r, n_sequences), _missed)
            else:
                summary = sim.run(on_finish=lambda r: _finished(r, n_sequences))
    failed = [r for r in summary.records if r.stop == "error"]
    _summary(summary, str(file) if file else "used built-in defaults", where, len(failed))
    if json_out is not None:
        doc = {"mode": "server" if server else "local", "model": where, "kv_unified": context.kv_unified}
        doc |= {"shared_system": pps, "n_predict": n_predict, **summary.to_dict()}
        files.write_file(
            json_out, (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode(), _JSON_KIND
        )
    if failed:
        raise typer.Exit(1)
