"""`kvtool state`: save a prompt's state, resume generation from it, inspect files, list stores
(llama.cpp's examples/save-load-state, split into steps)."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

import kvtool
from kvtool.commands import app, common
from kvtool.commands.common.generate import TextStream, generate
from kvtool.commands.common.progress import PROMPT_CHUNK, PromptBar
from kvtool.common.store import ConversationStore

if TYPE_CHECKING:
    import torch

err = common.text.lazy_console(stderr=True)
state_app = typer.Typer(
    help="Save a prompt's KV state, continue generating from it, inspect state files and stores.",
    no_args_is_help=True,
)
app.add_typer(state_app, name="state")

SeqOpt = Annotated[
    int | None,
    typer.Option(
        "--seq",
        help="Save/restore one sequence (a sequence state) instead of all.",
        callback=common.values.bounds(0, common.values.MAX_SEQ - 1),
    ),
]


@state_app.command("save")
@common.flags
def save(
    output: Annotated[Path, typer.Option("-o", "--output", help="State file to write.")],
    prompt: Annotated[
        str,
        typer.Option("-p", "--prompt", help="Text to decode before saving.", callback=common.text.user_text),
    ],
    seq: SeqOpt = None,
    no_progress: common.NoProgressOpt = False,
    load: common.LoadFlags = common.LoadFlags(),
    context: common.ContextFlags = common.ContextFlags(),
) -> None:
    """Decode the prompt (raw text, no chat template) and save the state atomically."""
    kvtool.check_state_path(output)  # before the work: a path it cannot save to is one line now
    shown = common.progress_console(err, no_progress)
    m = common.load_model(load, shown)
    s = 0 if seq is None else seq
    cp = context.params(s + 1)
    ctx = common.make_context(m, cp, err)
    ids = m.tokenize(prompt, add_special=True, parse_special=False)
    bar = PromptBar(err) if not no_progress and err.is_terminal else None
    try:  # in chunks, for the bar; the memory ends the same
        step = PROMPT_CHUNK if bar is not None else max(1, len(ids))
        for i in range(0, len(ids), step):
            kvtool.decode_tokens(ctx, ids[i : i + step], s, i)
            if bar is not None:
                bar(min(i + step, len(ids)), len(ids))
    finally:
        if bar is not None:
            bar.close()
    n = ctx.state_save_file(output, seq, tokens={s: ids})
    what = "context" if seq is None else f"sequence {seq}"
    err.print(f"saved {len(ids)} tokens ({what}) to {output}: {n:,} bytes")


@state_app.command("load")
@common.flags
def load(
    input: Annotated[Path, typer.Option("-i", "--input", help="State file to restore.")],
    prompt: Annotated[
        str | None,
        typer.Option("-p", "--prompt", help="More text to decode first.", callback=common.text.user_text),
    ] = None,
    n_predict: Annotated[
        int,
        typer.Option(
            "-n", "--n-predict", help="Tokens to generate (-1: until end).", callback=common.values.bounds(-1)
        ),
    ] = 32,
    seq: Annotated[
        int | None,
        typer.Option(
            "--seq",
            help="Sequence to continue (default: the saved one).",
            callback=common.values.bounds(0, common.values.MAX_SEQ - 1),
        ),
    ] = None,
    temp: common.options.TempOpt = 0.0,
    seed: Annotated[
        int, typer.Option("-s", "--seed", help="RNG seed (-1: the saved sampler's, if any).")
    ] = -1,
    load: common.LoadFlags = common.LoadFlags(),
    context: common.ContextFlags = common.ContextFlags(),
    *,
    click_ctx: typer.Context,
) -> None:
    """Restore a state and print the continuation on stdout (greedy unless --temp > 0).

    The model, the KV types and the KV layout are the file's unless given (a flag that
    contradicts the file is refused when the state is read)."""
    info = kvtool.inspect_state(input)
    load, context = _as_saved(click_ctx, input, info, load, context)
    saved = [s.seq_id for s in info.seqs]
    if info.kind == "context" and seq is not None and seq not in saved:
        raise kvtool.StateError(f"{input} holds sequences {saved}, not {seq}")
    s = seq if seq is not None else (saved[0] if info.kind == "context" and saved else 0)
    m = common.load_model(load, err)
    n_seq_max = max([s, *saved]) + 1 if info.kind == "context" else s + 1
    cp = context.params(n_seq_max)
    ctx = common.make_context(m, cp, err)
    info = ctx.state_load_file(input, None if info.kind == "context" else s)
    sampler = kvtool.Sampler(kvtool.SamplerParams(seed=seed, temp=temp))
    if seed == -1:
        info.restore_sampler(sampler)
    logits = _next_logits(ctx, info, s, prompt)
    pos = ctx.memory.seq_pos_max(s) + 1
    stream = TextStream(m)
    gen = generate(ctx, sampler, logits, pos, n_predict, lambda t: _write(stream.push(t)), s)
    if gen.error is not None:
        raise gen.error
    _write(stream.flush() + "\n")
    err.print(
        f"restored {info.seqs[0].n_cells if info.seqs else 0} cells; generated {len(gen.tokens)} tokens"
    )


def _as_saved(
    click_ctx: typer.Context,
    path: Path,
    info: kvtool.StateInfo,
    load: common.LoadFlags,
    context: common.ContextFlags,
) -> tuple[common.LoadFlags, common.ContextFlags]:
    """-m, -ctk, -ctv and -kvu as the state was saved with, where the command line leaves them out."""

    def given(name: str) -> bool:
        source = click_ctx.get_parameter_source(name)
        return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")

    if not given("model"):
        saved = info.model.get("path")
        if not isinstance(saved, str):
            raise kvtool.StateError(
                f"{path} does not record its model's file (an older kvtool saved it): give -m"
            )
        if not Path(saved).is_file():
            raise kvtool.StateError(f"{path} was saved with the model {saved}, which is not there: give -m")
        load = dataclasses.replace(load, model=saved)
    layout = _kv_part(dict(info.memory))  # the saved layout: a dict, not a memory object
    kept = {
        field: value.lower() if isinstance(value, str) else value
        for field, key, kind in (
            ("type_k", "type_k", str),
            ("type_v", "type_v", str),
            ("kv_unified", "unified", bool),
        )
        if not given(field) and isinstance(value := layout.get(key), kind)
    }
    return load, dataclasses.replace(context, **kept)


def _kv_part(layout: dict[str, object]) -> dict[str, object]:
    """The layout of the saved memory's first KV cache: the memory itself, or the first of its
    parts that is one (a sliding-window model's base and window caches, a hybrid's attention
    part: their K/V types and layout are the same), or the memory where it has none."""
    if "type_k" in layout:
        return layout
    parts = layout.get("parts")
    for part in parts.values() if isinstance(parts, dict) else ():
        if isinstance(part, dict) and "type_k" in (found := _kv_part(part)):
            return found
    return layout


def _next_logits(ctx: kvtool.Context, info: kvtool.StateInfo, seq: int, more: str | None) -> torch.Tensor:
    """The logits generation starts from: a context state's own when it holds one sequence and
    nothing is added, else those kvtool.resume_seq computes after the saved tokens and `more`."""
    n_held = ctx.memory.seq_pos_max(seq) + 1
    ids = ctx.model.tokenize(more, add_special=n_held == 0, parse_special=False) if more else []
    if not ids and info.kind == "context" and info.n_outputs and len(info.seqs) == 1:
        return ctx.logits_ith(-1)
    saved = info.tokens(None if info.kind == "sequence" else seq)
    if saved is None and ids:  # no token ids saved: the text can only follow the held cells
        return kvtool.decode_tokens(ctx, ids, seq, n_held)
    if not saved and not ids:
        raise kvtool.StateError("the state holds no token ids to continue from: give -p")
    return kvtool.resume_seq(ctx, seq, [*(saved or []), *ids], saved or [])[1]


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@state_app.command("inspect")
def inspect(file: Annotated[Path, typer.Argument(help="A state file.")]) -> None:
    """Show a state file's header: model, memory layout, sequences, token counts, sizes."""
    info = kvtool.inspect_state(file)
    out = common.text.console()
    out.print(f"file: {file} ({info.n_bytes:,} bytes, checksum ok)")
    out.print(f"format: kvtool.state version {info.version}, {info.kind} state")
    md = info.model
    out.print(f"model: {md.get('name')} ({md.get('arch')}, n_vocab {md.get('n_vocab')})")
    out.print(f"fingerprint: {md.get('fingerprint')}, content {md.get('content')}")
    for line in _memory_lines(info.memory, "memory"):
        out.print(line)
    from rich.table import Table

    table = Table(title="sequences")
    for col in ("seq", "cells", "positions", "tokens"):
        table.add_column(col, justify="right")
    for s in info.seqs:
        toks = "-" if s.tokens is None else str(len(s.tokens))
        table.add_row(str(s.seq_id), str(s.n_cells), f"{s.pos_min}..{s.pos_max}", toks)
    out.print(table)
    sizes = ", ".join(f"{k} {v:,}" for k, v in sorted(info.tensor_bytes.items()))
    header = info.n_bytes - sum(info.tensor_bytes.values())
    out.print(f"sizes (bytes): {sizes}, header {header:,}")
    if info.n_outputs:
        out.print(f"logits: {info.n_outputs} row(s)")
    if info.sampler is not None:
        out.print(f"sampler: seed {info.sampler['seed']}, {len(info.sampler['history'])} tokens of history")
    chat = (info.app or {}).get("chat")
    if isinstance(chat, dict) and isinstance(chat.get("messages", []), list):
        out.print(f"chat: {len(chat.get('messages', []))} messages")


def _memory_lines(layout: dict, name: str) -> list[str]:  # type: ignore[type-arg]
    # A layout is whatever the file holds (the checksum proves no origin): shown, not trusted.
    parts = layout.get("parts")
    if isinstance(parts, dict):
        lines = [f"{name}: {layout.get('kind')}"]
        for part, sub in parts.items():
            lines += _memory_lines(sub if isinstance(sub, dict) else {}, f"  {part}")
        return lines
    layers = layout.get("layers")
    n_layers = len(layers) if isinstance(layers, list) else "?"
    if layout.get("kind") == "recurrent":
        return [f"{name}: recurrent, {n_layers} layers; {layout.get('n_rows')} states saved"]
    mode = "unified" if layout.get("unified") else "split"
    swa = layout.get("swa")
    window = f", window {swa.get('n_swa')}" if isinstance(swa, dict) else ""
    return [
        f"{name}: {layout.get('kind')} {mode}, {layout.get('n_stream')} stream(s) x "
        f"{layout.get('n_cells')} cells, K {layout.get('type_k')} V {layout.get('type_v')}, "
        f"{n_layers} layers"
        f"{window}; {layout.get('n_rows')} cells saved"
    ]


@state_app.command("list")
def list_store(
    store: Annotated[Path, typer.Option("--store", help="A conversation store (SQLite file).")],
) -> None:
    """List the conversations of a store: name, model, tokens, messages, size, last save."""
    with ConversationStore(store, readonly=True) as db:  # listed, never created nor changed
        rows = db.list()
    from rich.table import Table

    table = Table(title=f"conversations in {store}")
    for col in ("name", "model", "tokens", "messages", "bytes", "saved"):
        table.add_column(col, justify="left" if col in ("name", "model", "saved") else "right")
    for r in rows:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.updated))
        if r.damaged:  # listed, not fatal: the other rows stay readable
            saved = f"damaged ({r.damaged})"
        table.add_row(r.name, r.model, str(r.n_tokens), str(r.n_messages), f"{r.n_bytes:,}", saved)
    common.text.console(soft_wrap=False).print(table)
