"""A model file cut short while it is mapped (issue 28, item 4): the next read of a weight past
the new end raised SIGBUS and killed the chat, whose session was never written. Now the read
finds zeros, the decode that read them is refused in one line (and rolled back), and the chat
ends keeping what it had. Each case runs in a child process: a regression would kill it, not
the test run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

import kvtool
from kvtool.kernels import cpu_lib
from tests.helpers import tiny_gguf
from tests.helpers.quantized import quantizing

pytestmark = pytest.mark.skipif(cpu_lib.lib() is None, reason="no C compiler: nothing is guarded")


def test_a_read_past_the_new_end_reads_zeros_and_is_counted(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import mmap, os, sys
        import numpy as np
        from kvtool.kernels import mmap_guard
        path = sys.argv[1]
        with open(path, "wb") as f:
            f.write(b"\\x07" * 3 * mmap.PAGESIZE)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        addr = mmap_guard.guard(mm)
        view = np.frombuffer(mm, dtype=np.uint8)
        assert view[-1] == 7 and mmap_guard.faults(addr) == 0
        os.truncate(path, mmap.PAGESIZE)
        assert view[0] == 7 and view[-1] == 0 and view[2 * mmap.PAGESIZE] == 0
        print("faults", mmap_guard.faults(addr))
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "faults 1", (r.returncode, r.stderr)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose matrices stay in the file's bytes (the memory map) while it runs."""
    with quantizing(lambda name: T.Q8_0 if name in ("token_embd.weight", "output.weight") else T.Q4_0):
        return tiny_gguf.write_tiny_llama(Path(tmp_path_factory.mktemp("q")) / "tiny-q4_0.gguf")


def test_a_chat_whose_model_is_truncated_ends_in_one_line_keeping_its_turns(
    quantized: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(quantized.read_bytes())
    session = tmp_path / "chat.kvs"
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(model), "--session", str(session)]
    p = subprocess.Popen(
        [*cmd, "-n", "4", "--temp", "0"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert p.stdin is not None and p.stderr is not None
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(line.decode() for line in p.stderr), daemon=True).start()  # type: ignore[union-attr]
    p.stdin.write(b"first turn\n")
    p.stdin.flush()
    end = time.monotonic() + 120
    while not any("tokens, " in line for line in err):  # the first reply is done and saved
        assert time.monotonic() < end and p.poll() is None, "".join(err)
        time.sleep(0.02)
    os.truncate(model, kvtool.Model(quantized).file.tensor_info("token_embd.weight").offset)
    p.stdin.write(b"second turn\n")
    p.stdin.close()
    assert p.wait(timeout=120) == 2, "".join(err)
    assert err[-1].startswith("error: ") and "cut short while in use" in err[-1], err
    saved = (kvtool.inspect_state(session).app or {})["chat"]["messages"]
    assert [m["content"] for m in saved[::2]] == ["first turn"]
