"""-ctk/-ctv with quantized types through every verb that builds a context (tiny gemma3: heads of
32, so every type fits): run (and -v's KV line), parallel, state save and load (a state loads
only with the types it was saved with: one error line otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import kvtool.commands.parallel
import kvtool.commands.run
import kvtool.commands.state  # noqa: F401 - register the verbs
from kvtool.commands import app

runner = CliRunner()
GEMMA3 = str(Path(__file__).parents[1] / "data" / "tiny" / "models" / "tiny-gemma3.gguf")
KV = ["-ctk", "q4_0", "-ctv", "q8_0"]


def cli(*args: str) -> tuple[str, str]:
    r = runner.invoke(app, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout, r.stderr


def test_run_with_quantized_types_and_its_verbose_kv_line() -> None:
    out, err = cli(
        "run", "-m", GEMMA3, "-p", "hello the cat", "-n", "4", "--no-chat", "-v", "--temp", "0", *KV
    )
    assert out
    lines = [x for x in err.splitlines() if x.startswith("KV cache")]
    assert len(lines) == 2 and all("K (q4_0)" in x and "V (q8_0)" in x for x in lines)
    _, err = cli("run", "-m", GEMMA3, "-p", "hello", "-n", "1", "--no-chat", "-v")
    assert "K (f16)" in err and "V (f16)" in err  # the default


def test_parallel_with_quantized_types(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    args = ["-np", "2", "-ns", "3", "-n", "4", *KV, "--json", str(f)]
    cli("parallel", "--no-progress", "-m", GEMMA3, *args)
    summary = json.loads(f.read_text())
    assert len(summary["records"]) == 3 and summary["n_gen"] == 12


def test_state_save_and_load_keep_their_types(tmp_path: Path) -> None:
    f = str(tmp_path / "s.kvs")
    want, _ = cli(
        "run",
        "-m",
        GEMMA3,
        "-p",
        "hello the cat sat",
        "-n",
        "6",
        "--no-chat",
        "--temp",
        "0",
        "-c",
        "512",
        *KV,
    )
    cli("state", "save", "-m", GEMMA3, "-p", "hello the cat sat", "-o", f, "-c", "512", *KV)
    got, _ = cli("state", "load", "-m", GEMMA3, "-i", f, "-n", "6", "-c", "512", *KV)
    assert got == want
    # without -ctk/-ctv the file's types are taken (this sliding-window model's from its KV parts)
    assert cli("state", "load", "-m", GEMMA3, "-i", f, "-n", "6", "-c", "512")[0] == want
    args = ["state", "load", "-m", GEMMA3, "-i", f, "-n", "6", "-c", "512", "-ctk", "f16", "-ctv", "f16"]
    r = subprocess.run(
        [sys.executable, "-m", "kvtool.commands", *args], capture_output=True, text=True, timeout=600
    )
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "K type differ (state Q4_0, context F16)" in errors[0]
