"""`kvtool bench` on the tiny model: the markdown table's shape, and csv/json/jsonl that parse
and carry the same numbers (one run prints two formats with -o and -oe)."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.batched_bench
import kvtool.commands.bench
import kvtool.commands.parallel
from kvtool.commands import app
from kvtool.commands.bench.report import FIELDS

runner = CliRunner()
SMALL = ["-p", "16", "-n", "3", "-pg", "8,2", "-r", "2"]


def run(*args: str) -> tuple[str, str]:
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def md_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("|")]


def test_md_table_shape(tiny_llama_path: Path) -> None:
    out, _ = run("-m", str(tiny_llama_path), *SMALL, "-d", "0,4")
    rows = md_rows(out)
    assert rows[0] == ["model", "size", "params", "backend", "threads", "test", "t/s"]
    assert all(set(c) <= {"-", ":"} for c in rows[1])
    assert rows[1][0].endswith("-") and rows[1][-1].endswith(":")  # model left, t/s right aligned
    body = rows[2:]
    # llama-bench's backend, with the CPU kernels' path the model computes with
    backend = kvtool.Model(tiny_llama_path).backend.name
    assert re.fullmatch(r"CPU \((AVX2|AVX512 VNNI|NEON|NEON dotprod|portable|torch)\)", backend)
    assert [r[5] for r in body] == ["pp16", "tg3", "pp8+tg2", "pp16 @ d4", "tg3 @ d4", "pp8+tg2 @ d4"]
    for r in body:
        assert re.fullmatch(r"llama \d+K F32", r[0]) and r[1].endswith(" MiB") and r[2].endswith(" M")
        assert r[3] == backend and int(r[4]) >= 1
        assert re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", r[6])
    assert len({len(ln) for ln in out.splitlines() if ln.startswith("|")}) == 1  # aligned columns
    assert re.search(r"^build: kvtool-", out, re.M)


def test_sweep_columns_and_models(tiny_llama_path: Path) -> None:
    m = str(tiny_llama_path)
    out, _ = run("-m", m, "-m", m, "-p", "8", "-n", "0", "-r", "1", "-b", "4,8", "-t", "1", "-kvu")
    rows = md_rows(out)
    assert rows[0] == ["model", "size", "params", "backend", "threads", "n_batch", "kvu", "test", "t/s"]
    assert [(r[4], r[5], r[6], r[7]) for r in rows[2:]] == [
        ("1", "4", "1", "pp8"),
        ("1", "8", "1", "pp8"),
    ] * 2
    assert all(r[8].endswith("± 0.00") for r in rows[2:])  # one repetition: no spread


def check_record(rec: dict, reps: int) -> None:
    ns, ts = rec["samples_ns"], rec["samples_ts"]
    assert len(ns) == len(ts) == reps
    n = rec["n_prompt"] + rec["n_gen"]
    assert ts == pytest.approx([1e9 * n / t for t in ns])
    assert rec["avg_ns"] == sum(ns) // reps
    assert rec["avg_ts"] == pytest.approx(sum(ts) / reps, abs=1e-6)
    mean = sum(ts) / reps
    assert rec["stddev_ts"] == pytest.approx((sum((x - mean) ** 2 for x in ts) / (reps - 1)) ** 0.5, abs=1e-6)


@pytest.mark.parametrize(("fmt", "fmt_err"), [("json", "csv"), ("jsonl", "json")])
def test_machine_formats_agree(tiny_llama_path: Path, fmt: str, fmt_err: str) -> None:
    out, err = run("-m", str(tiny_llama_path), *SMALL, "-o", fmt, "-oe", fmt_err)

    def parse(text: str, f: str) -> list[dict]:
        if f == "json":
            return json.loads(text[text.index("[") :])
        if f == "jsonl":
            return [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
        lines = text[text.index(FIELDS[0]) :].splitlines()
        return list(csv.DictReader(io.StringIO("\n".join(lines))))

    recs, other = parse(out, fmt), parse(err, fmt_err)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in recs] == [(16, 0, 0), (0, 3, 0), (8, 2, 0)]
    for rec, o in zip(recs, other, strict=True):
        assert list(rec)[: len(FIELDS)] == list(FIELDS)
        check_record(rec, 2)
        assert rec["kv_unified"] is False and rec["n_batch"] == 2048 and rec["n_ubatch"] == 512
        for f in FIELDS:  # the same numbers in both formats
            if fmt_err == "csv":
                want = str(int(rec[f])) if isinstance(rec[f], bool) else rec[f]
                want = f"{want:.6f}" if isinstance(want, float) else str(want)
                assert o[f] == want, f
            else:
                assert o[f] == rec[f], f


def test_bad_values_are_usage_errors(tiny_llama_path: Path) -> None:
    for args in (["-o", "xml"], ["-pg", "8"], ["-p", "1-x"], ["-r", "0"]):
        result = runner.invoke(app, ["bench", "-m", str(tiny_llama_path), *args])
        assert result.exit_code == 2, args


def test_a_table_read_from_both_streams_is_whole(tiny_llama_path: Path) -> None:
    """`bench ... 2>&1` off a terminal: nothing on stderr splits the table (a stopped progress
    display used to leave a blank line after every row)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvtool.commands", "bench", "-m", str(tiny_llama_path), *SMALL]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    table = [i for i, ln in enumerate(lines) if ln.startswith("|")]
    assert len(table) == 5, r.stdout
    assert all(lines[i].strip() for i in range(table[0], table[-1])), r.stdout  # no blank line


def test_a_missing_model_is_refused_before_any_test(tiny_llama_path: Path, tmp_path: Path) -> None:
    """`-m a -m b -m missing.gguf` ran the first two benchmarks before refusing the third
    (issue 28, item 10): every -m is checked first."""
    missing = tmp_path / "missing.gguf"
    result = runner.invoke(app, ["bench", "-m", str(tiny_llama_path), "-m", str(missing), *SMALL])
    assert isinstance(result.exception, kvtool.KvtoolError) and "missing.gguf" in str(result.exception)
    assert "pp16" not in result.stdout  # no test ran


def test_a_range_that_lists_nothing_is_refused(tiny_llama_path: Path) -> None:
    """`-p 512-128` printed an empty table and exited 0."""
    result = runner.invoke(app, ["bench", "-m", str(tiny_llama_path), "-p", "512-128", "-n", "0"])
    assert result.exit_code == 2 and "lists nothing" in result.output
