"""Text input that is not UTF-8, and an empty prompt on a model without BOS (issue 14, defect 7):
invalid bytes in -p, piped chat turns, -f and parallel's files read as U+FFFD, as llama.cpp's
tokenizer reads them; nothing ends in a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import typer

from kvtool.commands.common.text import read_text, user_text
from tests.helpers.cli import kvtool_cli
from tests.helpers.tiny_gguf import write_tiny_llama

BAD = b"the cat \xff\xfe sat \xc3"  # two invalid bytes, then a truncated sequence


def test_invalid_bytes_read_as_replacement_characters(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_bytes(BAD)
    assert read_text(tmp_path / "p.txt", "-f") == "the cat \ufffd\ufffd sat \ufffd"
    assert user_text(os.fsdecode(BAD)) == "the cat \ufffd\ufffd sat \ufffd"
    assert user_text(None) is None
    with pytest.raises(typer.BadParameter, match=r"^cannot read .*missing"):
        read_text(tmp_path / "missing", "-f")


def test_argv_prompt_with_invalid_bytes(tiny_llama_path: Path) -> None:
    """A real process: argv reaches Python as bytes, which it keeps as lone surrogates."""
    args = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(tiny_llama_path).encode()]
    r = subprocess.run(
        [*args, b"-p", BAD, b"-n", b"2", b"--temp", b"0", b"--no-chat", b"-sys", BAD],
        capture_output=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert b"Traceback" not in r.stderr


def test_piped_turns_with_invalid_bytes(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    r = kvtool_cli(
        monkeypatch, capsys, "run", "-m", str(tiny_llama_path), "-n", "2", stdin=BAD + b"\nhello\n"
    )
    assert r.code == 0, r.err
    assert "> the cat \ufffd\ufffd sat \ufffd\n" in r.out and "> hello\n" in r.out


def test_prompt_files_with_invalid_bytes(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(BAD + b"\n")
    r = kvtool_cli(
        monkeypatch, capsys, "run", "-m", str(tiny_llama_path), "-f", str(f), "-n", "2", "--no-chat"
    )
    assert r.code == 0, r.err
    args = ["parallel", "-m", str(tiny_llama_path), "-f", str(f), "--system-file", str(f), "-n", "2"]
    r = kvtool_cli(monkeypatch, capsys, *args)
    assert r.code == 0, r.err
    assert "1 prompt: the cat \ufffd\ufffd sat \ufffd" in r.out


def test_a_trace_that_is_not_text_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'{"n_ctx": 4\xff}\n')
    r = kvtool_cli(monkeypatch, capsys, "defrag-sim", "--trace", str(f))
    assert "byte 11 is not UTF-8" in r.one_error_line()


@pytest.fixture(scope="module")
def no_bos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with add_bos_token false: an empty text tokenizes to nothing."""
    real = gguf.GGUFWriter.add_add_bos_token
    try:
        gguf.GGUFWriter.add_add_bos_token = lambda self, _v: real(self, False)  # type: ignore[method-assign]
        return write_tiny_llama(tmp_path_factory.mktemp("m") / "no-bos.gguf")
    finally:
        gguf.GGUFWriter.add_add_bos_token = real  # type: ignore[method-assign]


@pytest.mark.parametrize("how", [["-p", ""], ["-f", "EMPTY"], ["-p", "", "-no-cnv"]])
def test_an_empty_prompt_without_bos_is_one_line(
    no_bos_model: Path,
    how: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    how = [str(tmp_path / "empty.txt") if a == "EMPTY" else a for a in how]
    r = kvtool_cli(
        monkeypatch, capsys, "run", "-m", str(no_bos_model), *how, "--no-chat", "-n", "2", "-c", "512"
    )
    assert "input is empty" in r.one_error_line()


def test_an_empty_system_prompt_without_bos_is_served(
    no_bos_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    args = [
        "parallel",
        "-m",
        str(no_bos_model),
        "--system-file",
        str(tmp_path / "empty.txt"),
        "-pps",
        "-n",
        "2",
    ]
    r = kvtool_cli(monkeypatch, capsys, *args)
    assert r.code == 0, r.err
    assert "system tokens = 0" in r.out


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (["run", "-f", "/dev/zero"], None),
        (["run", "-f", "/dev/urandom"], None),
        (["parallel", "--system-file", "/dev/urandom"], None),
        (["parallel", "-f", "/dev/zero"], None),
        (["run"], "/dev/zero"),  # turns piped from a file that never ends a line
    ],
)
def test_text_that_never_ends_is_one_line(tiny_llama_path: Path, args: list[str], stdin: str | None) -> None:
    """`-f /dev/zero` or `--system-file /dev/urandom` read until memory ran out (issue 28,
    item 5): a text input is read up to 16 MiB, then refused."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    cmd = [sys.executable, "-m", "kvtool.commands", *args, "-m", str(tiny_llama_path), "-n", "2"]
    with open(stdin or "/dev/null", "rb") as f:
        r = subprocess.run(cmd, stdin=f, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: ") and "16 Mi" in r.stderr, r.stderr
