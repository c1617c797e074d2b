"""Signals at random moments of a chat, for longer than the CI run (tests/fuzz/test_signal_fuzz.py).

    .venv/bin/python -m benchmarks.fuzz_signals --minutes 10 [--seed 0] [--model smollm2]

Each case starts `kvtool run` on the tiny model (or --model: a real one, whose saves of tens of
MB last long enough for SIGINT, SIGTERM and SIGHUP to land in them) with a session file or a
store (half of them
holding an earlier conversation), feeds it three turns and sends SIGINT, SIGTERM, SIGHUP or
SIGKILL at a random moment, aimed in turn at the load (a delay after the start, at most
--max-delay), a prompt's decode, a reply's generation and a turn's save (a short random delay
after a random turn's echo, its reply's first byte, its save's first write);
tests/fuzz/signal_fuzz.py says what is checked afterwards. Prints the cases per signal and per
moment the signal landed in, and every failure. Exit status 1 when there was a failure.
"""

from __future__ import annotations

import collections
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.fuzz_args import fuzz_parser
from tests.fuzz.signal_fuzz import AIMS, SIGNALS, TURNS, Case, earlier_conversation, run_case
from tests.helpers.tiny_gguf import write_tiny_llama

PHASES = ("startup", "load", "prompt", "generation", "save", "idle", "ended", "hang")
JITTER = {"prompt": 0.05, "generation": 0.3, "save": 0.002}  # seconds after the aimed-at moment


def main() -> int:
    ap = fuzz_parser(__doc__, seed=0)
    ap.add_argument("--max-delay", type=float, default=3.0, help="seconds after the start, at most (load)")
    ap.add_argument("--model", help="-m of kvtool run: a known name or a GGUF (default: a tiny random llama)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tally: collections.Counter[tuple[str, str]] = collections.Counter()
    failures: list[str] = []
    end = time.monotonic() + 60 * args.minutes
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(Path(tmp) / "tiny.gguf") if args.model is None else Path(args.model)
        n = 0
        while time.monotonic() < end:
            aim = AIMS[n % len(AIMS)]
            delay = rng.uniform(0.0, args.max_delay if aim == "load" else JITTER[aim])
            case = Case(
                rng.choice(SIGNALS),
                delay,
                rng.random() < 0.5,
                rng.random() < 0.5,
                aim,
                rng.randrange(len(TURNS)),
            )
            folder = Path(tempfile.mkdtemp(dir=tmp))
            old = earlier_conversation(model, folder, case.store) if case.old else None
            outcome = run_case(model, folder, case, old)
            n += 1
            tally[(case.sig.name, outcome.phase)] += 1
            if outcome.problems:
                tally[(case.sig.name, "failed")] += 1
                failures.append(f"{case}: {outcome.phase}: {'; '.join(outcome.problems)}"[:400])
            shutil.rmtree(folder)
    print(f"{n} cases in {args.minutes:g} min (seed {args.seed})")
    print("| signal | " + " | ".join(PHASES) + " | failed |")
    print("|---" * (len(PHASES) + 2) + "|")
    for sig in SIGNALS:
        row = [str(tally[(sig.name, p)]) for p in (*PHASES, "failed")]
        print(f"| {sig.name} | " + " | ".join(row) + " |")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
