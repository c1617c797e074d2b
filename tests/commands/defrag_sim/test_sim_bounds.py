"""defrag-sim refuses, in one line and before its memory grows, what it cannot simulate (issue
28, item 5): a trace that is a device, huge, nested deeply or names a cache of 10**12 cells,
10**12 requests (it drew 7 TiB of lengths), a workload of more decode steps than its series
can hold."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

HEADER = {"kvtool_trace": 1, "n_ctx": 64, "n_seq": 2, "n_ubatch": 16, "kv_unified": True}


def _limit() -> None:  # a refusal comes long before the child has used 4 GiB of address space
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))


def sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtool.commands", "defrag-sim", *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit,
    )


def trace(tmp_path: Path, *events: object, header: object = HEADER, raw: str = "") -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in (header, *events)) + "\n" + raw)
    return str(p)


def fifo(tmp_path: Path) -> str:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    # a writer that never stops: the reader must stop at its first line
    subprocess.Popen(["sh", "-c", f"yes '{'x' * 100}' > {path}"], stderr=subprocess.DEVNULL)
    return str(path)


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (lambda t: "/dev/zero", "longer than 4096 bytes"),
        (lambda t: "/dev/urandom", "not"),
        (lambda t: str(t), "cannot read"),  # a directory
        (fifo, "not JSON"),
        (lambda t: trace(t, raw="[" * 4000 + "\n"), "nested too deeply"),
        (lambda t: trace(t, header={**HEADER, "n_ctx": 10**12}), "more than 1048576"),
        (lambda t: trace(t, header={**HEADER, "n_ubatch": "x"}), "n_ubatch"),
        (lambda t: trace(t, {"step": 10**11, "event": "alloc", "seq": 0, "n_tokens": 1}), "decode steps"),
    ],
    ids=["zero", "urandom", "directory", "fifo", "nested", "cells", "ubatch", "steps"],
)
def test_a_trace_it_cannot_replay_is_one_line(tmp_path: Path, make, msg: str) -> None:  # type: ignore[no-untyped-def]
    r = sim("--trace", make(tmp_path))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--requests", "1000000000000"], "must be in [1, 200000]"),
        (["-c", "1000000000000"], "must be in [1, 1048576]"),
        (["--gen-len", "fixed:1000000", "-c", "1048576"], "decode steps"),
    ],
)
def test_a_workload_too_large_is_one_line(args: list[str], msg: str) -> None:
    r = sim(*args)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and msg in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
