"""`kvtool parallel` through the CLI: local runs on the tiny model (lines per request, the
summary, --json), questions from a file, and --server against a local SSE server."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.batched_bench
import kvtool.commands.bench
import kvtool.commands.parallel
from kvtool.commands import app
from kvtool.common import registry
from tests.helpers.sse_server import ServerLog, sse_server

runner = CliRunner()
DONE = re.compile(
    r"^Client +(\d+), seq +(\d+)/ *(\d+), prompt +(\d+) t, response +(\d+) t, time .* cache miss (\d+)"
)


def run(*args: str, code: int = 0):  # type: ignore[no-untyped-def]
    result = runner.invoke(app, ["parallel", "--no-progress", *args])
    assert result.exit_code == code, result.output
    return result


def summary_numbers(out: str) -> dict[str, int]:
    return {
        "prompt": int(re.search(r"^Total prompt tokens: +(\d+), speed: +[\d.]+ t/s$", out, re.M)[1]),
        "gen": int(re.search(r"^Total gen tokens: +(\d+), speed: +[\d.]+ t/s$", out, re.M)[1]),
        "miss": int(re.search(r"^Cache misses: +(\d+)$", out, re.M)[1]),
    }


@pytest.mark.parametrize("flags", [["-pps"], ["-pps", "-kvu", "-nocb"]])
def test_local_run_lines_summary_and_json(tiny_llama_path: Path, tmp_path: Path, flags: list[str]) -> None:
    js = tmp_path / "run.json"
    # -c 8192: the tiny model's byte-level tokens make the default system transcript ~1500 long
    args = [
        "-m",
        str(tiny_llama_path),
        "-c",
        "8192",
        "-np",
        "2",
        "-ns",
        "5",
        "-n",
        "4",
        "-s",
        "1",
        "--json",
        str(js),
    ]
    out = run(*args, *flags).stdout
    done = [DONE.match(ln) for ln in out.splitlines() if DONE.match(ln)]
    assert sorted(int(d[2]) for d in done) == list(range(5)) and {d[3] for d in done} == {"5"}
    assert {int(d[1]) for d in done} == {0, 1}  # both clients served, and reused
    assert len(re.findall(r"started decoding \.\.\.$", out, re.M)) == 5
    assert out.count("Input:    ") == 5 and out.count("Response: ") == 5
    nums = summary_numbers(out)
    assert nums["prompt"] == sum(int(d[4]) for d in done) and nums["gen"] == sum(int(d[5]) for d in done)
    assert "n_parallel = 2, n_sequences = 5" in out and "used built-in defaults" in out
    doc = json.loads(js.read_text())
    assert doc["mode"] == "local" and doc["shared_system"] is True and doc["kv_unified"] == ("-kvu" in flags)
    assert doc["cont_batching"] == ("-nocb" not in flags)
    assert len(doc["records"]) == 5 and doc["n_prompt"] == nums["prompt"] and doc["n_gen"] == nums["gen"]
    assert all(3 <= r["n_decoded"] <= 4 for r in doc["records"]) and doc["n_cache_miss"] == nums["miss"] == 0


def test_questions_from_a_file_without_shared_system(tiny_llama_path: Path, tmp_path: Path) -> None:
    qs = tmp_path / "q.txt"
    qs.write_text("Is it raining?\n\nWhat time is it?\n")
    out = run("-m", str(tiny_llama_path), "-np", "2", "-ns", "2", "-n", "3", "-f", str(qs)).stdout
    assert "  1 prompt: Is it raining?" in out and "  2 prompt: What time is it?" in out
    inputs = re.findall(r"^Input:    (.*)$", out, re.M)
    assert len(inputs) == 2 and set(inputs) <= {"Is it raining?", "What time is it?"}
    n_sys = int(re.search(r"system tokens = (\d+)", out)[1])
    prompts = [int(m.group(4)) for ln in out.splitlines() if (m := DONE.match(ln))]
    assert all(p > n_sys for p in prompts)  # each prompt carries the system transcript


def test_a_context_too_small_is_an_error(tiny_llama_path: Path) -> None:
    """A prompt longer than a slot is refused before anything is decoded (the scheduler's check)."""
    args = ["parallel", "--no-progress", "-m", str(tiny_llama_path), "-c", "256", "-np", "1"]
    result = runner.invoke(app, args)
    assert isinstance(result.exception, kvtool.ContextFullError)
    assert "a slot holds 256" in str(result.exception)


def test_server_mode(tmp_path: Path) -> None:
    log = ServerLog(barrier=threading.Barrier(3))
    js = tmp_path / "server.json"
    with sse_server(log) as url:
        args = ["--server", url, "-m", "remote", "-np", "3", "-ns", "6", "-n", "4", "--json", str(js)]
        out = run(*args).stdout
    assert log.peak == 3 and len(log.bodies) == 6
    done = [DONE.match(ln) for ln in out.splitlines() if DONE.match(ln)]
    assert sorted(int(d[2]) for d in done) == list(range(6))
    assert all(int(d[5]) == 4 for d in done)
    nums = summary_numbers(out)
    assert nums["gen"] == 24 and nums["prompt"] == sum(int(d[4]) for d in done) > 0
    doc = json.loads(js.read_text())
    assert doc["mode"] == "server" and all(r["ttft"] is not None for r in doc["records"])
    assert {b["model"] for b in log.bodies} == {"remote"}


def test_server_failures_exit_nonzero(tmp_path: Path) -> None:
    with sse_server(ServerLog(fail_every=3)) as url:
        result = run("--server", url, "-np", "1", "-ns", "3", "-n", "2", code=1)
    assert "HTTP 500" in result.stdout and re.search(r"^Failed requests: +1$", result.stdout, re.M)
    assert "prompt    ? t" in result.stdout and "prompt   -1 t" not in result.stdout


def test_api_key_is_sent_to_a_server_and_refused_without_one() -> None:
    log = ServerLog()
    with sse_server(log) as url:
        run("--server", url, "-np", "1", "-ns", "2", "-n", "2", "--api-key", "k1")
    assert log.auth == ["Bearer k1"] * 2
    assert "is the key of a --server" in run("--api-key", "k1", code=2).output


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["-c", "99", "-ctk", "bf16", "-kvu", "-pps", "-t", "1"], "-c, --kv-unified, -ctk, -pps"),
        (["--weights", "f32", "--defrag-thold", "0.5"], "--weights, --defrag-thold"),
    ],
)
def test_server_mode_refuses_the_local_runs_flags(flags: list[str], named: str) -> None:
    """The server's own flags decide its context: a --server run refuses them, not ignores them."""
    result = run("--server", "http://127.0.0.1:9", *flags, code=2)
    assert "sends requests only:" in result.output
    for flag in named.split(", "):
        assert flag in result.output


def test_system_prompt_from_a_file(tiny_llama, tiny_llama_path: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    system = tmp_path / "sys.txt"
    system.write_text("You are a terse assistant.\nUser:\nhi\nAssistant:\nhello\n", encoding="utf-8")
    out = run(
        "-m", str(tiny_llama_path), "-np", "1", "-ns", "1", "-n", "2", "--system-file", str(system)
    ).stdout
    want = len(tiny_llama.tokenize(system.read_text(encoding="utf-8"), add_special=True))
    assert int(re.search(r"system tokens = (\d+)", out)[1]) == want
    missing = runner.invoke(
        app, ["parallel", "-m", str(tiny_llama_path), "--system-file", str(tmp_path / "no")]
    )
    assert missing.exit_code == 2


@pytest.mark.real
def test_default_requests_have_llama_parallels_shape() -> None:
    from kvtool.commands.parallel.prompts import QUESTIONS, SYSTEM_PROMPT

    m = kvtool.Model(registry.resolve_model("smollm2"))
    assert 280 <= len(m.tokenize(SYSTEM_PROMPT, add_special=True)) <= 300  # llama-parallel's: ~290
    assert all(5 <= len(m.tokenize(q, add_special=False)) <= 20 for q in QUESTIONS)  # one line each


@pytest.mark.parametrize(
    ("url", "msg"),
    [
        ("notaurl", "expected http://HOST"),
        ("http://[::1", "not a URL"),
        ("ftp://127.0.0.1:9", "expected http://HOST"),
        ("http://127.0.0.1:99999", "not a URL"),
        ("http://127.0.0.1:9", "cannot connect to 127.0.0.1:9"),
    ],
)
def test_a_server_it_cannot_reach_is_one_line(url: str, msg: str) -> None:
    """A bad --server URL printed each request's `Error: ...` on stdout and exited 1 (issue 28,
    item 10): it is one error line, before any client starts."""
    result = runner.invoke(app, ["parallel", "--server", url, "-ns", "2"])
    assert isinstance(result.exception, kvtool.KvtoolError) and msg in str(result.exception)
    assert "Error:" not in result.stdout and "Input:" not in result.stdout
