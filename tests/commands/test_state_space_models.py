"""Every verb on the recurrent and hybrid tiny models (llama.cpp's reference models), through
the CLI: what applies works, what does not says so in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.commands import _register, app

_register()  # every verb, as the console entry point does

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"
runner = CliRunner()


def ok(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("arch", ["mamba", "rwkv7", "lfm2"])
def test_every_verb_runs(arch: str, tmp_path: Path) -> None:
    m = str(MODELS / f"tiny-{arch}.gguf")
    out = ok("run", "-m", m, "-no-cnv", "-p", "hello", "-n", "4", "--temp", "0", "-v", "--rs-seq", "2")
    assert "bytes per sequence (--rs-seq 2)" in out
    assert re.search(r"; backend: CPU \([^)]+\);", out)  # -v names what computes
    ok("bench", "-m", m, "-p", "8", "-n", "2", "-r", "1")
    for mode in ([], ["-kvu"]):
        ok("batched-bench", "-m", m, "-npp", "8", "-ntg", "2", "-npl", "1,2", *mode)
    ok("parallel", "-m", m, "-np", "2", "-ns", "2", "-n", "4", "-c", "8192")
    state = tmp_path / "s.kvs"
    ok("state", "save", "-m", m, "-p", "hello world", "-o", str(state))
    assert f"{arch}" in ok("state", "inspect", str(state))
    ok("state", "load", "-m", m, "-i", str(state), "-n", "4")


def test_what_does_not_apply_says_so() -> None:
    m = str(MODELS / "tiny-mamba.gguf")
    result = runner.invoke(app, ["run", "-m", m, "-no-cnv", "-p", "hi", "-n", "2", "--context-shift"])
    assert result.exit_code != 0 and "cannot shift" in str(result.exception)  # main() prints it as one line
    out = ok("run", "-m", m, "-no-cnv", "-p", "hi", "-n", "2", "-kvu", "--temp", "0")
    assert "no KV cache to unify" in out
