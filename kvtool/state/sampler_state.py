"""A sampler's state in a state file: seed, parameters, penalty history, random generator."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvtool.errors import StateError
from kvtool.sampling import Sampler


def capture(sampler: Sampler) -> tuple[dict[str, Any], torch.Tensor]:
    """(header section, generator state as uint8 [n])."""
    seed, history, rng = sampler.get_state()
    head = {"seed": seed, "params": dataclasses.asdict(sampler.params), "history": [int(t) for t in history]}
    return head, rng


def check(head: Any, rng: bytes) -> None:
    """Refuses a malformed sampler section (at load, before anything changes)."""
    ok = (
        isinstance(head, dict)
        and isinstance(head.get("seed"), int)
        and isinstance(head.get("params"), dict)
        and isinstance(head.get("history"), list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in head["history"])
    )
    # the seed must be one torch's generator takes (a reset re-seeds it), history token ids >= 0
    ok = ok and -(2**63) <= head["seed"] < 2**64 and all(t >= 0 for t in head["history"])
    if not ok or len(rng) != len(torch.Generator().get_state()):
        raise StateError("corrupted state: bad sampler section")
    try:  # the generator refuses some states of the right size: find out before any part is applied
        torch.Generator().set_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
    except RuntimeError:
        raise StateError("corrupted state: bad sampler random state") from None


def restore(sampler: Sampler, head: dict[str, Any], rng: bytes) -> None:
    """Continues `sampler` exactly where the saved one stopped (its own parameters stay)."""
    check(head, rng)
    sampler.set_state(head["seed"], head["history"], torch.frombuffer(bytearray(rng), dtype=torch.uint8))
