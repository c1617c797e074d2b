"""`kvtool batched-bench`: llama-batched-bench. Decode speed of B parallel sequences, each with
a PP-token prompt, generating TG tokens in lockstep; one table row per (PP, TG, B)."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Annotated

import typer

import kvtool
from kvtool.commands import app, common
from kvtool.commands.batched_bench.logic import (
    BatchedResult,
    batched_n_kv,
    batched_run,
    batched_skip_reason,
    batched_warmup,
)
from kvtool.commands.common.sizes import kv_size_lines
from kvtool.commands.common.values import parse_int_list

err = common.text.lazy_console(stderr=True)

_HEAD = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
_W = (6, 6, 4, 6, 8, 8, 8, 8, 8, 8)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = parse_int_list(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from e
    if not values or min(values) < 0:
        raise typer.BadParameter(f"expected non-negative integers, got '{text}'", param_hint=flag)
    return values


def md_header() -> str:
    """llama-batched-bench's table head: the column names and the markdown rule."""
    names = "|" + " | ".join(f"{h:>{w}}" for h, w in zip(_HEAD, _W, strict=True)) + " |"
    rule = "|" + "-|-".join("-" * w for w in _W) + "-|"
    return f"{names}\n{rule}"


def md_row(r: BatchedResult) -> str:
    """One table row, formatted as llama-batched-bench prints it."""
    cells = (
        f"{r.pp:6d}", f"{r.tg:6d}", f"{r.pl:4d}", f"{r.n_kv:6d}", f"{r.t_pp:8.3f}", f"{r.speed_pp:8.2f}",
        f"{r.t_tg:8.3f}", f"{r.speed_tg:8.2f}", f"{r.t:8.3f}", f"{r.speed:8.2f}",
    )  # fmt: skip
    return "|" + " | ".join(cells) + " |"


@app.command("batched-bench")
@common.flags
def batched_bench(
    load: common.LoadFlags = common.LoadFlags(),
    ctx_size: Annotated[
        int,
        typer.Option(
            "-c",
            "--ctx-size",
            help="Context size (0: enough for the largest combination).",
            callback=common.values.bounds(0),
        ),
    ] = 0,
    context: common.ContextFlags = common.ContextFlags(),
    npp: Annotated[str, typer.Option("-npp", help="Prompt tokens per sequence (comma list).")] = "128",
    ntg: Annotated[str, typer.Option("-ntg", help="Generated tokens per sequence (comma list).")] = "128",
    npl: Annotated[str, typer.Option("-npl", help="Parallel sequences B (comma list).")] = "1",
    pps: Annotated[
        bool, typer.Option("-pps", "--pp-shared", help="One prompt shared by all sequences (seq_cp).")
    ] = False,
    tgs: Annotated[
        bool, typer.Option("-tgs", "--tg-separate", help="Generate for one sequence at a time.")
    ] = False,
    output_format: Annotated[
        str, typer.Option("--output-format", help="md (table) or jsonl (one object per row).")
    ] = "md",
    seed: Annotated[int, typer.Option("-s", "--seed", help="Seed of the random tokens.")] = 1,
    no_progress: common.NoProgressOpt = False,
) -> None:
    """Batched decoding benchmark (llama-batched-bench): every (PP, TG, B) that fits the context."""
    if output_format not in ("md", "jsonl"):
        raise typer.BadParameter("md or jsonl", param_hint="--output-format")
    pps_list, tg_list, pl_list = _ints(npp, "-npp"), _ints(ntg, "-ntg"), _ints(npl, "-npl")
    if min(pl_list) < 1 or max(pl_list) > common.values.MAX_SEQ:
        raise typer.BadParameter(f"B must be in [1, {common.values.MAX_SEQ}]", param_hint="-npl")
    shown = common.progress_console(err, no_progress)
    m = common.load_model(load, shown)
    n_threads = kvtool.set_n_threads()  # no argument: changes nothing, tells the threads -t set
    if ctx_size == 0:  # every combination fits: per stream in split mode, in total when unified
        combos = [(pp, tg, pl) for pp in pps_list for tg in tg_list for pl in pl_list]
        if context.kv_unified:
            ctx_size = max(batched_n_kv(pp, tg, pl, pps, True) for pp, tg, pl in combos)
        else:
            ctx_size = max(pl_list) * max(pp + tg for pp, tg, _ in combos)
    # every sequence of the largest B needs an id; the geometry (n_ctx_seq) is printed below
    cp = dataclasses.replace(context, ctx_size=ctx_size).params(max(pl_list))
    ctx = common.make_context(m, cp, None)
    for line in kv_size_lines(ctx):  # as llama.cpp logs it
        err.print(common.text.plain(line, "dim"))
    rng = random.Random(seed)
    batched_warmup(ctx, rng)
    info = {
        "n_kv_max": ctx.n_ctx,
        "n_batch": ctx.n_batch,
        "n_ubatch": ctx.n_ubatch,
        "is_pp_shared": int(pps),
        "is_tg_separate": int(tgs),
        "kv_unified": int(context.kv_unified),
        "n_ctx_seq": ctx.n_ctx_seq,
        "n_threads": n_threads,
    }
    if output_format == "md":
        print()
        print("batched-bench: " + ", ".join(f"{k} = {v}" for k, v in info.items()))
        print()
        print(md_header(), flush=True)
    for pp in pps_list:
        for tg in tg_list:
            for pl in pl_list:
                reason = batched_skip_reason(ctx, pp, tg, pl, pps)
                if reason is not None:
                    err.print(f"skipped PP = {pp}, TG = {tg}, B = {pl}: {reason}", style="dim")
                    continue
                with common.timed_status(shown, f"PP = {pp}, TG = {tg}, B = {pl}"):
                    r = batched_run(ctx, pp, tg, pl, pps, rng, tg_separate=tgs)
                if output_format == "md":
                    print(md_row(r), flush=True)
                else:
                    row = {**info, "pp": pp, "tg": tg, "pl": pl, "n_kv": r.n_kv, "t_pp": r.t_pp}
                    row |= {"speed_pp": r.speed_pp, "t_tg": r.t_tg, "speed_tg": r.speed_tg}
                    row |= {"t": r.t, "speed": r.speed}
                    print(json.dumps(row), flush=True)
