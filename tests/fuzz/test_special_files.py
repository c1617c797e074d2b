"""Special files as every input and output path of every verb (tests/fuzz/special_files.py):
the whole sweep, each case in the CLI fuzzer's worker (memory and time limited)."""

from __future__ import annotations

from pathlib import Path

from tests.fuzz.special_files import describe, sweep
from tests.fuzz.test_cli_fuzz import Files, Worker


def test_every_path_takes_every_special_file(files: Files, worker: Worker, tmp_path: Path) -> None:
    found = [
        f"{describe(o.slot, o.special)}: {o.case.line()}\n    -> {o.problem}"
        for o in sweep(files, worker, tmp_path)
        if o.problem is not None
    ]
    assert not found, f"{len(found)} failures:\n" + "\n".join(found[:30])
