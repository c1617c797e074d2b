"""`kvtool bench -ctk/-ctv`: the table reports the K and V types the cache really has (issue 8:
V used to be built with K's type while the table printed -ctv's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvtool
import kvtool.commands.batched_bench
import kvtool.commands.bench
import kvtool.commands.parallel  # registers the verbs (with one verb typer drops its name)
from kvtool.commands import app

runner = CliRunner()
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize(("ctk", "ctv"), [("f32", "f16"), ("bf16", "f32")])
def test_table_types_are_the_cache_types(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, ctk: str, ctv: str
) -> None:
    seen: list[kvtool.Context] = []
    real_init = kvtool.Context.__init__

    def spy(self: kvtool.Context, *a: object, **k: object) -> None:
        real_init(self, *a, **k)  # type: ignore[arg-type]
        seen.append(self)

    monkeypatch.setattr(kvtool.Context, "__init__", spy)
    args = ["bench", "-m", str(tiny_llama_path), "-p", "8", "-n", "0", "-r", "1", "-ctk", ctk, "-ctv", ctv]
    result = runner.invoke(app, [*args, "-o", "json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row["type_k"], row["type_v"]) == (ctk, ctv)
    assert seen
    for ctx in seen:
        mem = ctx.memory
        assert {t.dtype for t in mem.k.values()} == {DTYPES[ctk]}  # type: ignore[attr-defined]
        assert {t.dtype for t in mem.v.values()} == {DTYPES[ctv]}  # type: ignore[attr-defined]
