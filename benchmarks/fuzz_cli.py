"""The CLI flag fuzzer of tests/fuzz/test_cli_fuzz.py, run for longer; prints the count.

    .venv/bin/python benchmarks/fuzz_cli.py [--minutes 10] [--seed 100] [--timeout 20]

Random flags and values on every verb, in a worker process with a memory limit; each case must
exit 0 or print an `error:` line with a non-zero exit, never a traceback or a hang. Prints the
cases tried and each distinct failure (the traceback's last line) with its first command line.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fuzz_args import fuzz_parser
from tests.fuzz.test_cli_fuzz import Files, Worker, chat_cases, cli_cases, problem


def main() -> None:
    ap = fuzz_parser(__doc__, seed=100)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per case")
    args = ap.parse_args()
    files = Files.make(Path(tempfile.mkdtemp(prefix="fuzz-cli-")))
    worker = Worker()
    flags, chats = cli_cases(files, args.seed), chat_cases(files, args.seed)
    start, end = time.monotonic(), time.monotonic() + args.minutes * 60
    n = 0
    distinct: dict[str, tuple[int, str]] = {}
    while time.monotonic() < end:
        case = next(chats) if n % 10 == 9 else next(flags)
        p = problem(worker.run(case.argv, case.stdin, args.timeout))
        n += 1
        if p is not None:
            key = re.sub(r"'[^']*'|\d+", "_", p)[:200]  # one failure, whatever path or number
            count, first = distinct.get(key, (0, case.line()))
            distinct[key] = (count + 1, first)
        print(f"\r{n} cases, {sum(c for c, _ in distinct.values())} failures", end="", file=sys.stderr)
    worker.close()
    print(file=sys.stderr)
    print(f"CLI fuzz: {n} cases in {time.monotonic() - start:.0f} s, {len(distinct)} distinct failures")
    for key, (count, first) in sorted(distinct.items(), key=lambda kv: -kv[1][0]):
        print(f"  {count:4d} x {key}\n         first: {first}")


if __name__ == "__main__":
    main()
