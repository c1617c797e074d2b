"""`kvtool kv-types`: the precision report. Its numbers against an independent computation with
the public API and plain math (KL over the full vocabulary, top-1, perplexity on each chunk's
second half, bytes from the block sizes); formats; one-line refusals."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.kv_types
from kvtool.commands import app
from kvtool.common.cells import read_kv_dims

runner = CliRunner()
GEMMA3 = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-gemma3.gguf"  # heads of 32
TEXT = " ".join(["the cat sat on the mat and the dog ran to the hello world"] * 12)


def cli(*args: str) -> str:
    r = runner.invoke(app, ["kv-types", "-m", str(GEMMA3), "-p", TEXT, "--no-progress", *args])
    assert r.exit_code == 0, r.output
    return r.stdout


def logits_of(model: kvtool.Model, chunk: list[int], k: str, v: str) -> np.ndarray:
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=len(chunk), type_k=k, type_v=v))
    ctx.decode(kvtool.Batch.from_tokens(chunk, logits="all"))
    return np.asarray(ctx.logits(), dtype=np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def test_numbers_are_the_plain_math() -> None:
    doc = json.loads(cli("--types", "q8_0,q4_0/q5_1", "-c", "64", "-b", "16", "-o", "json"))
    model = kvtool.Model(GEMMA3)
    tokens = model.tokenize(TEXT, add_special=True, parse_special=False)
    chunks = [tokens[i : i + 64] for i in range(0, len(tokens) - 63, 64)]
    assert doc["n_chunks"] == len(chunks) and doc["n_ctx_chunk"] == 64
    assert doc["n_scored"] == len(chunks) * 31  # positions 32 .. 62 of each chunk
    pairs = {(p["type_k"], p["type_v"]): p for p in doc["pairs"]}
    assert list(pairs) == [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q5_1")]
    per = {"f16": 64, "q8_0": 34, "q4_0": 18, "q5_1": 24}  # bytes per 32 values
    dims = read_kv_dims(GEMMA3)
    for (k, v), row in pairs.items():
        ref_lp, lp, nll = [], [], []
        for c in chunks:
            a = log_softmax(logits_of(model, c, "f16", "f16"))[32:63]
            b = log_softmax(logits_of(model, c, k, v))[32:63]
            ref_lp.append(a)
            lp.append(b)
            nll += [-b[i, c[33 + i]] for i in range(31)]
        ref, got = np.concatenate(ref_lp), np.concatenate(lp)
        kl = (np.exp(ref) * (ref - got)).sum(axis=1)
        assert row["kl"] == pytest.approx(kl.mean(), abs=2e-6)
        assert row["top1"] == pytest.approx((ref.argmax(1) == got.argmax(1)).mean(), abs=1e-4)
        assert row["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
        values = sum(dims.n_head_kv) * dims.head_dim_k  # of K (and of V) per cell
        assert row["bytes_per_token"] == values // 32 * (per[k] + per[v])
        ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=model.n_ctx_train, type_k=k, type_v=v))
        held = ctx.memory_breakdown()
        assert row["kv_mib"] == round(sum(b.k + b.v for b in held.kv) / 2**20, 2)
    assert pairs[("f16", "f16")]["kl"] == 0.0 and pairs[("f16", "f16")]["top1"] == 1.0
    assert 0 < pairs[("q8_0", "q8_0")]["kl"] < pairs[("q4_0", "q5_1")]["kl"]


def test_markdown_and_csv() -> None:
    md = cli("--types", "q8_0", "-c", "64")
    assert "KL and top-1 against K/V f16" in md and "| q8_0 | q8_0 | 544 |" in md
    rows = list(csv.DictReader(io.StringIO(cli("--types", "q8_0", "-c", "64", "--ref", "f32", "-o", "csv"))))
    assert [(r["type_k"], r["type_v"]) for r in rows] == [("f32", "f32"), ("q8_0", "q8_0")]
    assert float(rows[0]["kl"]) == 0.0 and float(rows[1]["kl"]) > 0


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (
            ["-m", "TINY_LLAMA", "-p", TEXT, "--types", "q8_0"],
            "K cache type q8_0 with block size 32 does not divide",
        ),
        (["-m", str(GEMMA3), "-p", TEXT, "--types", "q3_k"], "unsupported KV cache type 'q3_k'"),
        (["-m", str(GEMMA3), "-p", ""], "too short to score"),
    ],
)
def test_refusals_are_one_line(args: list[str], msg: str, tiny_llama_path: Path) -> None:
    args = [str(tiny_llama_path) if a == "TINY_LLAMA" else a for a in args]
    r = subprocess.run(
        [sys.executable, "-m", "kvtool.commands", "kv-types", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and msg in errors[0], r.stderr


def test_text_from_one_place() -> None:
    r = runner.invoke(app, ["kv-types", "-m", str(GEMMA3)])
    assert r.exit_code == 2 and "-f or -p" in r.output
