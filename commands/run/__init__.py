"""`kvtool run`: chat in the terminal, or one-shot completion with -p (llama-cli / llama-run)."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

import kvtool
from kvtool.commands import app, common
from kvtool.commands.common.progress import PromptBar
from kvtool.commands.common.sizes import kv_size_lines
from kvtool.commands.run.banner import banner_lines, template_source
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.keeper import Keeper, err
from kvtool.commands.run.loop import COMMANDS, Display, chat, one_shot, show_earlier
from kvtool.commands.run.perf import Perf
from kvtool.common.registry import DEFAULT_MODEL as DEFAULT
from kvtool.common.store import ConversationStore

_quiet = common.text.lazy_console(stderr=True, quiet=True)  # --no-progress: no spinner while loading


@app.command("run")
@common.flags
def run(
    name: Annotated[
        str | None,
        typer.Argument(
            metavar="[MODEL]", help="The model, as ollama takes it (`kvtool run gemma3-270m`): as -m."
        ),
    ] = None,
    text: Annotated[
        str | None,
        typer.Argument(metavar="[PROMPT]", help="A prompt after the model, as ollama takes it: as -p."),
    ] = None,
    load: common.LoadFlags = common.LoadFlags(),
    model: Annotated[
        str | None,
        typer.Option(
            "-m",
            "--model",
            help=f"A known model name (see `kvtool models`) or a GGUF file path (default: {DEFAULT}).",
        ),
    ] = None,
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
            "-n",
            "--n-predict",
            "--predict",
            help="Tokens to generate (-1: until end).",
            callback=common.values.bounds(-1),
        ),
    ] = -1,
    context: common.ContextFlags = common.ContextFlags(),
    sampling: common.SamplingFlags = common.SamplingFlags(),
    compaction: common.DefragFlags = common.DefragFlags(),
    system: Annotated[
        str | None,
        typer.Option(
            "-sys", "--system", "--system-prompt", help="System message.", callback=common.text.user_text
        ),
    ] = None,
    system_file: Annotated[
        Path | None,
        typer.Option("-sysf", "--system-prompt-file", help="Read the system message (-sys) from this file."),
    ] = None,
    escape: Annotated[
        bool,
        typer.Option(
            "--escape/--no-escape",
            "-e",
            help="Read \\n \\t \\' \\\" \\\\ \\xHH in the prompt (-p, -f) as llama.cpp does (default: on).",
        ),
    ] = True,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Raw completion, no chat template.")] = False,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Never stop at end-of-generation tokens.")
    ] = False,
    context_shift: Annotated[
        bool,
        typer.Option(
            "--context-shift/--no-context-shift",
            help="When the context fills, discard half of it (after --keep) and go on.",
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
    jinja: common.JinjaOpt = True,
    rs_seq: common.options.RsSeqOpt = 1,
    ctx_checkpoints: common.options.CtxCheckpointsOpt = 32,
    no_progress: common.NoProgressOpt = False,
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Model, template and context details.")
    ] = False,
    verbose_prompt: Annotated[
        bool, typer.Option("--verbose-prompt", help="Print each turn's prompt and its tokens (id -> piece).")
    ] = False,
    display_prompt: Annotated[
        bool | None,
        typer.Option(
            "--display-prompt/--no-display-prompt",
            help="Echo the prompt: a one-shot prints it before its completion; --no-display-prompt: "
            "a piped chat does not echo its turns (default: only the chat echoes).",
        ),
    ] = None,
    perf: Annotated[
        bool | None,
        typer.Option(
            "--perf/--no-perf",
            help="--perf: the timings report also when the chat ends; --no-perf: no timings at all "
            "(default: after a one-shot, and one line per reply).",
        ),
    ] = None,
    multiline: Annotated[
        bool,
        typer.Option(
            "-mli",
            "--multiline-input",
            help="Every line goes on to the next; one that ends in \\ ends the turn (else the reverse).",
        ),
    ] = False,
    session_file: Annotated[
        Path | None,
        typer.Option("--session", help="Resume the chat from this state file if it exists; save it on exit."),
    ] = None,
    store: Annotated[
        Path | None, typer.Option("--store", help="Keep conversations in this SQLite store.")
    ] = None,
    conversation: Annotated[
        str | None,
        typer.Option(
            "--conversation-name",
            help="The conversation of --store to open (default: 'default').",
            callback=common.text.user_text,
        ),
    ] = None,
    parallel: Annotated[
        int | None,
        typer.Option(
            "-np",
            "--parallel",
            help="Conversations in memory at once (default: 4 with --store).",
            callback=common.values.bounds(1, common.values.MAX_SEQ),
        ),
    ] = None,
) -> None:
    """Chat with a model (interactive, or turns read from a pipe), or complete one prompt (-p).

    `kvtool run MODEL [PROMPT]` reads as ollama's: MODEL as -m, PROMPT as -p."""
    if name is not None and model is not None and name != model:
        raise typer.BadParameter(f"the model is '{model}' (-m) or '{name}', not both", param_hint="MODEL")
    load = dataclasses.replace(load, model=model or name or DEFAULT)
    if text is not None:
        if prompt is not None or file is not None:
            raise typer.BadParameter(
                "give the prompt as PROMPT, -p or -f, not two of them", param_hint="PROMPT"
            )
        prompt = text
    if file is not None:
        if prompt is not None:
            raise typer.BadParameter("give the prompt with -p or -f, not both", param_hint="-f")
        prompt = common.text.read_text(file, "-f")
    if prompt is not None and escape:
        prompt = common.text.process_escapes(prompt)
    if system_file is not None:
        if system is not None:
            raise typer.BadParameter(
                "give the system message with -sys or -sysf, not both", param_hint="-sysf"
            )
        system = common.text.read_text(system_file, "-sysf")
    if conversation is not None and store is None:
        raise typer.BadParameter(
            "names a conversation of a --store: give --store DB", param_hint="--conversation-name"
        )
    if conversation_mode is False:  # llama-cli -no-cnv: plain completion of the prompt
        if prompt is None:
            raise typer.BadParameter("needs a prompt (-p TEXT or -f FILE)", param_hint="-no-cnv")
        no_chat = True
    if session_file is not None and store is not None:  # one place keeps the conversation
        raise typer.BadParameter(
            "keeps the chat in a file; --store keeps it in the store: give one", param_hint="--session"
        )
    if session_file is not None:  # where the chat will be saved: checked before any work
        kvtool.check_state_path(session_file)
    if sampling.samplers is not None:  # its names, checked before the model loads
        kvtool.Sampler(sampling.params())
    db = ConversationStore(store) if store is not None else None  # refuses a foreign file now
    t_load_start = time.perf_counter()
    m = common.load_model(load, err if not no_progress else _quiet)
    t_load = time.perf_counter() - t_load_start
    m.use_chat_template(jinja=jinja)
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
            n_checkpoints=ctx_checkpoints,
        )

    keeper = Keeper(ctx, new_session, session_file, db, conversation or "default")
    perf_marks = Perf(t_start=t_load_start, t_load=t_load)
    if not no_chat and m.file.get("tokenizer.chat_template", None) is None:
        err.print(
            f"note: {m.path.name} has no chat template (a pretrained model?): "
            "its replies may ramble; --no-chat completes raw text",
            style="yellow",
        )
    bar = PromptBar(err) if not no_progress and err.is_terminal else None
    if verbose:
        err.print(
            f"model: {m.name} ({m.arch}, {m.path}); backend: {m.backend.name}; "
            f"chat template: {template_source(m)}; "
            f"n_ctx = {ctx.n_ctx}; seed = {keeper.session.sampler.seed}"
        )
        for line in kv_size_lines(ctx):
            err.print(line)
        for part in ctx.memory_breakdown().parts:
            if part.kind == "recurrent":  # its cells are the sequences' state slots
                per_seq = part.nbytes // part.n_cells
                err.print(f"recurrent state: {per_seq:,} bytes per sequence (--rs-seq {rs_seq})")
    show = Display(display_prompt, verbose_prompt, perf, multiline, verbose)
    rc = 0
    try:
        if prompt is not None and not conversation_mode:
            if keeper.resumed is not None:
                err.print(f"({keeper.resumed})", markup=False, style="dim")
            keeper.touch()  # saved by `finish`, whatever ends the reply
            rc = one_shot(keeper.session, prompt, n_predict, perf_marks, bar, show)
        else:
            if sys.stdin.isatty():  # llama-cli's banner, for whoever is at the terminal
                threads = kvtool.set_n_threads()
                for line in banner_lines(ctx, threads, keeper.session.system, COMMANDS):
                    err.print(line, markup=False, highlight=False)
            if keeper.resumed is not None:  # after the banner, where the user looks
                err.print(f"({keeper.resumed})", markup=False, style="dim")
                if sys.stdin.isatty():
                    show_earlier(keeper.session.messages)
            rc = chat(keeper, n_predict, perf_marks, bar, show, first=prompt)
    finally:
        keeper.finish()
    common.signals.check()  # a reply that SIGTERM or SIGHUP stopped was kept: now the exit
    if (where := keeper.kept_where()) is not None:  # Ctrl-D, /exit: one line says where it is
        err.print(f"({where})", markup=False, style="dim")
    if keeper.failed is not None:  # said on stderr, with where the conversation went
        raise typer.Exit(2)
    if rc:
        raise typer.Exit(rc)


__all__ = ["COMMANDS", "run"]
