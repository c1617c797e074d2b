"""Longer GGUF fuzzing than the CI run (tests/fuzz/test_gguf_fuzz.py): every structured mutation
of the eight tiny models, then random bit flips, until the time is up.

    .venv/bin/python -m benchmarks.fuzz_gguf --minutes 10 [--seed 0] [--contents]

Each case is written to a temporary file and loaded (and, when that works, one token decoded);
a KvtoolError is the expected refusal. Anything else, a case that runs past --case-timeout
seconds (a hang), or an allocation past the capped address space is a failure: the script
prints how many cases it tried, how each ended, and every failure with the mutation that made
it. Exit status 1 when there was a failure.

--contents runs the contents mutations instead (tests/fuzz/gguf_contents.py: valid files with
metadata of other types, odd vocabularies, hostile templates, NaN and infinite weights, a
quantized block's scale) on the fourteen tiny models, the four low-bit quantized ones
(tests/data/quant) and a byte-level BPE variant with a chat template (--only: some of them),
every case once, then
again with other random token and weight positions until the time is up; each case is
exercised as the verbs use a model (template, tokens, pieces, decode, sampling).
"""

from __future__ import annotations

import collections
import itertools
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.fuzz_args import fuzz_parser
from tests.fuzz.gguf_contents import bpe_base, check, content_cases, exercise
from tests.fuzz.gguf_mutations import all_cases, bit_flips, capped_address_space, load_and_decode, read_layout

MODELS = Path(__file__).parent.parent / "tests" / "data" / "tiny" / "models"
ARCHS = ["llama", "gemma3", "mamba", "mamba2", "rwkv6", "rwkv7", "granitehybrid", "lfm2"]
NEW_ARCHS = ["qwen2", "qwen3", "phi3", "gemma2", "granite", "olmo2"]  # contents only
QUANT = ["Q2_K", "Q3_K_S", "IQ4_NL", "IQ4_XS"]  # tests/data/quant/models/tiny-q-*: block scales


class CaseTimeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise CaseTimeout


def main() -> int:
    ap = fuzz_parser(__doc__, seed=0)
    ap.add_argument("--case-timeout", type=int, default=60)
    ap.add_argument("--contents", action="store_true", help="mutate contents, not the layout")
    ap.add_argument(
        "--only", nargs="+", metavar="MODEL", help="--contents on these models only (qwen3, q-Q2_K, bpe)"
    )
    args = ap.parse_args()
    if args.contents:
        return contents(args.minutes, args.seed, args.case_timeout, args.only)
    # torch and the engine are imported before the address space is capped
    import kvtool
    import kvtool.context
    import kvtool.model  # noqa: F401

    rng = random.Random(args.seed)
    paths = [MODELS / f"tiny-{a}.gguf" for a in ARCHS]
    structured = itertools.chain.from_iterable(all_cases(p, rng) for p in paths)
    layouts = [(p.read_bytes(), read_layout(p)) for p in paths]
    flips = (bit_flips(*rng.choice(layouts), rng) for _ in itertools.count())
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    end = time.monotonic() + 60 * args.minutes
    signal.signal(signal.SIGALRM, _alarm)
    n = 0
    with tempfile.TemporaryDirectory() as tmp, capped_address_space():
        for case in itertools.chain(structured, flips):
            if time.monotonic() > end:
                break
            path = Path(tmp) / f"case{n}.gguf"
            path.write_bytes(case.data())
            n += 1
            outcome = attempt(lambda path=path: load_and_decode(path), case.name, args.case_timeout, failures)
            outcomes[
                "ok" if outcome == "ok" else "KvtoolError" if outcome.startswith("error") else outcome
            ] += 1
            path.unlink()
    print(
        f"{n} cases in {args.minutes:g} min (seed {args.seed}): "
        + ", ".join(f"{k} {v}" for k, v in outcomes.items())
    )
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


def attempt(run: Callable[[], str], name: str, timeout: int, failures: list[str]) -> str:
    """One case under a time limit: its outcome ("ok", "error: ..."), or "hang" or the name of
    the exception that escaped, recorded in `failures`."""
    signal.alarm(timeout)
    try:
        return run()
    except CaseTimeout:
        failures.append(f"{name}: no result after {timeout} s")
        return "hang"
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        failures.append(f"{name}: {type(e).__name__} at {where.filename}:{where.lineno}: {e}"[:300])
        return type(e).__name__
    finally:
        signal.alarm(0)


def contents(minutes: float, seed: int, case_timeout: int, only: list[str] | None) -> int:
    import kvtool
    import kvtool.context
    import kvtool.model  # noqa: F401

    rng = random.Random(seed)
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    end = time.monotonic() + 60 * minutes
    signal.signal(signal.SIGALRM, _alarm)
    n = rounds = 0
    with tempfile.TemporaryDirectory() as tmp:
        bases = [(a, MODELS / f"tiny-{a}.gguf") for a in [*ARCHS, *NEW_ARCHS]]
        bases += [(f"q-{t}", MODELS.parent.parent / "quant" / "models" / f"tiny-q-{t}.gguf") for t in QUANT]
        bases.append(("bpe", bpe_base(MODELS / "tiny-llama.gguf", Path(tmp) / "bpe.gguf")))
        bases = [(a, b) for a, b in bases if only is None or a in only]
        with capped_address_space():
            while time.monotonic() < end:
                rounds += 1
                for arch, base in bases:
                    attention = arch not in ("mamba", "mamba2", "rwkv6", "rwkv7")
                    for case in content_cases(base, rng):
                        if time.monotonic() > end:
                            break
                        try:
                            path = case.write(base, Path(tmp) / "case.gguf")
                        except (ValueError, struct.error):  # gguf's writer refuses it
                            outcomes["unwritable"] += 1
                            continue
                        n += 1
                        name = f"{arch} {case.name}"
                        outcome = attempt(
                            lambda path=path, a=attention: exercise(path, a), name, case_timeout, failures
                        )
                        defect = (
                            check(case, outcome, attention)
                            if outcome == "ok" or outcome.startswith("error")
                            else None
                        )
                        if defect:
                            outcome = "silently wrong"
                            failures.append(f"{name}: {defect}")
                        outcomes[
                            "ok"
                            if outcome == "ok"
                            else "KvtoolError"
                            if outcome.startswith("error")
                            else outcome
                        ] += 1
    print(
        f"{n} content cases in {minutes:g} min, {rounds} round(s) over {len(bases)} models "
        f"(seed {seed}): " + ", ".join(f"{k} {v}" for k, v in outcomes.items())
    )
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
