"""What the CLI fuzz tests share: the files cases point at, and the worker that runs them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz.test_cli_fuzz import Files, Worker


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files.make(tmp_path_factory.mktemp("cli-fuzz"))


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()
