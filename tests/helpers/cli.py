"""`kvtool ...` run in this process through the console entry point, as a user runs it."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass

import pytest

from kvtool.commands import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    def one_error_line(self) -> str:
        """The single `error: ...` line a bad input must give (asserts there is just that)."""
        lines = [x for x in self.err.splitlines() if x.strip()]
        assert self.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), self.err
        return lines[0]


def kvtool_cli(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
    stdin: str | bytes = "",
) -> Result:
    """Runs main() with `args`; stdin is a pipe holding `stdin` (bytes: raw, maybe not UTF-8)."""
    raw = stdin if isinstance(stdin, bytes) else stdin.encode("utf-8")
    monkeypatch.setattr(sys, "argv", ["kvtool", *args])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main()
    out, err = capsys.readouterr()
    code = e.value.code if isinstance(e.value.code, int) else 1
    return Result(code, out, err)
