"""`kvtool run`: chat in the terminal, or one-shot completion with -p (llama-cli / llama-run)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

import kvtool
from kvtool.commands import app, common
from kvtool.commands.common.progress import PromptBar
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.keeper import Keeper, err
from kvtool.commands.run.loop import COMMANDS, chat, one_shot
from kvtool.commands.run.perf import Perf
from kvtool.common.store import ConversationStore

_quiet = common.text.console(stderr=True, quiet=True)  # --no-progress: no spinner while loading


@app.command("run")
@common.flags
def run(
    load: common.LoadFlags = common.LoadFlags(),
    prompt: Annotated[
        str | None,
        typer.Option(
            "-p", "--prompt", help="One-shot: complete this and exit.", callback=common.text.user_text
        ),
    ] = None,
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="Read the prompt (-p) from this file.")
    ] = None,
    conversation_mode: Annotated[
        bool | None,
        typer.Option(
            "--conversation/--no-conversation",
            "-cnv/-no-cnv",
            help="-cnv: keep chatting after -p's answer; -no-cnv: complete -p as raw text and exit.",
        ),
    ] = None,
    n_predict: Annotated[
        int,
        typer.Option(
            "-n", "--n-predict", help="Tokens to generate (-1: until end).", callback=common.values.bounds(-1)
        ),
    ] = -1,
    context: common.ContextFlags = common.ContextFlags(),
    sampling: common.SamplingFlags = common.SamplingFlags(),
    compaction: common.DefragFlags = common.DefragFlags(),
    system: Annotated[
        str | None, typer.Option("-sys", "--system", help="System message.", callback=common.text.user_text)
    ] = None,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Raw completion, no chat template.")] = False,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Never stop at end-of-generation tokens.")
    ] = False,
    context_shift: Annotated[
        bool,
        typer.Option(
            "--context-shift", help="When the context fills, discard half of it (after --keep) and go on."
        ),
    ] = False,
    keep: Annotated[
        int,
        typer.Option(
            "--keep",
            help="Tokens of the prompt a context shift keeps (after the BOS; -1: all).",
            callback=common.values.bounds(-1),
        ),
    ] = 0,
    jinja: Annotated[
        bool, typer.Option("--jinja", help="Render the GGUF's own Jinja chat template.")
    ] = False,
    rs_seq: common.options.RsSeqOpt = 1,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="No progress on stderr (loading, long prompts).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Model, template and context details.")
    ] = False,
    session_file: Annotated[
        Path | None,
        typer.Option("--session", help="Resume the chat from this state file if it exists; save it on exit."),
    ] = None,
    store: Annotated[
        Path | None, typer.Option("--store", help="Keep conversations in this SQLite store.")
    ] = None,
    conversation: Annotated[
        str,
        typer.Option(
            "--conversation", help="The conversation of --store to open.", callback=common.text.user_text
        ),
    ] = "default",
    parallel: Annotated[
        int | None,
        typer.Option(
            "-np",
            "--parallel",
            help="Conversations in memory at once (default: 4 with --store).",
            callback=common.values.bounds(1),
        ),
    ] = None,
) -> None:
    """Chat with a model (interactive, or turns read from a pipe), or complete one prompt (-p)."""
    if file is not None:
        if prompt is not None:
            raise typer.BadParameter("give the prompt with -p or -f, not both", param_hint="-f")
        prompt = common.text.read_text(file, "-f")
    if conversation_mode is False:  # llama-cli -no-cnv: plain completion of the prompt
        if prompt is None:
            raise typer.BadParameter("needs a prompt (-p TEXT or -f FILE)", param_hint="-no-cnv")
        no_chat = True
    if session_file is not None:  # where the chat will be saved: checked before any work
        kvtool.check_state_path(session_file)
    db = ConversationStore(store) if store is not None else None  # refuses a foreign file now
    t_load_start = time.perf_counter()
    m = common.load_model(load, err if not no_progress else _quiet)
    t_load = time.perf_counter() - t_load_start
    if jinja:
        m.use_chat_template(jinja=True)
    n_seq_max = parallel or (4 if store is not None else 1)
    cp = context.params(n_seq_max, compaction.setting(), rs_seq)
    ctx = common.make_context(m, cp, err)
    sp = sampling.params()

    def new_session(seq: int) -> ChatSession:
        sampler = kvtool.Sampler(sp)
        return ChatSession(
            ctx,
            sampler,
            system,
            seq,
            use_template=not no_chat,
            ignore_eos=ignore_eos,
            keep=keep if context_shift else None,
        )

    keeper = Keeper(ctx, new_session, session_file, db, conversation)
    perf = Perf(t_start=t_load_start, t_load=t_load)
    if not no_chat and m.file.get("tokenizer.chat_template", None) is None:
        err.print(
            f"note: {m.path.name} has no chat template (a pretrained model?): "
            "its replies may ramble; --no-chat completes raw text",
            style="yellow",
        )
    show = not no_progress and err.is_terminal
    bar = PromptBar(err) if show else None
    if verbose:
        err.print(
            f"model: {m.name} ({m.arch}, {m.path}); chat template: {m.chat_template.name}; "
            f"n_ctx = {ctx.n_ctx}; seed = {keeper.session.sampler.seed}"
        )
        per_seq = getattr(ctx.memory, "state_bytes_per_seq", None)  # recurrent and hybrid memories
        if per_seq is not None:
            err.print(f"recurrent state: {per_seq():,} bytes per sequence (--rs-seq {rs_seq})")
    try:
        if prompt is not None and not conversation_mode:
            one_shot(keeper.session, prompt, n_predict, perf, bar)
        else:
            chat(keeper, n_predict, perf, bar, verbose, first=prompt)
    finally:
        keeper.finish()


__all__ = ["COMMANDS", "run"]
