"""Special files as every input and output path of every verb (tests/fuzz/special_files.py):
the whole sweep, each case in the CLI fuzzer's worker (memory and time limited)."""

from __future__ import annotations

from pathlib import Path

from tests.fuzz.special_files import all_cases, describe, fed, make_specials
from tests.fuzz.test_cli_fuzz import Files, Worker, problem


def test_every_path_takes_every_special_file(files: Files, worker: Worker, tmp_path: Path) -> None:
    specials = make_specials(tmp_path)
    found = []
    for slot, special, case in all_cases(files, specials):
        with fed(special):
            res = worker.run(case.argv, case.stdin, timeout=20.0)
        p = problem(res)
        if p is not None:
            found.append(f"{describe(slot, special)}: {case.line()}\n    -> {p}")
    assert not found, f"{len(found)} failures:\n" + "\n".join(found[:30])
