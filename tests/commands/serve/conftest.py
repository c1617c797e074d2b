"""`kvtool serve` as a user starts it: a child process on a free loopback port with a tiny model,
waited for on /health, stopped with SIGINT (which must end it cleanly)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

MODEL = Path(__file__).parent.parent.parent / "data" / "tiny" / "models" / "tiny-llama.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen[str]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> tuple[int, str]:
        """Sends `sig`; returns the exit code and what the server wrote on stderr."""
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err


def start(*flags: str, port: int | None = None, model: Path = MODEL) -> Served:
    port = port or free_port()
    cmd = [sys.executable, "-m", "kvtool.commands", "serve", "-m", str(model), "--port", str(port), "-t", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.communicate()[1]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return Served(url, port, proc)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not answer /health within 60 s")


@contextmanager
def serving(*flags: str, port: int | None = None, model: Path = MODEL) -> Iterator[Served]:
    s = start(*flags, port=port, model=model)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            rc, err = s.stop()
            assert rc == 0, err


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    """Four slots of 1024 tokens, /metrics on."""
    with serving("-np", "4", "-c", "4096", "--metrics") as s:
        yield s
