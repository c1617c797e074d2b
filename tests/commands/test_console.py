"""The process entry point (`kvtool`, `python -m kvtool.commands`): main's exit status and
output, flushed, with the process ended without Python's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _kvtool(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvtool.commands", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_help_is_flushed_and_exits_0() -> None:
    r = _kvtool("--help")
    assert r.returncode == 0 and "run" in r.stdout and r.stdout.endswith("\n")


def test_a_bad_flag_is_one_line_and_status_2() -> None:
    r = _kvtool("--bogus")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--bogus" in r.stderr


def test_a_one_shot_prints_everything_before_the_process_ends(tiny_llama_path: Path) -> None:
    r = _kvtool("run", "-m", str(tiny_llama_path), "-p", "hello", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "total time" in r.stderr  # the timings are the last lines written
    assert r.stdout.strip()


def test_an_engine_warning_is_one_line(tiny_llama_path: Path) -> None:
    # a warning raised while a verb runs (here by a wrapped Context.decode, as a graph turned
    # off would) prints as one "warning:" line, without Python's file:line and source line
    code = (
        "import sys, warnings; from kvtool.commands import main; "
        "sys.argv = ['kvtool', 'run', '-m', sys.argv[1], '-p', 'hi', '-n', '1', '--temp', '0']; "
        "import kvtool.context as c; d = c.Context.decode\n"
        "def w(self, b):\n    warnings.warn('graphs off for a test'); return d(self, b)\n"
        "c.Context.decode = w; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "graphs off" in ln]
    assert lines and all(ln == "warning: graphs off for a test" for ln in lines), r.stderr
    assert "UserWarning" not in r.stderr and "warnings.warn" not in r.stderr


def test_every_verb_is_in_the_root_help_table() -> None:
    """`kvtool --help` lists VERBS without importing the verbs: a verb added without its row
    (or a row without its verb) fails here."""
    import typer

    from kvtool.commands import VERBS, _register, app

    _register()
    group = typer.main.get_command(app)
    assert set(group.commands) == set(VERBS)


def test_a_closed_stdout_is_no_traceback(tiny_llama_path: Path) -> None:
    """`kvtool ... >&-`: Python gives no sys.stdout, and the first write was an AttributeError
    traceback (issue 28, item 10); it writes nowhere instead, as llama.cpp does."""
    for args in (["--version"], ["run", "-m", str(tiny_llama_path), "-p", "hi", "-n", "3"]):
        cmd = [sys.executable, "-m", "kvtool.commands", *args]
        r = subprocess.run(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
            close_fds=True,
            preexec_fn=lambda: os.close(1),
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_a_reader_that_goes_away_ends_the_output_quietly(tiny_llama_path: Path, tmp_path: Path) -> None:
    """`kvtool run ... | head -c 10`: the rest of the reply has nowhere to go; the run ends
    without a traceback, and the session keeps what was generated."""
    session = tmp_path / "s.kvs"
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(tiny_llama_path), "-p", "hi"]
    cmd += ["-n", "3000", "--ignore-eos", "-c", "4096", "--session", str(session)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 1 and "Traceback" not in err, err
    import kvtool

    saved = (kvtool.inspect_state(session).app or {})["chat"]["messages"]
    assert saved[0]["content"] == "hi" and len(saved[1]["content"]) > 0
