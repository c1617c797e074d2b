"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama

DATA = Path(__file__).parent / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--property-examples",
        type=int,
        default=0,
        metavar="N",
        help="tests/kvtool/memory/test_property_memory.py: N random programs of 25 steps per case "
        "(the long run; default: the bounded, derandomized CI run)",
    )


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws the same numbers from torch's and numpy's global generators, whatever
    ran before it: a tolerance that a rare draw breaks fails every time, not once in a while.
    (torch only where a test module imported it: some tests check that a path never does.)"""
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", TinyLlama())


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    import kvtool

    return kvtool.Model(tiny_llama_path)
