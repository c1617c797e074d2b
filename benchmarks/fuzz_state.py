"""The state-loader fuzzer of tests/fuzz/test_state_fuzz.py, run for longer; prints the count.

    .venv/bin/python benchmarks/fuzz_state.py [--minutes 10] [--seed 100] [--cli-share 0.05]

Mutated states of every memory kind go through the public API (whole-context and per-sequence
loads: a one-line KvtoolError with the context unchanged, or a load after which the context
still decodes) and, for a share of the cases, through the CLI (`state load`, `state inspect`,
chat `/load`: exit 0 or an `error:` line, no traceback). Prints the cases tried, what was
found (grouped), and the peak resident memory.
"""

from __future__ import annotations

import collections
import itertools
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fuzz_args import fuzz_parser
from tests.fuzz.test_cli_fuzz import Worker
from tests.fuzz.test_state_fuzz import make_sources, peak_rss_mb, run_api, run_cli


def main() -> None:
    ap = fuzz_parser(__doc__, seed=100)
    ap.add_argument("--cli-share", type=float, default=0.05, help="share of the time spent on CLI cases")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    sources = make_sources()
    start, end = time.monotonic(), time.monotonic() + args.minutes * 60
    n_api = n_cli = 0
    found: list[str] = []
    worker, folder = Worker(), Path(tempfile.mkdtemp(prefix="fuzz-state-"))
    for round_ in itertools.count():
        if time.monotonic() >= end:
            break
        seed = args.seed + round_
        found += [f.line() for f in run_api(sources, seed, 200)]
        n_api += 200
        if args.cli_share > 0 and round_ % max(1, round(1 / args.cli_share / 20)) == 0:
            found += run_cli(sources, seed, 10, worker, folder)
            n_cli += 10
        print(f"\r{n_api} API + {n_cli} CLI cases, {len(found)} findings", end="", file=sys.stderr)
    worker.close()
    print(file=sys.stderr)
    print(f"state fuzz: {n_api} API cases + {n_cli} CLI cases in {time.monotonic() - start:.0f} s")
    print(f"peak RSS: {peak_rss_mb():.0f} MiB")
    groups = collections.Counter(line.split("]: ", 1)[-1][:160] for line in found)
    print(f"findings: {len(found)} ({len(groups)} distinct)")
    for what, n in groups.most_common():
        example = next(line for line in found if what in line)
        print(f"  {n:5d} x {what}\n          e.g. {example[:300]}")


if __name__ == "__main__":
    main()
