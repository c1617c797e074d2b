"""The special-files sweep (tests/fuzz/test_special_files.py) with its outcomes counted.

    .venv/bin/python -m benchmarks.fuzz_special_files

Runs every path option and argument of every verb, and the chat's /load and /save, with each
special file of tests/fuzz/special_files.py once (the CI test runs the same cases and only
asserts), and prints per special file how many cases ran (exit 0), were refused with an
`error:` line, or failed (a traceback, a hang, an exit without an error line), then every
failure. Exit status 1 when there was a failure.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz.special_files import describe, sweep
from tests.fuzz.test_cli_fuzz import Files, Worker

KINDS = ("ran", "refused", "failed")


def main() -> int:
    tally: collections.Counter[tuple[str, str]] = collections.Counter()
    names: list[str] = []
    failures: list[str] = []
    start = time.monotonic()
    worker = Worker()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "files").mkdir()
        (root / "specials").mkdir()
        try:
            for o in sweep(Files.make(root / "files"), worker, root / "specials"):
                if o.special.name not in names:
                    names.append(o.special.name)
                tally[(o.special.name, o.kind)] += 1
                if o.problem is not None:
                    failures.append(f"{describe(o.slot, o.special)}: {o.case.line()} -> {o.problem}")
        finally:
            worker.close()
    n = sum(tally.values())
    print(f"{n} cases in {time.monotonic() - start:.0f} s")
    print("| special file | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 1) + "|")
    for name in names:
        print(f"| {name} | " + " | ".join(str(tally[(name, k)]) for k in KINDS) + " |")
    print("| all | " + " | ".join(str(sum(tally[(m, k)] for m in names)) for k in KINDS) + " |")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
