"""Every verb on the tiny models of qwen2, qwen3, phi3, gemma2, granite and olmo2 (llama.cpp's
reference models, tests/data/tiny), through the CLI as a user types it: one-shot and chat runs
(each architecture's chat format), bench, batched-bench in both KV modes, parallel, and a state
saved then loaded to continue."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.commands import _register, app

_register()  # every verb, as the console entry point does

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"
ARCHS = ["qwen2", "qwen3", "phi3", "gemma2", "granite", "olmo2"]
runner = CliRunner()


def ok(*args: str, stdin: str | None = None) -> str:
    result = runner.invoke(app, list(args), input=stdin)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("arch", ARCHS)
def test_every_verb_runs(arch: str, tmp_path: Path) -> None:
    m = str(MODELS / f"tiny-{arch}.gguf")
    ok("run", "-m", m, "-no-cnv", "-p", "hello", "-n", "4", "--temp", "0")
    ok("run", "-m", m, "-cnv", "-n", "3", "--temp", "0", stdin="hi there\n")
    out = ok("bench", "-m", m, "-p", "8", "-n", "2", "-r", "1")
    assert arch in out
    for mode in ([], ["-kvu"]):
        ok("batched-bench", "-m", m, "-npp", "8", "-ntg", "2", "-npl", "1,2", *mode)
    ok("parallel", "-m", m, "-np", "2", "-ns", "2", "-n", "4", "-c", "8192")
    state = tmp_path / "s.kvs"
    ok("state", "save", "-m", m, "-p", "hello world", "-o", str(state))
    assert arch in ok("state", "inspect", str(state))
    ok("state", "load", "-m", m, "-i", str(state), "-n", "4")
