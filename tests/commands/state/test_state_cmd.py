"""`kvtool state` and `kvtool run --session/--store`, on the tiny llama: in process through
typer's CliRunner, and as subprocesses where the process itself matters (errors, kill -9)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.run
import kvtool.commands.state
from kvtool.commands import app
from kvtool.common.store import ConversationStore
from kvtool.state import inspect_state

runner = CliRunner()
PROMPT = "hello world the cat sat on the mat"


def cli(*args: str, stdin: str | None = None) -> str:
    result = runner.invoke(app, list(args), input=stdin, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def kvtool_process(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvtool.commands", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("save_args", "load_args"),
    [([], []), ([], ["-kvu", "-c", "1024"]), (["--seq", "2"], []), (["--seq", "1", "-kvu"], ["--seq", "3"])],
)
def test_load_continues_like_an_uninterrupted_run(
    tiny_llama_path: Path, tmp_path: Path, save_args: list[str], load_args: list[str]
) -> None:
    m, f = str(tiny_llama_path), str(tmp_path / "s.kvs")
    want = cli("run", "-m", m, "-p", PROMPT, "-n", "12", "--no-chat", "--temp", "0", "-c", "512")
    cli("state", "save", "-m", m, "-p", PROMPT, "-o", f, "-c", "512", *save_args)
    assert cli("state", "load", "-m", m, "-i", f, "-n", "12", "-c", "512", *load_args) == want


def test_inspect_and_more_text(tiny_llama_path: Path, tmp_path: Path) -> None:
    m, f = str(tiny_llama_path), tmp_path / "s.kvs"
    cli("state", "save", "-m", m, "-p", PROMPT, "-o", str(f), "--seq", "1")
    out = cli("state", "inspect", str(f))
    n = len(kvtool.Model(tiny_llama_path).tokenize(PROMPT))
    assert "sequence state" in out and "checksum ok" in out and f"0..{n - 1}" in out
    assert inspect_state(f).tokens() == kvtool.Model(tiny_llama_path).tokenize(PROMPT)
    assert cli("state", "load", "-m", m, "-i", str(f), "-p", " and the dog", "-n", "4").strip()


def test_errors_are_one_line(tiny_llama_path: Path, tmp_path: Path) -> None:
    f = tmp_path / "s.kvs"
    cli("state", "save", "-m", str(tiny_llama_path), "-p", PROMPT, "-o", str(f))
    gemma = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-gemma3.gguf"
    r = kvtool_process("state", "load", "-m", str(gemma), "-i", str(f))
    assert r.returncode == 2
    # the file is named, as a model's errors name it
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {f}: state was saved with another model")
    assert "Traceback" not in r.stderr
    f.write_bytes(f.read_bytes()[:-10])
    r = kvtool_process("state", "inspect", str(f))
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"error: {f}: truncated state") and "\n" not in r.stderr.strip()
    for other, what in ((gemma, "a GGUF model file"), (_sqlite(tmp_path), "an SQLite database")):
        r = kvtool_process("state", "inspect", str(other))
        assert r.returncode == 2 and r.stderr.startswith(f"error: {other}: not a kvtool state: {what}")


def _sqlite(folder: Path) -> Path:
    import sqlite3

    path = folder / "conversations.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("create table t (x)")
        db.commit()
    return path


SLOW_SAVE = """
import os, sys, time
def stuck(fd):  # the new state is in the temporary file: die here, before the rename
    print("in fsync", flush=True)
    time.sleep(600)
os.fsync = stuck
sys.argv = ["kvtool", "state", "save", *sys.argv[1:]]
from kvtool.commands import main
main()
"""


def test_kill_9_during_save_leaves_the_old_file(tiny_llama_path: Path, tmp_path: Path) -> None:
    m, f = str(tiny_llama_path), tmp_path / "s.kvs"
    cli("state", "save", "-m", m, "-p", PROMPT, "-o", str(f))
    old = f.read_bytes()
    args = ["-m", m, "-p", "a much longer prompt " * 5, "-o", str(f)]
    p = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "in fsync"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert f.read_bytes() == old
    assert any(x.name.startswith(".s.kvs.") for x in tmp_path.iterdir())  # the unfinished one
    ctx = kvtool.Context(kvtool.Model(tiny_llama_path), kvtool.ContextParams(n_ctx=512))
    ctx.state_load_file(f)
    assert ctx.memory.seq_pos_max(0) + 1 == len(inspect_state(f).tokens() or [])


def test_run_session_resumes_and_saves(tiny_llama_path: Path, tmp_path: Path) -> None:
    m, f = str(tiny_llama_path), tmp_path / "chat.kvs"
    args = ["run", "-m", m, "-n", "3", "--temp", "0", "-c", "1024", "--session", str(f)]
    cli(*args, "-p", "hello")
    first = inspect_state(f)
    assert len((first.app or {})["chat"]["messages"]) == 2
    cli(*args, stdin="the cat\n/save " + str(tmp_path / "copy.kvs") + "\n/clear\n")
    assert len((inspect_state(tmp_path / "copy.kvs").app or {})["chat"]["messages"]) == 4
    assert (inspect_state(f).app or {})["chat"]["messages"] == []  # cleared, then saved on exit
    cli(*args, stdin="/load " + str(tmp_path / "copy.kvs") + "\nand the dog\n")
    assert len((inspect_state(f).app or {})["chat"]["messages"]) == 6


def test_run_store_conversations_and_list(tiny_llama_path: Path, tmp_path: Path) -> None:
    m, db = str(tiny_llama_path), str(tmp_path / "c.db")
    args = ["run", "-m", m, "-n", "3", "--temp", "0", "-c", "1024", "--store", db]
    cli(*args, "--conversation-name", "cats", stdin="the cat\n/load dogs\nthe dog\n/save dogs2\n")
    cli(*args, "--conversation-name", "cats", stdin="more cats\n")
    out = cli("state", "list", "--store", db)
    for name in ("cats", "dogs", "dogs2"):
        assert name in out
    rows = {r.name: r for r in ConversationStore(db).list()}
    assert rows["cats"].n_messages == 4 and rows["dogs"].n_messages == 2


@pytest.mark.real
def test_smollm2_save_then_load_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    f, p = str(tmp_path / "smol.kvs"), "The history of the printing press begins"
    want = cli("run", "-m", "smollm2", "-p", p, "-n", "24", "--no-chat", "--temp", "0", "-c", "512")
    cli("state", "save", "-m", "smollm2", "-p", p, "-o", f, "-c", "512")
    assert cli("state", "load", "-m", "smollm2", "-i", f, "-n", "24", "-c", "512") == want
    assert len(want.split()) > 5
