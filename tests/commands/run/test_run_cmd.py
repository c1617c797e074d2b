"""`kvtool run` as a user runs it: a subprocess of the installed console script."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

KVTOOL = [sys.executable, "-m", "kvtool.commands"]


def run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTOOL, *args], input=stdin, capture_output=True, text=True, timeout=600)


def test_one_shot_prints_only_the_completion(tiny_llama_path: Path) -> None:
    r = run(["run", "-m", str(tiny_llama_path), "-p", "hello", "-n", "5", "--temp", "0", "--no-chat"])
    assert r.returncode == 0, r.stderr
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr
    assert "eval time" not in r.stdout


def test_piped_chat_reads_turns_until_eof(tiny_llama_path: Path) -> None:
    r = run(["run", "-m", str(tiny_llama_path), "-n", "4", "--temp", "0"], "hello\n/clear\nthe cat\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3
    assert "cleared" in r.stderr


def test_context_full_is_one_line(tiny_llama_path: Path) -> None:
    args = ["-n", "-1", "-c", "256", "--temp", "0", "--no-chat", "--ignore-eos", "-p", "hi"]
    r = run(["run", "-m", str(tiny_llama_path), *args])
    assert r.returncode == 0, r.stderr
    assert "context full" in r.stderr and "--context-shift" in r.stderr
    assert "/clear" not in r.stderr  # a chat command: a one-shot has none
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("content", "msg"),
    [(b"not a gguf at all", "not a GGUF file"), (None, "truncated"), (b"", "not a GGUF file")],
)
def test_bad_model_files(tmp_path: Path, tiny_llama_path: Path, content: bytes | None, msg: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content if content is not None else tiny_llama_path.read_bytes()[:20000])
    r = run(["run", "-m", str(bad), "-p", "x"])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and msg in lines[0]


def test_unknown_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    p = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(p), "frobnicator")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run(["run", "-m", str(p), "-p", "x"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unsupported architecture 'frobnicator'" in r.stderr


def test_unknown_model_name() -> None:
    r = run(["run", "-m", "no-such-model", "-p", "x"])
    assert r.returncode == 2 and "unknown model" in r.stderr and "Traceback" not in r.stderr


def test_bad_flag_is_a_usage_error() -> None:
    r = run(["run", "--no-such-flag"])
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_swa_full_and_kv_modes_agree_on_gemma3() -> None:
    gemma = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-gemma3.gguf"
    base = [
        "run",
        "-m",
        str(gemma),
        "-n",
        "12",
        "--temp",
        "0",
        "--no-chat",
        "--ignore-eos",
        "-p",
        "hello world",
    ]
    outs = [run([*base, *extra]) for extra in ([], ["--swa-full"], ["--kv-unified"])]
    for r in outs:
        assert r.returncode == 0, r.stderr
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout
    verbose = run([*base, "--verbose"])
    assert "chat template: gemma" in verbose.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-n", "abc"],
        ["nosuchcommand"],
        ["run", "-c", "-5", "-p", "x"],
        ["bench", "-p", "abc"],
        ["run", "-p", "x", "--defrag", "sometimes"],
        ["run", "-p", "x", "--defrag-thold", "0.1", "--defrag", "on-fail"],
        ["run", "-p", "x", "--defrag-thold", "1.5"],
    ],
)
def test_bad_values_are_one_line(args: list[str], tiny_llama_path: Path) -> None:
    r = run([*args, "-m", str(tiny_llama_path)] if args[0] != "nosuchcommand" else args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1
    assert r.stderr.startswith("error: ")


def test_context_shift_generates_past_the_context(tiny_llama_path: Path) -> None:
    base = [
        "run",
        "-m",
        str(tiny_llama_path),
        "-c",
        "256",
        "--ignore-eos",
        "--temp",
        "0",
        "-p",
        "hello world",
    ]
    shifted = run([*base, "-n", "600", "--context-shift"])
    assert shifted.returncode == 0, shifted.stderr
    assert re.search(r"eval time = .* / +600 runs", shifted.stderr) and "context full" not in shifted.stderr
    off = run([*base, "-n", "600"])
    assert off.returncode == 0, off.stderr
    assert "context full (n_ctx = 256)" in off.stderr and not re.search(r"/ +600 runs", off.stderr)


def test_ctrl_c_cuts_a_one_shot_short_with_status_130(tiny_llama_path: Path) -> None:
    """llama-completion exits 130 when Ctrl-C stops a completion: a script can tell a cut-off
    answer from a whole one."""
    args = ["run", "-m", str(tiny_llama_path), "-p", "hello", "-n", "-1", "--ignore-eos", "--context-shift"]
    p = subprocess.Popen([*KVTOOL, *args, "--no-chat"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    os.read(p.stdout.fileno(), 1)  # generation has started
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert b"(interrupted)" in err
