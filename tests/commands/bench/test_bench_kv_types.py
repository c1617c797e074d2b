"""`kvtool bench -ctk/-ctv`: the table reports the K and V types the cache really has (issue 8:
V used to be built with K's type while the table printed -ctv's)."""

from __future__ import annotations

import json
import subprocess
import sys
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


GEMMA3 = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-gemma3.gguf"  # heads of 32


@pytest.mark.parametrize(("ctk", "ctv"), [("q8_0", "q4_0"), ("iq4_nl", "f16")])
def test_quantized_types_are_blocks_and_the_kv_size_is_reported(ctk: str, ctv: str) -> None:
    """A quantized cache holds its blocks (q8_0: 34 bytes per 32 values), and bench reports each
    context's KV size as llama.cpp's log line does, on stderr."""
    args = [
        "bench",
        "-m",
        str(GEMMA3),
        "-p",
        "8",
        "-n",
        "2",
        "-r",
        "1",
        "-ctk",
        ctk,
        "-ctv",
        ctv,
        "-o",
        "json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {(r["type_k"], r["type_v"]) for r in rows} == {(ctk, ctv)}
    lines = [x for x in result.stderr.splitlines() if x.startswith("KV cache")]
    assert lines and all(f"K ({ctk}):" in x and f"V ({ctv}):" in x for x in lines)
    ctx = kvtool.Context(kvtool.Model(GEMMA3), kvtool.ContextParams(n_ctx=256, type_k=ctk, type_v=ctv))
    per = {"q8_0": 34, "q4_0": 18, "iq4_nl": 18, "f16": 64}  # bytes per 32 values
    for b in ctx.memory_breakdown().kv:
        values = b.n_cells * b.n_stream * b.n_layer * 2 * 32  # 2 KV heads of 32
        assert (b.k, b.v) == (values // 32 * per[ctk], values // 32 * per[ctv])
        assert f"K ({ctk}): {b.k / 2**20:7.2f} MiB" in "\n".join(lines)


def test_batched_bench_reports_the_kv_size() -> None:
    args = ["batched-bench", "-m", str(GEMMA3), "-npp", "8", "-ntg", "2", "-npl", "2", "-ctk", "q5_1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [x for x in result.stderr.splitlines() if x.startswith("KV cache")]
    assert len(lines) == 2 and "(sliding window)" in lines[1]
    assert all("2 streams), K (q5_1)" in x and "V (f16)" in x for x in lines)


@pytest.mark.parametrize(
    ("ctk", "msg"),
    [
        ("q8_0", "K cache type q8_0 with block size 32 does not divide n_embd_head_k=16"),
        ("q3_k", "unsupported KV cache type 'q3_k' (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)"),
    ],
)
def test_a_type_the_cache_cannot_take_is_one_line(tiny_llama_path: Path, ctk: str, msg: str) -> None:
    args = ["bench", "-m", str(tiny_llama_path), "-p", "8", "-n", "0", "-r", "1", "-ctk", ctk]
    r = subprocess.run(
        [sys.executable, "-m", "kvtool.commands", *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: {msg}"], r.stderr
