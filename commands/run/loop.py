"""`run`'s two modes: one-shot completion and the chat loop with its slash commands."""

from __future__ import annotations

import re
import sys

import kvtool
from kvtool.commands.common.generate import Generation
from kvtool.commands.common.progress import PromptBar
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.keeper import Keeper, err
from kvtool.commands.run.perf import Perf


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stop_note(gen: Generation, ctx: kvtool.Context) -> None:
    if gen.stop == "ctx_full":
        err.print(
            f"context full (n_ctx = {ctx.n_ctx_seq}): the reply stopped; /clear starts over", style="yellow"
        )
    elif gen.stop == "interrupted":
        err.print("(interrupted)", style="yellow")


def one_shot(session: ChatSession, prompt: str, n_predict: int, perf: Perf, bar: PromptBar | None) -> None:
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


def _command(keeper: Keeper, text: str, perf: Perf) -> bool:
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
        err.print("(conversation cleared)", style="dim")
    elif cmd == "/list":
        err.print(f"{keeper.listing()}", style="dim")
    elif cmd == "/stats":
        for line in perf.lines(session.timings):
            err.print(line, markup=False)
    elif cmd in ("/save", "/load"):
        try:
            if not arg:
                raise kvtool.StateError(f"{cmd} needs a name")
            note = keeper.save(arg) if cmd == "/save" else keeper.load(arg)
            err.print(f"({note})", markup=False, style="dim")
        except (kvtool.KvtoolError, OSError) as e:  # the chat goes on: nothing was lost
            err.print(f"error: {e}", style="red")
    else:
        err.print(f"error: unknown command {cmd} (/help lists them)", style="red")
    return True


def chat(
    keeper: Keeper,
    n_predict: int,
    perf: Perf,
    bar: PromptBar | None,
    verbose: bool,
    first: str | None = None,
) -> None:
    if sys.stdin.isatty():
        err.print(
            "Chat with the model. /help lists the commands, /exit quits; Ctrl-C stops a reply.", style="dim"
        )

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
                err.print(f"{e}; /clear starts over", style="yellow")
                continue
            except KeyboardInterrupt:  # while the prompt was being decoded: drop the turn
                err.print("(interrupted)", style="yellow")
                continue
            finally:
                if bar is not None:
                    bar.close()
            _write("\n")
            _stop_note(gen, session.ctx)
            dn, dt = session.timings.n_gen - n0, session.timings.t_gen - t0  # this reply's share
            ttft = f", first token {perf.ttft * 1e3:.0f} ms" if perf.ttft is not None else ""
            err.print(f"{len(gen.tokens)} tokens, {dn / dt if dt > 0 else 0:.1f} t/s{ttft}", style="dim")
            if verbose:
                for row in perf.lines(session.timings):
                    err.print(row, markup=False, style="dim")
    except KeyboardInterrupt:  # Ctrl-C at the prompt leaves the chat
        _write("\n")
