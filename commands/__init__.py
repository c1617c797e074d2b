"""The `kvtool` command line: one module per verb, on kvtool's public API only."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Annotated, Any, TextIO

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 carries its own click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on the system click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[assignment]

from kvtool import KvtoolError

# verb -> (its module under kvtool.commands, its line in `kvtool --help`). Only the module of the
# verb a command line names is imported: `kvtool run --help` loads run's flags, not bench's.
VERBS: dict[str, tuple[str, str]] = {
    "run": ("run", "Chat, or complete a prompt (llama-cli; ollama's run MODEL)."),
    "list": ("models", "Known models, their sizes, whether cached (ollama's list)."),
    "pull": ("models", "Fetch known models into the cache (ollama's pull)."),
    "models": ("models", "Known models by name: list, fetch, path."),
    "bench": ("bench", "Prompt processing and generation speed (llama-bench)."),
    "batched-bench": ("batched_bench", "Batched decoding speed (llama-batched-bench)."),
    "serve": ("serve", "An OpenAI-compatible server with slots and a KV ledger (llama-server)."),
    "parallel": ("parallel", "Simulated clients, on the engine or a server (llama-parallel)."),
    "state": ("state", "Save a KV state, continue from it, inspect files and stores."),
    "defrag-sim": ("defrag_sim", "Compare KV slot policies on a workload (no model needed)."),
    "kv-types": ("kv_types", "Precision and size of each K/V cache type on a model and text."),
}


class _Verbs(TyperGroup):
    """The root command: its help lists every verb from VERBS, imported or not."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:  # click's, as typer carries it
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_, summary) in VERBS.items()])


app = typer.Typer(
    cls=_Verbs,
    name="kvtool",
    help="llama.cpp's tools on kvtool's engine: chat, benchmarks, KV memory experiments.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: readable piped and in 80 columns
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    """kvtool's and torch's versions, read from the installed packages: importing torch (and
    asking CUDA for its GPUs) would take seconds; `--list-devices` does that."""
    if not value:
        return
    from importlib import metadata

    torch = metadata.version("torch")
    build = "CPU only" if "+cpu" in torch else "CPU and CUDA"
    print(f"kvtool {metadata.version('kvtool')}, torch {torch} ({build})")
    print("devices: `kvtool run --list-devices` lists the GPUs torch sees; -t sets the CPU threads")
    raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="kvtool's and torch's versions."),
    ] = False,
) -> None:
    """llama.cpp's tools on kvtool's engine: chat, benchmarks, KV memory experiments."""


def _register(verb: str | None = None) -> None:
    """Imports the module of `verb` (None: every verb's), which adds its verb to `app`."""
    import importlib

    modules = {VERBS[verb][0]} if verb is not None else {m for m, _ in VERBS.values()}
    for module in sorted(modules):
        importlib.import_module(f"kvtool.commands.{module}")


def _verb(argv: list[str]) -> str | None:
    """The verb a command line names (the root's own options take no value), if it is one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in VERBS else ""


def _os_error(e: OSError) -> str:
    """One line for an OSError: the path (shortened when absurdly long) and the system's words."""
    name = "" if e.filename is None else str(e.filename)
    if len(name) > 120:
        name = f"{name[:60]}...{name[-40:]} ({len(name)} characters)"
    return f"{name}: {e.strerror or e}" if name else str(e.strerror or e)


def _say(text: str) -> None:
    """One line on stderr, its control characters escaped; nothing when stderr is gone (a
    closed terminal): the exit status still tells."""
    from kvtool.commands.common.text import printable

    with contextlib.suppress(OSError, ValueError):
        print(printable(text), file=sys.stderr, flush=True)


def _open_closed_streams() -> None:
    """A standard stream closed before the start (`kvtool ... >&-`) reads or writes nothing, as
    /dev/null, instead of failing at its first use."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is None:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8"))  # noqa: SIM115


def main() -> None:
    """Console entry point: user errors are one line on stderr and exit code 2; SIGINT ends with
    130, SIGTERM and SIGHUP with 128 + their number, after the verb has saved what it keeps."""
    _open_closed_streams()
    from kvtool.commands.common import signals  # first: the verb's imports take a while

    argv = sys.argv[1:]
    try:
        with signals.installed():
            try:
                verb = _verb(argv)
                if verb:
                    _register(verb)
                from kvtool.commands.common.text import reconfigure_std_streams
                from kvtool.commands.flags import check_argv

                reconfigure_std_streams()
                warnings.showwarning = _one_line_warning
                command = typer.main.get_command(app)  # built once (40 ms): checked, then run
                check_argv(command, argv)
                rc = command(args=argv, prog_name="kvtool", standalone_mode=False)
            finally:
                # SIGTERM or SIGHUP ended the verb, whatever it turned into on the way (typer's
                # exit 130, a write to the closed terminal): the exit says which
                end = signals.ending()
                if end is not None:
                    raise end from None
    except NoArgsIsHelpError as e:
        _say(e.ctx.get_help() if e.ctx is not None else "")
        sys.exit(2)
    except UsageError as e:  # bad flags or values: one line, like every other user error
        where = e.ctx.command_path if e.ctx is not None else "kvtool"
        _say(f"error: {e.format_message()} (see '{where} --help')")
        sys.exit(2)
    except ClickException as e:
        _say(f"error: {e.format_message()}")
        sys.exit(e.exit_code)
    except KvtoolError as e:
        _say(f"error: {e}")
        sys.exit(2)
    except OSError as e:  # the system refused a path the user gave (too long, a file as folder...)
        _say(f"error: {_os_error(e)}")
        sys.exit(2)
    except signals.Terminated as e:
        _say(f"(ended by {e})")
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        _say("")
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """The engine's warnings while a verb runs (CUDA graphs turned off, ...): one line on
    stderr, as the verbs' own notes, not Python's file:line form with a source line."""
    with contextlib.suppress(OSError, ValueError):
        print(f"warning: {message}", file=file or sys.stderr)


def console() -> None:
    """The process entry point (the `kvtool` script, `python -m kvtool.commands`): `main`, then
    the process ends at once with its exit status, its output flushed. Python's own teardown
    (finalizing torch's modules and objects) took 0.4-0.6 s after the last token of a one-shot
    run; nothing of kvtool's is left to it (files are written and closed before `main` returns,
    no atexit hooks). An unexpected exception still ends the normal way, with its traceback."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message") prints it and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing reaches it
            stream.flush()
    os._exit(code & 0xFF if code >= 0 else 1)
