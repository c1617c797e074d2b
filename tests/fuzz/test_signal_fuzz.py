"""Signals at random moments of a chat, the bounded, seeded CI run (tests/fuzz/signal_fuzz.py
says what each case checks); `benchmarks/fuzz_signals.py` runs them for as long as asked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fuzz.signal_fuzz import AIMS, SIGNALS, Case, earlier_conversation, run_case

# each signal aimed at two of the four moments, each moment at two signals
CASES = [
    Case(sig, delay, store, old, aim, turn=j + i % 2)
    for i, sig in enumerate(SIGNALS)
    for j, (store, old) in enumerate([(False, i % 2 == 0), (True, i % 2 == 1)])
    for aim in [AIMS[(2 * i + j) % len(AIMS)]]
    for delay in [random.Random(i).uniform(1.0, 2.0) if aim == "load" else 0.0]
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c.sig.name}-{c.aim}-{'store' if c.store else 'session'}"
)
def test_a_signal_keeps_every_turn_shown_and_every_file_whole(
    tiny_llama_path: Path, tmp_path: Path, case: Case
) -> None:
    old = earlier_conversation(tiny_llama_path, tmp_path, case.store) if case.old else None
    outcome = run_case(tiny_llama_path, tmp_path, case, old)
    assert outcome.problems == [], (outcome.phase, outcome.problems)
