"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# the tests that compile kernels for a GPU run without TRITON_INTERPRET, on machines without one
os.environ.setdefault("KVTOOL_TRITON", "1")

from pathlib import Path

import pytest

from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", TinyLlama())


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    import kvtool

    return kvtool.Model(tiny_llama_path)
