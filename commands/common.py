"""Options and helpers shared by the verbs."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

import kvtool

ModelOpt = Annotated[
    str,
    typer.Option("-m", "--model", help="A known model name (see `kvtool models`) or a GGUF file path."),
]


def load_model_with_status(name_or_path: str, console: Console) -> kvtool.Model:
    """Resolves (fetching a known model if needed) and loads, with a spinner on stderr."""
    path = kvtool.resolve_model(name_or_path)
    with console.status(f"loading {path.name}", spinner="dots"):
        return kvtool.Model(path)


SwaFullOpt = Annotated[
    bool,
    typer.Option("--swa-full", help="Full-size sliding-window caches (no cell reuse outside the window)."),
]

KvUnifiedOpt = Annotated[
    bool,
    typer.Option(
        "-kvu", "--kv-unified", help="One KV buffer shared by all sequences (else one stream each)."
    ),
]
