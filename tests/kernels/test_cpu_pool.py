"""kernels/cpu_pool.c from C: every item of every task done exactly once, and an idle pool
asleep (process CPU time over an idle second), with the futex (Linux) and with the condition
variable the other systems use (built here with KV_POOL_NO_FUTEX)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvtool.kernels import cpu_lib

KERNELS = Path(cpu_lib.__file__).parent
HARNESS = Path(__file__).parent / "c" / "pool_idle.c"
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


@pytest.mark.parametrize("defines", [[], ["-DKV_POOL_NO_FUTEX"]], ids=["futex", "condition-variable"])
def test_the_pool_does_every_item_once_and_sleeps_when_idle(tmp_path: Path, defines: list[str]) -> None:
    exe = tmp_path / "pool_idle"
    cmd = [CC, "-O2", "-std=c11", "-pthread", *defines, f"-I{KERNELS}", str(HARNESS)]
    subprocess.run([*cmd, str(KERNELS / "cpu_pool.c"), "-o", str(exe)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0] == "ok", out
    assert float(out[1]) < 0.05  # three workers spinning would take about 3 s of CPU
