"""A path the system refuses (a name too long for the file system) is one `error:` line and
exit 2 on every verb that takes a path, never an OSError traceback (found by the CLI fuzzer:
pathlib's is_file/exists raise ENAMETOOLONG instead of answering False)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import kvtool_cli

LONG = "a" * 300


@pytest.mark.parametrize(
    "args",
    [
        ("state", "list", "--store", LONG),
        ("run", "-m", LONG, "-p", "hi"),
        ("state", "load", "-i", LONG),
        ("bench", "-m", LONG),
    ],
    ids=["state-list", "run-model", "state-load", "bench-model"],
)
def test_a_name_too_long_is_one_line(
    args: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    r = kvtool_cli(monkeypatch, capsys, *args)
    line = r.one_error_line()
    assert "too long" in line.lower(), line
