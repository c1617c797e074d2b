"""The texts of the parallel simulation: a system transcript in llama-parallel's plain
"User:/Assistant:" format, built-in questions, filler turns, and the per-request draw.

The shapes follow llama-parallel's defaults so that the totals compare: a shared system
transcript of about 290 SmolLM2 tokens and one-line questions of 10-20 tokens (the texts are
kvtool's own)."""

from __future__ import annotations

import random
from collections.abc import Sequence

SYSTEM_PROMPT = "\n".join(
    [
        "A conversation between a curious User and an Assistant.",
        "The Assistant answers every question briefly, accurately and politely, in plain English, "
        "and never refuses a reasonable request.",
        "",
        "User:",
        "What is the boiling point of water at sea level?",
        "Assistant:",
        "Water boils at 100 degrees Celsius, which is 212 degrees Fahrenheit, at sea level. Higher up "
        "a mountain the air pressure is lower, so water boils at a lower temperature and food takes "
        "longer to cook.",
        "User:",
        "Who wrote the play Hamlet?",
        "Assistant:",
        "Hamlet was written by William Shakespeare around the year 1600. It is one of his longest plays "
        "and follows a Danish prince who sets out to avenge his father's murder, with tragic results "
        "for nearly everyone involved.",
        "User:",
        "How many bones are there in the adult human body?",
        "Assistant:",
        "An adult human body has 206 bones. Babies are born with closer to 300, but many of them fuse "
        "together during childhood.",
        "User:",
        "Can you recommend a simple way to start learning to cook?",
        "Assistant:",
        "Start with a few dishes you already enjoy eating, such as an omelette, a pot of soup or a "
        "pasta sauce, and cook each of them several times until it feels easy. Keep a sharp knife, "
        "taste as you go, and add salt a little at a time.",
        "",
    ]
)

QUESTIONS = (
    "What causes the seasons on Earth?",
    "How do airplanes stay in the air?",
    "Give me three tips for a good night's sleep.",
    "Why is the sky blue?",
    "What is a prime number? Give a few examples.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly kitchen robot.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a black hole is in simple words.",
    "What is the difference between weather and climate?",
)

# Filler turns inserted before the question (--junk), to make prompts longer.
JUNK = (
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the largest ocean?", "The Pacific is the largest ocean on Earth."),
    ("Which planet is closest to the Sun?", "Mercury is the planet closest to the Sun."),
    ("What do bees make?", "Bees make honey and beeswax."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
)

MAX_JUNK = 10_000  # --junk: more filler turns than any context holds (each is ~25 tokens)

Request = tuple[str, int, list[tuple[str, str]]]


class Requests:
    """The question, junk count and junk turns of each request, drawn in request order (a
    fixed seed, like llama-parallel's srand(1234), so runs are comparable) as the run reaches
    them: -ns sets how many may be asked for, not what is built up front."""

    def __init__(self, prompts: Sequence[str], n_sequences: int, n_junk: int, seed: int) -> None:
        self._prompts, self._n, self._n_junk = prompts, n_sequences, n_junk
        self._rng = random.Random(seed)
        self._drawn: list[Request] = []

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Request:
        if not 0 <= i < self._n:
            raise IndexError(i)
        rng = self._rng
        while len(self._drawn) <= i:
            question = self._prompts[rng.randrange(len(self._prompts))]
            k = rng.randrange(max(1, self._n_junk))
            self._drawn.append((question, k, [JUNK[rng.randrange(len(JUNK))] for _ in range(k)]))
        return self._drawn[i]


def pick_requests(prompts: Sequence[str], n_sequences: int, n_junk: int, seed: int) -> Requests:
    """The requests of a run (see `Requests`)."""
    return Requests(prompts, n_sequences, n_junk, seed)


def read_prompts(text: str) -> list[str]:
    """Questions from a file's text: one per non-empty line."""
    return [line.strip() for line in text.splitlines() if line.strip()]
