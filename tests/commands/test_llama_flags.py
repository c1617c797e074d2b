"""llama.cpp's spellings typed at kvtool, through the CLI: the flags kvtool shares work, the
ones it lacks are refused naming themselves, and help answers without loading torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVTOOL = [sys.executable, "-m", "kvtool.commands"]


def cli(*args: str, stdin: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTOOL, *args], input=stdin, capture_output=True, text=True, timeout=600, cwd=cwd)


HELP = [
    ["-h"],
    ["--help"],
    ["run", "-h"],
    ["bench", "-h"],
    ["parallel", "--help"],
    ["state", "load", "--help"],
]
HELP += [["batched-bench", "--help"], ["defrag-sim", "--help"], ["models", "--help"], ["list", "--help"]]
HELP += [["serve", "--help"]]
HELP += [["kv-types", "-h"]]


def _modules_after(args: list[str]) -> tuple[str, str]:
    """(stdout, the last line: exit status and which heavy packages are imported) of main(args)."""
    code = (
        "import sys\n"
        f"sys.argv = ['kvtool', *{args!r}]\n"
        "from kvtool.commands import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('RC', rc, *(m in sys.modules for m in ('torch', 'numpy', 'pydantic', 'rich')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return r.stdout, r.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("args", HELP)
def test_help_answers_without_importing_torch(args: list[str]) -> None:
    """Help loads neither torch, numpy, pydantic (typer 0.29 imports it on every parse) nor,
    but for parallel's, rich: it answers in a few tens of ms (benchmarks/startup.py)."""
    out, status = _modules_after(args)
    assert "Usage" in out
    assert status == f"RC 0 False False False {args[0] == 'parallel'}"


@pytest.mark.parametrize(
    "args", [["--version"], ["models"], ["list"], ["defrag-sim", "--requests", "20", "--policy", "paged"]]
)
def test_commands_that_load_no_model_import_no_torch(args: list[str]) -> None:
    _, status = _modules_after(args)
    _, rc, torch, _numpy, pydantic, _rich = status.split()
    assert (rc, torch, pydantic) == ("0", "False", "False"), status


@pytest.mark.parametrize("verb", [["run", "-p", "hi"], ["serve", "--port", "0"]])
def test_a_missing_model_is_refused_before_torch_loads(tmp_path: Path, verb: list[str]) -> None:
    """A typo in `run -m` or `serve -m` costs the CLI's start, not torch's import on top."""
    args = [verb[0], "-m", str(tmp_path / "missing.gguf"), *verb[1:]]
    code = (
        "import sys\n"
        f"sys.argv = ['kvtool', *{args!r}]\n"
        "from kvtool.commands import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('RC', rc, 'torch' in sys.modules)\n"
    )
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert "missing.gguf" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "RC 2 False"


def test_version_names_kvtool_torch_and_where_the_devices_are() -> None:
    from importlib import metadata

    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert f"kvtool {metadata.version('kvtool')}" in r.stdout
    assert f"torch {metadata.version('torch')}" in r.stdout
    assert "--list-devices" in r.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["run", "-nkvo"], "-nkvo"),
        (["run", "--main-gpu", "1"], "--main-gpu"),
        (["bench", "-mmp", "0"], "-mmp"),
        (["parallel", "--host", "x"], "--host"),
    ],
)
def test_llama_cpp_flags_kvtool_lacks_name_themselves_and_the_offer(args: list[str], named: str) -> None:
    r = cli(*args)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert line.startswith(f"error: kvtool {args[0]} has no {named} (llama.cpp's): ")
    assert "\n" not in line and "-n'" not in line


@pytest.mark.parametrize(
    ("args", "offer"),
    [
        (["serve", "--cache-reuse", "256"], "no chunk reuse"),  # run's offer is `kvtool run --session`
        (["serve", "--temp", "0"], "a request sets its own sampling"),  # run has --temp
        (["serve", "--no-webui"], "no web UI"),
        (["run", "-cram", "100"], "kvtool run --session"),
    ],
)
def test_a_verb_s_own_offer_comes_first(args: list[str], offer: str) -> None:
    """llama-server's flags typed at `kvtool serve` get serve's offer, not run's."""
    r = cli(*args)
    assert r.returncode == 2 and offer in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize(
    "args", [["bench", "-no-cnv"], ["run", "-xyz", "1"], ["state", "save", "-cnv"], ["state", "load", "-xyz"]]
)
def test_unknown_multi_letter_flags_are_named_not_split(args: list[str]) -> None:
    flag = next(a for a in args if a.startswith("-"))
    r = cli(*args)
    assert r.returncode == 2
    assert f"has no option {flag} " in r.stderr and "Traceback" not in r.stderr


def test_no_cnv_needs_a_prompt(tiny_llama_path: Path) -> None:
    r = cli("run", "-m", str(tiny_llama_path), "-no-cnv")
    assert r.returncode == 2 and "-no-cnv" in r.stderr and "prompt" in r.stderr


def test_no_cnv_completes_raw_text_like_no_chat(tiny_llama_path: Path) -> None:
    base = ["run", "-m", str(tiny_llama_path), "-p", "the cat", "-n", "6", "--temp", "0"]
    want = cli(*base, "--no-chat")
    for spelling in ("-no-cnv", "--no-conversation"):
        got = cli(*base, spelling)
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout


def test_prompt_from_file_equals_p(tiny_llama_path: Path, tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("the dog and the cat", encoding="utf-8")
    base = ["run", "-m", str(tiny_llama_path), "-n", "6", "--temp", "0", "--no-chat"]
    want = cli(*base, "-p", "the dog and the cat")
    got = cli(*base, "-f", str(tmp_path / "p.txt"))
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout
    both = cli(*base, "-p", "x", "-f", str(tmp_path / "p.txt"))
    assert both.returncode == 2 and "not both" in both.stderr
    missing = cli(*base, "-f", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and "nope.txt" in missing.stderr and "Traceback" not in missing.stderr


def test_a_prompt_starting_with_a_dash_is_a_value(tiny_llama_path: Path) -> None:
    r = cli("run", "-m", str(tiny_llama_path), "-p", "-hello", "-n", "2", "--temp", "0", "--no-chat")
    assert r.returncode == 0, r.stderr


def test_cnv_keeps_chatting_after_the_prompt(tiny_llama_path: Path) -> None:
    r = cli(
        "run", "-m", str(tiny_llama_path), "-cnv", "-p", "hello", "-n", "3", "--temp", "0", stdin="the cat\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("> hello\n")
    assert r.stdout.count("> ") == 2  # the prompt's turn, then the piped one


def test_cache_types_and_unified_kv_on_run(tiny_llama_path: Path) -> None:
    args = ["-p", "the cat", "-n", "4", "--temp", "0", "--no-chat"]
    want = cli("run", "-m", str(tiny_llama_path), *args)
    got = cli("run", "-m", str(tiny_llama_path), *args, "-ctk", "f32", "-ctv", "f32", "-kvu")
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout  # same f32 cache, one buffer or one stream: same tokens
    half = cli("run", "-m", str(tiny_llama_path), *args, "-ctk", "f16", "-ctv", "bf16")
    assert half.returncode == 0, half.stderr


def _llama_cpp_flags() -> list[tuple[str, str]]:
    """(verb, flag) for every spelling of llama-cli/llama-completion (run), llama-bench (bench) and
    llama-server (serve)."""
    out, verb = [], ""
    for line in (Path(__file__).parents[1] / "data" / "llama_cpp_flags.txt").read_text().splitlines():
        if line.startswith("["):
            verb = line.strip("[]")
        elif line and not line.startswith("#"):
            out.append((verb, line))
    return out


def test_every_llama_cpp_flag_works_or_says_what_kvtool_offers() -> None:
    """A llama.cpp flag either is kvtool's too, or is refused naming itself and kvtool's offer:
    never click's generic 'No such option'."""
    import typer

    from kvtool import KvtoolError
    from kvtool.commands import _register, app
    from kvtool.commands.flags import _declared, check_argv

    _register()
    group = typer.main.get_command(app)
    flags = _llama_cpp_flags()
    assert len(flags) > 800
    silent = []
    for verb, flag in flags:
        if flag in _declared(group.commands[verb])[0]:
            continue
        try:
            check_argv(group, [verb, flag])
            silent.append((verb, flag))
        except KvtoolError as e:
            assert f"has no {flag} (llama.cpp's): " in str(e), str(e)
    assert silent == []
