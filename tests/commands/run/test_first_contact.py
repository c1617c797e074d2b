"""What a llama.cpp or ollama user types at `kvtool run` first (issue 27), through the CLI on
tiny models: the GGUF's own template by default, llama.cpp's spellings, ollama's argument."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import kvtool_cli
from tests.helpers.terminal import at_terminal
from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama

# SmolLM2's template, shape for shape: a chatml family template that adds its own system prompt
SYSTEM = "You are tiny."
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "chatty.gguf", TinyLlama(chat_template=TEMPLATE))


def run(mp, cap, model: Path, *args: str, stdin: str = ""):  # type: ignore[no-untyped-def]
    return kvtool_cli(
        mp, cap, "run", "-m", str(model), "-n", "2", "--temp", "0", "-c", "512", *args, stdin=stdin
    )


def test_the_chat_renders_the_ggufs_own_template_with_its_system_prompt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], templated: Path
) -> None:
    r = run(monkeypatch, capsys, templated, "--verbose-prompt", stdin="the cat\n")
    assert r.code == 0, r.err
    assert "main: prompt: '<s>" in r.err and "<|im_start|>system\n" in r.err and "tiny" in r.err
    n = int(re.search(r"main: number of tokens in prompt = (\d+)", r.err).group(1))  # type: ignore[union-attr]
    rows = re.findall(r"^ *(\d+) -> '", r.err, re.M)  # llama.cpp's "%6d -> '%s'"
    assert len(rows) == n and "\n     1 -> '<s>'\n" in r.err
    # --no-jinja: llama.cpp's named chatml, which has no system prompt of its own
    r = run(monkeypatch, capsys, templated, "--verbose-prompt", "--no-jinja", stdin="the cat\n")
    assert r.code == 0 and "tiny" not in r.err and "<|im_start|>user" in r.err


def test_conversation_is_llama_cpps_cnv_and_a_store_name_needs_a_store(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    r = run(monkeypatch, capsys, tiny_llama_path, "--conversation", "-p", "the cat")
    assert r.code == 0, r.err
    assert r.out.startswith("> the cat\n")  # the answer to -p is the chat's first turn
    r = run(monkeypatch, capsys, tiny_llama_path, "--conversation-name", "foo", "-p", "x")
    assert "--store" in r.one_error_line()


def test_ollamas_model_and_prompt_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    r = kvtool_cli(monkeypatch, capsys, "run", str(tiny_llama_path), "the cat", "-n", "3", "--temp", "0")
    assert r.code == 0, r.err
    assert "prompt eval time" in r.err  # a one-shot, as -p
    r = kvtool_cli(monkeypatch, capsys, "run", str(tiny_llama_path), "-m", "other.gguf", "-p", "x")
    assert "not both" in r.one_error_line()


def test_a_line_ending_in_a_backslash_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    r = run(monkeypatch, capsys, tiny_llama_path, "--no-chat", stdin="the cat\\\nsat on\nthe dog\n")
    assert r.code == 0, r.err
    assert r.out.count("> ") == 2 and "> the cat\nsat on\n" in r.out
    r = run(monkeypatch, capsys, tiny_llama_path, "-mli", "--no-chat", stdin="the cat\nsat on\\\nthe dog\n")
    assert r.out.count("> ") == 2 and "> the cat\nsat on\n" in r.out  # -mli: the reverse


def test_a_turn_that_does_not_fit_exits_non_zero_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    long = " ".join(["the cat sat on the mat"] * 60)
    r = run(monkeypatch, capsys, tiny_llama_path, "-c", "256", "--no-chat", stdin=f"hello\n{long}\nthe dog\n")
    assert r.code == 1
    assert r.out.count("> ") == 3  # the chat went on after the refused turn
    line = next(x for x in r.err.splitlines() if x.startswith("error:"))
    assert "/clear" in line and "--context-shift" in line and "-c" in line


def test_escapes_in_the_prompt_as_llama_cpp_reads_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    args = ("--no-chat", "--verbose-prompt", "-p", "cat\\tdog")
    r = run(monkeypatch, capsys, tiny_llama_path, *args)
    assert "cat\tdog'" in r.err
    r = run(monkeypatch, capsys, tiny_llama_path, "--no-escape", *args)
    assert "cat\\tdog'" in r.err


def test_display_prompt_and_perf(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    r = run(monkeypatch, capsys, tiny_llama_path, "--no-chat", "--display-prompt", "-p", "the cat")
    assert r.out.startswith("the cat") and "eval time" in r.err
    r = run(monkeypatch, capsys, tiny_llama_path, "--no-chat", "--no-perf", "-p", "the cat")
    assert not r.out.startswith("the cat") and "eval time" not in r.err
    r = run(monkeypatch, capsys, tiny_llama_path, "--no-display-prompt", "--perf", stdin="the cat\n")
    assert "> " not in r.out and "eval time" in r.err  # --perf: the report when the chat ends


def test_llama_cpp_run_flags_that_mean_something_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    ok = ["-tb", "1", "-fa", "on", "--samplers", "penalties;top-k;temp", "-e", "-p", "the cat"]
    r = run(monkeypatch, capsys, tiny_llama_path, "--no-chat", *ok)
    assert r.code == 0, r.err
    r = run(monkeypatch, capsys, tiny_llama_path, "--samplers", "top_k;mirostat", "-p", "x")
    assert "unknown sampler 'mirostat'" in r.one_error_line()
    r = run(monkeypatch, capsys, tiny_llama_path, "-fa", "off", "-p", "x")
    assert "always fused" in r.one_error_line()


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a GPU is there")
def test_gpu_layers_without_a_gpu_warn_and_compute_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_path: Path
) -> None:
    r = run(monkeypatch, capsys, tiny_llama_path, "-ngl", "99", "--no-chat", "-p", "the cat")
    assert r.code == 0, r.err
    assert "warning: no usable GPU found, -ngl 99 is ignored" in r.err


def test_a_terminal_chat_starts_with_the_banner_and_ctrl_d_ends_the_line(tiny_llama_path: Path) -> None:
    """llama-cli's banner (model, context, KV cache) on a terminal; Ctrl-D leaves on a new line."""
    rc, text = at_terminal(["run", "-m", str(tiny_llama_path), "-c", "512"], b"\x04")  # Ctrl-D at the prompt
    assert rc == 0, text
    assert "model      : tiny-llama (llama " in text and "n_ctx = 512" in text
    assert "KV cache   : K f16, V f16, one stream per sequence" in text and "/exit" in text
    assert text.endswith("> \n"), repr(text[-40:])  # the shell's prompt starts on its own line


def test_subprocess_help_still_lists_run_arguments() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvtool.commands", "run", "--help"], capture_output=True, text=True
    )
    assert "[MODEL] [PROMPT]" in r.stdout
