"""`kvtool run`: chat in the terminal, or one-shot completion with -p (llama-cli / llama-run)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

import kvtool
from kvtool.commands import app, common
from kvtool.commands.common.generate import Generation
from kvtool.commands.common.progress import PromptBar
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.perf import Perf
from kvtool.commands.run.pool import ConversationPool

err = Console(stderr=True, highlight=False, soft_wrap=True)
_quiet = Console(stderr=True, quiet=True)  # --no-progress: no spinner while loading


@app.command("run")
def run(
    model: common.ModelOpt = kvtool.DEFAULT_MODEL,
    prompt: Annotated[
        str | None, typer.Option("-p", "--prompt", help="One-shot: complete this and exit.")
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
        int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1: until end).")
    ] = -1,
    ctx_size: common.CtxOpt = 4096,
    batch_size: common.BatchOpt = 2048,
    ubatch_size: common.UBatchOpt = 512,
    threads: common.ThreadsOpt = None,
    temp: Annotated[float, typer.Option("--temp", help="Temperature (<= 0: greedy).")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k (<= 0: off).")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="Top-p (1.0: off).")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="Min-p (0.0: off).")] = 0.05,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="1.0: off.")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks at.")] = 64,
    seed: Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1: random).")] = -1,
    system: Annotated[str | None, typer.Option("-sys", "--system", help="System message.")] = None,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Raw completion, no chat template.")] = False,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Never stop at end-of-generation tokens.")
    ] = False,
    jinja: Annotated[
        bool, typer.Option("--jinja", help="Render the GGUF's own Jinja chat template.")
    ] = False,
    swa_full: common.SwaFullOpt = False,
    kv_unified: common.KvUnifiedOpt = False,
    type_k: common.TypeKOpt = "f32",
    type_v: common.TypeVOpt = "f32",
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
        str, typer.Option("--conversation", help="The conversation of --store to open.")
    ] = "default",
    parallel: Annotated[
        int | None,
        typer.Option("-np", "--parallel", help="Conversations in memory at once (default: 4 with --store)."),
    ] = None,
) -> None:
    """Chat with a model (interactive, or turns read from a pipe), or complete one prompt (-p)."""
    if file is not None:
        if prompt is not None:
            raise typer.BadParameter("give the prompt with -p or -f, not both", param_hint="-f")
        try:
            prompt = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise typer.BadParameter(f"cannot read {file}: {e}", param_hint="-f") from e
    if conversation_mode is False:  # llama-cli -no-cnv: plain completion of the prompt
        if prompt is None:
            raise typer.BadParameter("needs a prompt (-p TEXT or -f FILE)", param_hint="-no-cnv")
        no_chat = True
    kvtool.set_n_threads(threads)
    t_load_start = time.perf_counter()
    m = common.load_model_with_status(model, err if not no_progress else _quiet)
    t_load = time.perf_counter() - t_load_start
    if jinja:
        m.use_chat_template(jinja=True)
    n_seq_max = parallel or (4 if store is not None else 1)
    cp = common.context_params(
        ctx_size, batch_size, ubatch_size, n_seq_max, kv_unified, swa_full, type_k, type_v
    )
    ctx = common.make_context(m, cp, err)
    sp = kvtool.SamplerParams(
        seed=seed,
        temp=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n,
    )

    def new_session(seq: int) -> ChatSession:
        sampler = kvtool.Sampler(sp)
        return ChatSession(ctx, sampler, system, seq, use_template=not no_chat, ignore_eos=ignore_eos)

    keeper = _Keeper(ctx, new_session, session_file, store, conversation)
    perf = Perf(t_start=t_load_start, t_load=t_load)
    if not no_chat and m.file.get("tokenizer.chat_template", None) is None:
        err.print(
            f"[yellow]note: {m.path.name} has no chat template (a pretrained model?): "
            "its replies may ramble; --no-chat completes raw text[/]"
        )
    show = not no_progress and err.is_terminal
    bar = PromptBar(err) if show else None
    if verbose:
        err.print(
            f"model: {m.name} ({m.arch}, {m.path}); chat template: {m.chat_template.name}; "
            f"n_ctx = {ctx.n_ctx}; seed = {keeper.session.sampler.seed}"
        )
    try:
        if prompt is not None and not conversation_mode:
            _one_shot(keeper.session, prompt, n_predict, perf, bar)
        else:
            _chat(keeper, n_predict, perf, bar, verbose, first=prompt)
    finally:
        keeper.finish()


class _Keeper:
    """Where conversations are kept: a session file (like llama-cli's prompt cache), a store of
    named conversations sharing the model, or nowhere. `/save NAME` and `/load NAME` go to
    files, or with a store to its conversations (`/load` switches)."""

    def __init__(
        self,
        ctx: kvtool.Context,
        new_session: Callable[[int], ChatSession],
        session_file: Path | None,
        store: Path | None,
        name: str,
    ) -> None:
        self.file = session_file
        self.pool = (
            None if store is None else ConversationPool(ctx, kvtool.ConversationStore(store), new_session)
        )
        self.name = name
        if self.pool is not None:
            self.session = self.pool.open(name)
            if self.session.messages or self.session.cached:
                err.print(f"[dim](conversation '{name}': {self._summary()})[/]")
            return
        self.session = new_session(0)
        if session_file is not None and session_file.exists():
            self.session.load_state(session_file)
            err.print(f"[dim](resumed {session_file}: {self._summary()})[/]")

    def _summary(self) -> str:
        return f"{len(self.session.messages)} messages, {len(self.session.cached)} tokens"

    def save(self, name: str) -> str:
        if self.pool is not None:
            self.pool.save(self.name, as_name=name)
            return f"saved as '{name}' in the store {self.pool.store.path}"
        path = Path(name).expanduser().resolve()  # a file name, relative to where kvtool runs
        n = self.session.save_state(path)
        return f"saved to {path} ({n:,} bytes; /load {name} or --session {name} resumes it)"

    def load(self, name: str) -> str:
        if self.pool is not None:
            known = name in {r.name for r in self.pool.store.list()}
            self.pool.save(self.name)
            self.session, self.name = self.pool.open(name), name
            if not known:  # a store's /load switches, so a new name starts a conversation
                return f"no conversation '{name}' in the store: started it empty"
            return f"conversation '{name}': {self._summary()}"
        path = Path(name).expanduser().resolve()
        if not path.exists():
            raise kvtool.StateError(f"no saved conversation at {path}")
        self.session.load_state(path)
        return f"loaded {path}: {self._summary()}"

    def listing(self) -> str:
        if self.pool is None:
            return "no store (use --store DB)"
        rows = self.pool.store.list()
        return ", ".join(f"{r.name}{'*' if r.name == self.name else ''} ({r.n_messages})" for r in rows)

    def finish(self) -> None:
        if self.pool is not None:
            self.pool.close_all()
            self.pool.store.close()
        elif self.file is not None:
            self.session.save_state(self.file)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stop_note(gen: Generation, ctx: kvtool.Context) -> None:
    if gen.stop == "ctx_full":
        err.print(f"[yellow]context full (n_ctx = {ctx.n_ctx_seq}): the reply stopped; /clear starts over[/]")
    elif gen.stop == "interrupted":
        err.print("[yellow](interrupted)[/]")


def _one_shot(session: ChatSession, prompt: str, n_predict: int, perf: Perf, bar: PromptBar | None) -> None:
    perf.turn_started()

    def write(text: str) -> None:
        perf.text_arrived()
        _write(text)

    try:
        _, gen = session.respond(prompt, n_predict, write, bar)
    finally:
        if bar is not None:
            bar.close()
    _write("\n")
    _stop_note(gen, session.ctx)
    for line in perf.lines(session.timings):
        err.print(line)


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


# a chat command: a slash and a word ("/usr/bin ..." is a message)
_COMMAND = re.compile(r"/[A-Za-z]+(\s|$)")

# the chat's commands, as /help lists them
COMMANDS = {
    "/help": "this list",
    "/clear": "forget the conversation (the system message stays)",
    "/save NAME": "keep the conversation: a file NAME, or with --store a conversation NAME",
    "/load NAME": "resume a conversation saved with /save",
    "/list": "the conversations of the --store",
    "/stats": "timings so far: load, prompt eval, eval, total, first token",
    "/exit": "quit (also /quit, Ctrl-D)",
}


def _command(keeper: _Keeper, text: str, perf: Perf) -> bool:
    """Runs a chat command; False when it asks to quit. Unknown ones are an error, not a turn."""
    cmd, _, arg = text.partition(" ")
    arg = arg.strip()
    session = keeper.session
    if cmd in ("/exit", "/quit"):
        return False
    if cmd == "/help":
        for name, what in COMMANDS.items():
            err.print(f"  {name:<11} {what}", markup=False)
    elif cmd == "/clear":
        session.clear()
        err.print("[dim](conversation cleared)[/]")
    elif cmd == "/list":
        err.print(f"[dim]{keeper.listing()}[/]")
    elif cmd == "/stats":
        for line in perf.lines(session.timings):
            err.print(line, markup=False)
    elif cmd in ("/save", "/load"):
        try:
            if not arg:
                raise kvtool.StateError(f"{cmd} needs a name")
            note = keeper.save(arg) if cmd == "/save" else keeper.load(arg)
            err.print(f"({note})", markup=False, style="dim")
        except kvtool.StateError as e:
            err.print(f"[red]error: {e}[/]")
    else:
        err.print(f"[red]error: unknown command {cmd} (/help lists them)[/]")
    return True


def _chat(
    keeper: _Keeper,
    n_predict: int,
    perf: Perf,
    bar: PromptBar | None,
    verbose: bool,
    first: str | None = None,
) -> None:
    if sys.stdin.isatty():
        err.print("[dim]Chat with the model. /help lists the commands, /exit quits; Ctrl-C stops a reply.[/]")

    def turns():  # type: ignore[no-untyped-def]
        if first is not None:  # -cnv -p: the prompt is the first turn
            _write(f"> {first}\n")
            yield first
        yield from _read_turns()

    def write(text: str) -> None:
        perf.text_arrived()
        _write(text)

    try:
        for line in turns():
            text = line.strip()
            if not text:
                continue
            if _COMMAND.match(text):
                if not _command(keeper, text, perf):
                    return
                continue
            session = keeper.session
            n0, t0 = session.timings.n_gen, session.timings.t_gen
            perf.turn_started()
            try:
                _, gen = session.respond(text, n_predict, write, bar)
            except kvtool.ContextFullError as e:
                err.print(f"[yellow]{e}; /clear starts over[/]")
                continue
            except KeyboardInterrupt:  # while the prompt was being decoded: drop the turn
                err.print("[yellow](interrupted)[/]")
                continue
            finally:
                if bar is not None:
                    bar.close()
            _write("\n")
            _stop_note(gen, session.ctx)
            dn, dt = session.timings.n_gen - n0, session.timings.t_gen - t0  # this reply's share
            ttft = f", first token {perf.ttft * 1e3:.0f} ms" if perf.ttft is not None else ""
            err.print(f"[dim]{len(gen.tokens)} tokens, {dn / dt if dt > 0 else 0:.1f} t/s{ttft}[/]")
            if verbose:
                for row in perf.lines(session.timings):
                    err.print(row, markup=False, style="dim")
    except KeyboardInterrupt:  # Ctrl-C at the prompt leaves the chat
        _write("\n")
