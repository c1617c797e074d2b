"""`kvtool run`: chat in the terminal, or one-shot completion with -p (llama-cli / llama-run)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

import kvtool
from kvtool.commands import app
from kvtool.commands.common import ModelOpt, load_model_with_status

err = Console(stderr=True, highlight=False)


@app.command("run")
def run(
    model: ModelOpt = kvtool.DEFAULT_MODEL,
    prompt: Annotated[
        str | None, typer.Option("-p", "--prompt", help="One-shot: complete this and exit.")
    ] = None,
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1: until end).")
    ] = -1,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="Context size (0: the model's).")] = 4096,
    batch_size: Annotated[int, typer.Option("-b", "--batch-size", help="Logical batch size.")] = 2048,
    ubatch_size: Annotated[int, typer.Option("-ub", "--ubatch-size", help="Physical batch size.")] = 512,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    temp: Annotated[float, typer.Option("--temp", help="Temperature (<= 0: greedy).")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k (<= 0: off).")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="Top-p (1.0: off).")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="Min-p (0.0: off).")] = 0.05,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="1.0: off.")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks at.")] = 64,
    seed: Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1: random).")] = -1,
    system: Annotated[str | None, typer.Option("-sys", "--system", help="System message.")] = None,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Raw completion, no chat template.")] = False,
    jinja: Annotated[
        bool, typer.Option("--jinja", help="Render the GGUF's own Jinja chat template.")
    ] = False,
    kv_unified: Annotated[
        bool, typer.Option("-kvu", "--kv-unified", help="One KV buffer for all sequences.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Model, template and context details.")
    ] = False,
) -> None:
    """Chat with a model (interactive, or turns read from a pipe), or complete one prompt (-p)."""
    m = load_model_with_status(model, err)
    if jinja:
        m.use_chat_template(jinja=True)
    ctx = kvtool.Context(
        m,
        kvtool.ContextParams(
            n_ctx=ctx_size,
            n_batch=batch_size,
            n_ubatch=ubatch_size,
            n_seq_max=1,
            kv_unified=kv_unified,
            n_threads=threads,
        ),
    )
    sampler = kvtool.Sampler(
        kvtool.SamplerParams(
            seed=seed,
            temp=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
        )
    )
    session = kvtool.ChatSession(ctx, sampler, system=system, use_template=not no_chat)
    if verbose:
        err.print(
            f"model: {m.name} ({m.arch}, {m.path}); chat template: {m.chat_template.name}; "
            f"n_ctx = {ctx.n_ctx}; seed = {sampler.seed}"
        )
    if prompt is not None:
        _one_shot(session, prompt, n_predict)
    else:
        _chat(session, n_predict)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stop_note(gen: kvtool.Generation, ctx: kvtool.Context) -> None:
    if gen.stop == "ctx_full":
        err.print(f"[yellow]context full (n_ctx = {ctx.n_ctx_seq}): the reply stopped; /clear starts over[/]")
    elif gen.stop == "interrupted":
        err.print("[yellow](interrupted)[/]")


def _one_shot(session: kvtool.ChatSession, prompt: str, n_predict: int) -> None:
    _, gen = session.respond(prompt, n_predict, _write)
    _write("\n")
    _stop_note(gen, session.ctx)
    err.print(session.timings.line())


def _read_turns():  # type: ignore[no-untyped-def]
    """User turns: prompted on a terminal, else one per line of standard input."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())

        while True:
            try:
                yield input("\n> ")
            except EOFError:
                return
    else:
        for line in sys.stdin:
            line = line.rstrip("\n")
            _write(f"\n> {line}\n")
            yield line


def _chat(session: kvtool.ChatSession, n_predict: int) -> None:
    if sys.stdin.isatty():
        err.print(
            "[dim]Chat with the model. /clear forgets the conversation, /exit quits; Ctrl-C stops a reply.[/]"
        )
    try:
        for line in _read_turns():
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return
            if text == "/clear":
                session.clear()
                err.print("[dim](conversation cleared)[/]")
                continue
            try:
                _, gen = session.respond(text, n_predict, _write)
            except kvtool.ContextFullError as e:
                err.print(f"[yellow]{e}; /clear starts over[/]")
                continue
            except KeyboardInterrupt:  # while the prompt was being decoded: drop the turn
                err.print("[yellow](interrupted)[/]")
                continue
            _write("\n")
            _stop_note(gen, session.ctx)
            t = session.timings
            err.print(f"[dim]{len(gen.tokens)} tokens, {t.n_gen / t.t_gen if t.t_gen else 0:.1f} t/s[/]")
    except KeyboardInterrupt:  # Ctrl-C at the prompt leaves the chat
        _write("\n")
