"""`run`'s two modes: one-shot completion and the chat loop with its slash commands."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import typer

import kvtool
from kvtool.commands.common import signals
from kvtool.commands.common.generate import Generation
from kvtool.commands.common.progress import PromptBar
from kvtool.commands.run import reading
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.keeper import Keeper, err
from kvtool.commands.run.perf import Perf
from kvtool.commands.run.turns import piped_turns, terminal_turns


@dataclass(frozen=True)
class Display:
    """What `run` shows besides the reply: llama.cpp's --display-prompt (None: the piped chat
    echoes its turns, the one-shot prints only the completion), --verbose-prompt, --perf (None:
    the timings after a one-shot and a short line after each reply; True: also the report when
    the chat ends; False: none), -mli, -v."""

    display_prompt: bool | None = None
    verbose_prompt: bool = False
    perf: bool | None = None
    multiline: bool = False
    verbose: bool = False


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


_MORE = "--context-shift drops the oldest tokens and goes on, a larger -c holds more"


def _stop_note(gen: Generation, ctx: kvtool.Context, chat: bool) -> None:
    if gen.stop == "ctx_full":
        again = "/clear starts over, " if chat else ""  # a one-shot has no chat commands
        note = f"context full (n_ctx = {ctx.n_ctx_seq}): the reply stopped; {again}{_MORE}"
        err.print(note, style="yellow")
    elif gen.stop == "interrupted":
        err.print("(interrupted)", style="yellow")


def _piece(model: kvtool.Model, token: int) -> str:
    return model.token_to_piece(token, special=True).decode("utf-8", "replace")


def verbose_prompt(model: kvtool.Model, tokens: list[int], n_kept: int) -> None:
    """llama.cpp's --verbose-prompt: the prompt's text and its tokens, id -> piece, on stderr;
    in a chat, the tokens a turn adds after those the memory already holds."""
    new = tokens[n_kept:]
    text = b"".join(model.token_to_piece(t, special=True) for t in new).decode("utf-8", "replace")
    lines = [f"main: prompt: '{text}'", f"main: number of tokens in prompt = {len(new)}"]
    lines += [f"{t:6d} -> '{_piece(model, t)}'" for t in new]
    sys.stderr.write("\n".join([*lines, "", ""]))  # as it is: a console would expand tabs
    sys.stderr.flush()


def one_shot(
    session: ChatSession, prompt: str, n_predict: int, perf: Perf, bar: PromptBar | None, show: Display
) -> int:
    """The completion of `prompt`; returns the exit status: 130 when Ctrl-C cut it short (as
    llama-completion), else 0."""
    perf.turn_started()

    def write(text: str) -> None:
        perf.text_arrived()
        _write(text)

    if show.display_prompt:  # llama-completion prints the prompt, then its completion
        _write(prompt)
    try:
        _, gen = session.respond(
            prompt, n_predict, write, bar, on_tokens=_tokens_hook(session, show.verbose_prompt)
        )
    finally:
        if bar is not None:
            bar.close()
    _write("\n")
    _stop_note(gen, session.ctx, chat=False)
    if show.perf is not False:
        for line in perf.lines(session.timings):
            err.print(line)
    return 130 if gen.stop == "interrupted" else 0


def _tokens_hook(session: ChatSession, on: bool):  # type: ignore[no-untyped-def]
    if not on:
        return None
    return lambda tokens, kept: verbose_prompt(session.ctx.model, tokens, kept)


# a chat command: a slash and a word, or `/?` as ollama's help ("/usr/bin ..." is a message)
_COMMAND = re.compile(r"/([A-Za-z]+|\?)(\s|$)")

# the chat's commands, as /help lists them
COMMANDS = {
    "/help": "this list (also /?)",
    "/regen": "generate the last reply again",
    "/clear": "forget the conversation (the system message stays)",
    "/read FILE": "add a text file to the next message",
    "/glob PATTERN": "add the text files that match (** for any folders) to the next message",
    "/save NAME": "keep the conversation: a file NAME, or with --store a conversation NAME",
    "/load NAME": "resume a conversation saved with /save",
    "/list": "the conversations of the --store",
    "/stats": "timings so far: load, prompt eval, eval, total, first token",
    "/exit": "quit (also /quit, Ctrl-D)",
}


def _read(cmd: str, arg: str, files: list[str]) -> None:
    """/read FILE and /glob PATTERN: each file's text joins `files`; a file that cannot be
    read is one error line (the others are kept), and the chat goes on."""
    if not arg:
        err.print(f"error: {cmd} needs a {'file name' if cmd == '/read' else 'pattern'}", style="red")
        return
    names = [arg]
    if cmd == "/glob":
        try:
            paths, more = reading.globbed(arg)
        except KeyboardInterrupt:  # a walk of a large tree (/glob /usr/**): Ctrl-C stops it, not the chat
            signals.check()  # SIGTERM, SIGHUP: the chat ends
            err.print("(/glob interrupted: no file added)", style="yellow")
            return
        names = [str(p) for p in paths]
        if more:
            err.print(f"error: /glob adds at most {reading.MAX_GLOBBED} files", markup=False, style="red")
        if not names:
            err.print(f"(no file matches {arg})", markup=False, style="dim")
    for name in names:
        try:
            files.append(reading.file_text(name))
        except typer.BadParameter as e:
            err.print(f"error: {e}", markup=False, style="red")
            continue
        err.print(f"(loaded text from '{name}': it goes with the next message)", markup=False, style="dim")


def _command(keeper: Keeper, text: str, perf: Perf, files: list[str]) -> bool:
    """Runs a chat command; False when it asks to quit. Unknown ones are an error, not a turn.
    `/read` adds to `files`, the text the next message begins with."""
    cmd, _, arg = text.partition(" ")
    arg = arg.strip()
    session = keeper.session
    if cmd in ("/exit", "/quit"):
        return False
    if "\0" in arg:  # (a piped line can hold one) no file or conversation name does
        err.print(f"error: {cmd}: a name holds no NUL byte", markup=False, style="red")
        return True
    if cmd in ("/read", "/glob"):
        _read(cmd, arg, files)
        return True
    if cmd in ("/help", "/?"):
        for name, what in COMMANDS.items():
            err.print(f"  {name:<13} {what}", markup=False)
    elif cmd == "/clear":
        session.clear()
        err.print("(conversation cleared)", style="dim")
        keeper.changed()
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


# how many of a resumed conversation's turns the terminal shows again
N_SHOWN = 10


def show_earlier(messages: list[dict[str, str]]) -> None:
    """A resumed conversation's last turns, on stdout as the chat showed them (`> ` and the
    message, then the reply), so the user sees where it stands; a note says how many are left
    out."""
    turns: list[tuple[str, str]] = []
    for m in messages:
        if m["role"] == "user":
            turns.append((m["content"], ""))
        elif m["role"] == "assistant" and turns and not turns[-1][1]:
            turns[-1] = (turns[-1][0], m["content"])
    if len(turns) > N_SHOWN:
        err.print(f"({len(turns) - N_SHOWN} earlier turns not shown)", style="dim")
    for user, reply in turns[-N_SHOWN:]:
        _write(f"\n> {user}\n{reply}\n")


def _turns(first: str | None, show: Display) -> Iterator[str]:
    echo = None if show.display_prompt is False else _write
    if first is not None:  # -cnv -p: the prompt is the first turn
        if echo is not None:
            echo(f"> {first}\n")
        yield first
    if sys.stdin.isatty():
        yield from terminal_turns(show.multiline, _write)
    else:
        yield from piped_turns(show.multiline, echo)


def chat(
    keeper: Keeper, n_predict: int, perf: Perf, bar: PromptBar | None, show: Display, first: str | None = None
) -> int:
    """The chat until its input ends or /exit; returns the exit status: 1 when a turn was
    refused (its prompt did not fit the context), else 0."""
    refused = 0

    def write(text: str) -> None:
        perf.text_arrived()
        _write(text)

    files: list[str] = []  # what /read added, for the next message
    try:
        for line in _turns(first, show):
            text = line.strip()
            if not text:
                continue
            regen = text.split()[0] == "/regen"  # llama-cli ignores what follows
            if regen and (why := keeper.session.regen_refusal()) is not None:
                err.print(f"error: {why}", markup=False, style="red")
                continue
            if _COMMAND.match(text) and not regen:
                if not _command(keeper, text, perf, files):
                    break
                continue
            session = keeper.session
            n0, t0 = session.timings.n_gen, session.timings.t_gen
            perf.turn_started()
            keeper.touch()
            hook = _tokens_hook(session, show.verbose_prompt)
            try:
                if regen:
                    _, gen = session.regenerate(n_predict, write, bar, on_tokens=hook)
                else:  # the files go with this message, whatever becomes of it (llama-cli's)
                    message, files[:] = "".join([*files, text]), []
                    _, gen = session.respond(message, n_predict, write, bar, on_tokens=hook)
            except kvtool.ContextFullError as e:
                refused += 1
                err.print(f"error: {e}; the turn was not answered: /clear starts over, {_MORE}", style="red")
                continue
            except KeyboardInterrupt:  # while the prompt was being decoded: drop the turn
                signals.check()  # SIGTERM, SIGHUP: the chat ends (what it held is kept)
                err.print("(interrupted)", style="yellow")
                continue
            finally:
                if bar is not None:
                    bar.close()
            keeper.changed()  # the turn is saved as soon as it is complete
            signals.check()  # a reply stopped by SIGTERM or SIGHUP is kept, then the chat ends
            _write("\n")
            _stop_note(gen, session.ctx, chat=True)
            dn, dt = session.timings.n_gen - n0, session.timings.t_gen - t0  # this reply's share
            ttft = f", first token {perf.ttft * 1e3:.0f} ms" if perf.ttft is not None else ""
            if show.perf is not False:
                err.print(f"{len(gen.tokens)} tokens, {dn / dt if dt > 0 else 0:.1f} t/s{ttft}", style="dim")
            if show.verbose:
                for row in perf.lines(session.timings):
                    err.print(row, markup=False, style="dim")
    except KeyboardInterrupt as e:  # Ctrl-C at the prompt leaves the chat
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) takes no more output
            _write("\n")
        if isinstance(e, signals.Terminated):
            raise
    if show.perf:
        for row in perf.lines(keeper.session.timings):
            err.print(row, markup=False)
    return 1 if refused else 0
