"""@flags: a verb's flag groups spread into its command line, built back into one object each."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from typer.testing import CliRunner

from kvtool.commands import common


def _verb(seen: dict[str, object]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @common.flags
    def verb(
        context: common.ContextFlags = common.ContextFlags(ctx_size=128),
        sampling: common.SamplingFlags = common.SamplingFlags(temp=0.0),
        ctx_size: Annotated[int, typer.Option("-c", help="The verb's own -c.")] = 7,
        n: Annotated[int, typer.Option("-n")] = 1,
    ) -> None:
        seen.update(context=context, sampling=sampling, ctx_size=ctx_size, n=n)

    return app


def test_groups_are_built_from_their_flags_with_the_verbs_defaults() -> None:
    seen: dict[str, object] = {}
    r = CliRunner().invoke(_verb(seen), ["-ctk", "f16", "-kvu", "--top-k", "5", "-n", "3"])
    assert r.exit_code == 0, r.output
    assert seen["context"] == common.ContextFlags(ctx_size=7, type_k="f16", kv_unified=True)
    assert seen["sampling"] == common.SamplingFlags(temp=0.0, top_k=5)
    assert seen["n"] == 3


def test_a_verbs_own_declaration_replaces_the_groups() -> None:
    seen: dict[str, object] = {}
    app = _verb(seen)
    r = CliRunner().invoke(app, ["-c", "64"])
    assert r.exit_code == 0, r.output
    assert seen["ctx_size"] == 64 and dataclasses.replace(seen["context"]).ctx_size == 64  # type: ignore[type-var]
    help_text = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output  # no wrapping
    assert "The verb's own -c." in help_text and "Context size" not in help_text


def test_a_groups_checks_still_run() -> None:
    r = CliRunner().invoke(_verb({}), ["--top-p", "2"])
    assert r.exit_code != 0 and "--top-p" in r.output
