"""A chat waiting for its user costs no CPU: the compiled kernels' workers sleep (futex) and
torch's OpenMP workers are passive, measured as the process's CPU time over 10 idle seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from tests.helpers import tiny_gguf
from tests.helpers.quantized import quantizing

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc/PID/stat")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_chat_uses_under_one_percent_of_a_core(tmp_path: Path) -> None:
    with quantizing(lambda name: T.Q4_0):  # the compiled kernels and their pool of 2 threads
        model = tiny_gguf.write_tiny_llama(tmp_path / "tiny-q4_0.gguf")
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(model), "-t", "2", "-n", "8"]
    p = subprocess.Popen(
        [*cmd, "--temp", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        p.stdout.readline()  # the first turn's reply: the model loaded, the pool has worked
        time.sleep(1.0)
        c0, t0 = _cpu_seconds(p.pid), time.monotonic()
        time.sleep(10.0)
        share = (_cpu_seconds(p.pid) - c0) / (time.monotonic() - t0)
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        assert share < 0.01, share
    finally:
        p.kill()
        p.wait()
