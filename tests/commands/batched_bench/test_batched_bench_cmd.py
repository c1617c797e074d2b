"""`kvtool batched-bench` on the tiny model: the table's shape and arithmetic, jsonl, skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool.commands.batched_bench
import kvtool.commands.bench
import kvtool.commands.parallel  # noqa: F401  (register the verbs; with one verb typer drops its name)
from kvtool.commands import app

runner = CliRunner()
HEAD = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"


def run(*args: str) -> tuple[str, str]:
    result = runner.invoke(app, ["batched-bench", *args])
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def table(stdout: str) -> list[list[str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert lines[0] == HEAD
    assert lines[1] == "|-------|--------|------|--------|" + "----------|" * 6
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


@pytest.mark.parametrize("kvu", [[], ["-kvu"]])
def test_md_table_rows_and_n_kv(tiny_llama_path: Path, kvu: list[str]) -> None:
    args = ["-m", str(tiny_llama_path), "-c", "2048", "-npp", "16,32", "-ntg", "4", "-npl", "1,2,4"]
    out, _ = run(*args, *kvu)
    header = [ln for ln in out.splitlines() if ln.startswith("batched-bench:")]
    assert header and f"kv_unified = {int(bool(kvu))}" in header[0] and "n_kv_max = 2048" in header[0]
    rows = table(out)
    assert [(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows] == [
        (pp, 4, pl, pl * (pp + 4)) for pp in (16, 32) for pl in (1, 2, 4)
    ]
    for r in rows:  # S t/s = N_KV / T s, up to the printed rounding
        assert float(r[9]) == pytest.approx(int(r[3]) / float(r[8]), rel=0.02, abs=0.02) or float(r[8]) < 0.05


@pytest.mark.parametrize("kvu", [False, True])
def test_jsonl_shared_prompt_arithmetic(tiny_llama_path: Path, kvu: bool) -> None:
    args = ["-m", str(tiny_llama_path), "-c", "1024", "-npp", "20", "-ntg", "3", "-npl", "1,4", "-pps"]
    out, _ = run(*args, "--output-format", "jsonl", *(["-kvu"] if kvu else []))
    rows = [json.loads(ln) for ln in out.splitlines() if ln.strip()]
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(20, 3, 1), (20, 3, 4)]
    for r in rows:
        n_pp = 20 if kvu else 20 * r["pl"]
        assert r["n_kv"] == n_pp + r["pl"] * 3
        assert r["is_pp_shared"] == 1 and r["kv_unified"] == int(kvu)
        assert r["speed_pp"] == pytest.approx(20 / r["t_pp"])
        assert r["speed_tg"] == pytest.approx(r["pl"] * 3 / r["t_tg"])
        assert r["t"] == pytest.approx(r["t_pp"] + r["t_tg"])
        assert r["speed"] == pytest.approx((20 + r["pl"] * 3) / r["t"])


def test_combinations_that_do_not_fit_are_skipped(tiny_llama_path: Path) -> None:
    # 4 streams of 512 cells: PP 600 fits the 2048-cell total but not one stream
    args = ["-m", str(tiny_llama_path), "-c", "2048", "-npp", "100,600", "-ntg", "4", "-npl", "1,4"]
    out, err = run(*args)
    assert [(int(r[0]), int(r[2])) for r in table(out)] == [(100, 1), (100, 4)]
    assert "skipped PP = 600, TG = 4, B = 1" in err and "per sequence" in err
    out, err = run(*args, "-kvu")  # one buffer: PP 600 with B 1 fits, with B 4 it does not
    assert [(int(r[0]), int(r[2])) for r in table(out)] == [(100, 1), (100, 4), (600, 1)]
    assert "skipped PP = 600, TG = 4, B = 4: needs 2416 cells" in err


def test_bad_lists_are_usage_errors(tiny_llama_path: Path) -> None:
    result = runner.invoke(app, ["batched-bench", "-m", str(tiny_llama_path), "-npl", "0"])
    assert result.exit_code == 2
    result = runner.invoke(app, ["batched-bench", "-m", str(tiny_llama_path), "-npp", "x"])
    assert result.exit_code == 2
