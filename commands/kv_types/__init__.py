"""`kvtool kv-types`: what each K/V cache type costs in precision and saves in memory, on your
model and your text. The text runs teacher-forced with every type pair and a reference pair
(f16 by default), and one table says per pair: bytes per token, the KV size at the model's
context, KL divergence and top-1 agreement against the reference, perplexity. llama.cpp needs
`llama-perplexity --kl-divergence` twice per type for these numbers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

import kvtool
from kvtool.commands import app, common

if TYPE_CHECKING:  # the measurement loads torch: imported when the verb runs, not for --help
    from kvtool.commands.kv_types.logic import Pair, Row

err = common.text.lazy_console(stderr=True)

DEFAULT_TYPES = "q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl,q8_0/q4_0"
_MiB = 1024 * 1024
FIELDS = ("type_k", "type_v", "bytes_per_token", "kv_mib", "kl", "kl_p99", "top1", "ppl")


@app.command("kv-types")
@common.flags
def kv_types(
    load: common.LoadFlags = common.LoadFlags(),
    file: Annotated[Path | None, typer.Option("-f", "--file", help="The text to measure on.")] = None,
    prompt: Annotated[
        str | None,
        typer.Option("-p", "--prompt", help="The text, given here.", callback=common.text.user_text),
    ] = None,
    types: Annotated[
        str,
        typer.Option(
            "--types",
            help=f"K/V pairs to compare, comma list; K/V where they differ. {common.options.KV_TYPES_HELP}.",
        ),
    ] = DEFAULT_TYPES,
    reference: Annotated[
        str, typer.Option("--ref", help="The pair the others are compared with (f16 or f32: llama.cpp's).")
    ] = "f16",
    ctx_size: Annotated[
        int,
        typer.Option(
            "-c",
            "--ctx-size",
            help="Tokens per chunk (scored on its second half).",
            callback=common.values.bounds(8),
        ),
    ] = 512,
    batch_size: Annotated[
        int,
        typer.Option(
            "-b",
            "--batch-size",
            help="Tokens per decode (each pair holds one batch's logits).",
            callback=common.values.bounds(1),
        ),
    ] = 128,
    output: Annotated[str, typer.Option("-o", "--output", help="md, csv or json.")] = "md",
    no_progress: common.NoProgressOpt = False,
) -> None:
    """Precision and memory of K/V cache types on a model and a text (KL, top-1, perplexity)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtool.commands.kv_types.logic import Pair, Setup, chunks, measure, report
    from kvtool.common.cells import read_kv_dims

    if output not in ("md", "csv", "json"):
        raise typer.BadParameter("md, csv or json", param_hint="-o")
    if (file is None) == (prompt is None):
        raise typer.BadParameter("give the text with -f or -p (one of them)", param_hint="-f")
    text = common.text.read_text(file, "-f") if file is not None else prompt or ""
    pairs = [Pair.parse(t) for t in types.split(",") if t.strip()]
    if not pairs:
        raise typer.BadParameter("no K/V pair", param_hint="--types")
    ref = Pair.parse(reference)
    shown = common.progress_console(err, no_progress)
    m = common.load_model(load, shown)
    dims = read_kv_dims(m.path)
    per_token = {p: dims.cell_bytes(p.k, p.v) for p in [ref, *pairs]}  # a type that does not fit: one line
    tokens = m.tokenize(text, add_special=True, parse_special=False)
    n_chunk = min(ctx_size, len(tokens))
    setup = Setup(n_chunk, min(batch_size, n_chunk), ref)
    parts = chunks(tokens, n_chunk)
    if not parts:
        raise kvtool.KvtoolError(f"the text is {len(tokens)} tokens: too short to score (at least 3)")
    n_steps = len(parts) * -(-n_chunk // setup.n_batch)
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=shown, transient=True, **common.timed_refresh(shown)) as progress:
        n_pairs = len({ref, *pairs})
        task = progress.add_task(
            f"{n_pairs} pairs over {len(parts)} chunks of {n_chunk} tokens", total=n_steps
        )
        stats = measure(m, tokens, pairs, setup, lambda: progress.advance(task))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model's context padded past its training length
        rows = report(m, stats, per_token)
    print(render(rows, output, m, ref, len(parts), n_chunk), end="")


def _cells(r: Row) -> dict[str, str | int | float]:
    return {
        "type_k": r.type_k,
        "type_v": r.type_v,
        "bytes_per_token": r.bytes_per_token,
        "kv_mib": round(r.kv_bytes / _MiB, 2),
        "kl": round(r.kl, 6),
        "kl_p99": round(r.kl_p99, 6),
        "top1": round(r.top1, 4),
        "ppl": round(r.ppl, 4),
    }


def render(rows: list[Row], output: str, model: kvtool.Model, ref: Pair, n_chunks: int, n_chunk: int) -> str:
    """The report as a markdown table (with a line saying what was measured), CSV or JSON."""
    if output == "json":
        doc = {
            "model": Path(str(model.path)).name,
            "reference": ref.name,
            "n_chunks": n_chunks,
            "n_ctx_chunk": n_chunk,
            "n_scored": rows[0].n_scored if rows else 0,
            "n_ctx": rows[0].n_ctx if rows else 0,
            "pairs": [_cells(r) for r in rows],
        }
        return json.dumps(doc, indent=2) + "\n"
    if output == "csv":
        lines = [",".join(FIELDS)] + [",".join(str(v) for v in _cells(r).values()) for r in rows]
        return "\n".join(lines) + "\n"
    n_ctx = rows[0].n_ctx if rows else 0
    head = (
        f"{Path(str(model.path)).name}: {rows[0].n_scored if rows else 0} tokens scored in {n_chunks} chunks "
        f"of {n_chunk}; KL and top-1 against K/V {ref.name}\n\n"
    )
    names = ("K", "V", "bytes/token", f"KV @ {n_ctx} (MiB)", "KL", "KL p99", "top-1", "PPL")
    out = [head + "| " + " | ".join(names) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * 6) + "|"]
    for r in rows:
        c = _cells(r)
        out.append(
            f"| {r.type_k} | {r.type_v} | {r.bytes_per_token} | {c['kv_mib']:.1f} | {r.kl:.5f} | "
            f"{r.kl_p99:.4f} | {100 * r.top1:.2f} % | {r.ppl:.4f} |"
        )
    return "\n".join(out) + "\n"


__all__ = ["kv_types"]
