"""The `kvtool` command line: one module per verb, on kvtool's public API only."""

from __future__ import annotations

import sys

import typer

from kvtool import KvtoolError

app = typer.Typer(
    name="kvtool",
    help="llama.cpp's tools on kvtool's engine: chat, benchmarks, KV memory experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # each module adds its verb to `app`
    from kvtool.commands import batched_bench, bench, models, parallel, run, state  # noqa: F401


def main() -> None:
    """Console entry point: user errors are one line on stderr and exit code 2."""
    _register()
    try:
        app()
    except KvtoolError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
