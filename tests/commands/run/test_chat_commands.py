"""The chat's slash commands and its timings, through the CLI with a tiny model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.commands.run import COMMANDS

KVTOOL = [sys.executable, "-m", "kvtool.commands"]


def chat(model: Path, stdin: str, *extra: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [*KVTOOL, "run", "-m", str(model), "-n", "3", "--temp", "0", "-c", "512", *extra]
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_help_lists_every_command(tiny_llama_path: Path) -> None:
    r = chat(tiny_llama_path, "/help\n")
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        assert f"  {name} " in r.stderr


def test_an_unknown_command_is_an_error_not_a_turn(tiny_llama_path: Path) -> None:
    r = chat(tiny_llama_path, "/frobnicate now\n/stats\n")
    assert r.returncode == 0, r.stderr
    assert "error: unknown command /frobnicate (/help lists them)" in r.stderr
    # nothing went to the model: the timings count no prompt token
    assert re.search(r"prompt eval time = +[0-9.]+ ms / +0 tokens", r.stderr)


def test_a_slash_path_is_a_message(tiny_llama_path: Path) -> None:
    r = chat(tiny_llama_path, "/usr/bin is a folder\n")
    assert r.returncode == 0, r.stderr
    assert "unknown command" not in r.stderr and "tokens," in r.stderr


def test_stats_counts_the_turns(tiny_llama_path: Path) -> None:
    r = chat(tiny_llama_path, "the cat\n/stats\n", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert re.search(r"eval time = +[0-9.]+ ms / +3 runs", r.stderr)
    for label in ("load time", "prompt eval time", "total time", "first token"):
        assert label in r.stderr


def test_load_of_a_missing_conversation_says_so(tiny_llama_path: Path, tmp_path: Path) -> None:
    r = chat(tiny_llama_path, "/load nothere\n", cwd=tmp_path)
    assert f"error: no saved conversation at {tmp_path.resolve() / 'nothere'}" in r.stderr


def test_save_writes_where_it_runs_and_says_where(tiny_llama_path: Path, tmp_path: Path) -> None:
    r = chat(tiny_llama_path, "the cat\n/save mine.kvs\n", cwd=tmp_path)
    path = tmp_path.resolve() / "mine.kvs"
    assert path.exists()
    assert f"saved to {path}" in r.stderr
    again = chat(tiny_llama_path, "/load mine.kvs\n", cwd=tmp_path)
    assert "1 turn, " in again.stderr


def test_a_model_without_chat_template_gets_the_no_chat_hint(tiny_llama_path: Path) -> None:
    r = chat(tiny_llama_path, "hello\n")
    notes = [line for line in r.stderr.splitlines() if "no chat template" in line]
    assert len(notes) == 1 and "--no-chat" in notes[0]
    assert "no chat template" not in chat(tiny_llama_path, "hello\n", "--no-chat").stderr


def test_one_shot_timings_on_stderr(tiny_llama_path: Path) -> None:
    r = subprocess.run(
        [*KVTOOL, "run", "-m", str(tiny_llama_path), "-p", "hi", "-n", "5", "--temp", "0", "--ignore-eos"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"eval time = +[0-9.]+ ms / +5 runs", r.stderr)
    assert "load time" in r.stderr and "first token" in r.stderr and "load time" not in r.stdout


def test_question_mark_is_help_not_a_message(tiny_llama_path: Path) -> None:
    """`/?` is ollama's help: the list, and nothing goes to the model."""
    r = chat(tiny_llama_path, "/?\n/stats\n")
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        assert f"  {name} " in r.stderr
    assert re.search(r"prompt eval time = +[0-9.]+ ms / +0 tokens", r.stderr)


def _saved_messages(path: Path) -> list[dict[str, str]]:
    import kvtool
    from kvtool.commands.run.chat import chat_section

    return chat_section(kvtool.inspect_state(path))["messages"]


def test_regen_generates_the_last_reply_again(tiny_llama_path: Path, tmp_path: Path) -> None:
    """llama-cli's /regen: the last reply is replaced, not added (greedy: the same text)."""
    r = chat(tiny_llama_path, "/regen\nthe cat\n/regen\n/save s.kvs\n", "--ignore-eos", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "error: no reply to regenerate" in r.stderr
    assert r.stderr.count("3 tokens, ") == 2  # two replies were generated
    msgs = _saved_messages(tmp_path / "s.kvs")
    assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[0]["content"] == "the cat"
    once = chat(tiny_llama_path, "the cat\n/save once.kvs\n", "--ignore-eos", cwd=tmp_path)
    assert _saved_messages(tmp_path / "once.kvs") == msgs, once.stderr


def test_read_adds_a_file_to_the_next_message(tiny_llama_path: Path, tmp_path: Path) -> None:
    """llama-cli's /read FILE: `--- File: FILE ---` and its text begin the next message; a file
    that cannot be read is one error line and the chat goes on."""
    (tmp_path / "notes.txt").write_text("the sky is green\n")
    stdin = "/read missing.txt\n/read notes.txt\nwhat colour?\n/save s.kvs\n"
    r = chat(tiny_llama_path, stdin, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "error: cannot read missing.txt" in r.stderr
    assert "(loaded text from 'notes.txt': it goes with the next message)" in r.stderr
    msgs = _saved_messages(tmp_path / "s.kvs")
    assert [m["content"] for m in msgs if m["role"] == "user"] == [
        "--- File: notes.txt ---\nthe sky is green\nwhat colour?"
    ]


def test_glob_adds_the_files_that_match_as_llama_cli(tiny_llama_path: Path, tmp_path: Path) -> None:
    """llama-cli's /glob: `*` within a folder, `**` across folders, under the current folder or
    the one the pattern starts with; each file as /read adds it, in a sorted walk."""
    (tmp_path / "docs" / "deep").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("A\n")
    (tmp_path / "docs" / "deep" / "b.txt").write_text("B\n")
    (tmp_path / "docs" / "c.md").write_text("C\n")
    stdin = "/glob docs/*.txt\n/glob nothing*.zip\nfirst\n/glob docs/**.txt\nsecond\n/save s.kvs\n"
    r = chat(tiny_llama_path, stdin, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(no file matches nothing*.zip)" in r.stderr
    users = [m["content"] for m in _saved_messages(tmp_path / "s.kvs") if m["role"] == "user"]
    a, b = (
        f"--- File: {tmp_path.resolve() / 'docs' / n} ---\n{n[-5].upper()}\n" for n in ("a.txt", "deep/b.txt")
    )
    assert users == [f"{a}first", f"{a}{b}second"]


def test_glob_match_is_llama_cpps() -> None:
    from kvtool.commands.run.reading import glob_match

    assert glob_match("*.txt", "a.txt") and not glob_match("*.txt", "d/a.txt")
    assert glob_match("**.txt", "d/e/a.txt") and glob_match("**/a.txt", "d/a.txt")
    assert glob_match("a?c", "abc") and not glob_match("a?c", "a/c")
    assert glob_match("[a-c]x", "bx") and not glob_match("[!a-c]x", "bx") and glob_match("[]]", "]")
    assert glob_match("[-a]", "-") and not glob_match("[ab", "a") and glob_match("[ab", "[ab")
    assert glob_match("*" * 40 + "b", "a" * 60 + "b")  # memoized: no exponential search


def _c_glob_match(pattern: str, s: str) -> bool:
    """common.cpp's glob_match transcribed as it is (recursive), the reference for short inputs."""
    from kvtool.commands.run.reading import _class_match

    if not pattern:
        return not s
    if pattern.startswith("**"):
        return _c_glob_match(pattern[2:], s) or (bool(s) and _c_glob_match(pattern, s[1:]))
    if pattern[0] == "*":
        i = 0
        while i < len(s) and s[i] != "/":
            if _c_glob_match(pattern[1:], s[i:]):
                return True
            i += 1
        return _c_glob_match(pattern[1:], s[i:])
    if pattern[0] == "?" and s and s[0] != "/":
        return _c_glob_match(pattern[1:], s[1:])
    if pattern[0] == "[":
        end = 1 + (len(pattern) > 1 and pattern[1] in "]-")
        end = pattern.find("]", end)
        if end >= 0:
            return bool(s) and _class_match(s[0], pattern[1:end]) and _c_glob_match(pattern[end + 1 :], s[1:])
        return bool(s) and s[0] == "[" and _c_glob_match(pattern[1:], s[1:])
    return bool(s) and pattern[0] == s[0] and _c_glob_match(pattern[1:], s[1:])


def test_glob_match_agrees_with_llama_cpps_recursion_on_random_input() -> None:
    import random

    from kvtool.commands.run.reading import glob_match

    rng = random.Random(7)
    for _ in range(20000):
        pattern = "".join(rng.choice("ab/*?[]!-") for _ in range(rng.randint(0, 7)))
        text = "".join(rng.choice("ab/[]-") for _ in range(rng.randint(0, 7)))
        assert glob_match(pattern, text) == _c_glob_match(pattern, text), (pattern, text)


def test_glob_match_takes_paths_of_any_depth() -> None:
    """A file thousands of characters deep (nested folders) matched `**`: the recursion it was
    written as raised RecursionError, a traceback that ended the chat."""
    from kvtool.commands.run.reading import glob_match

    deep = "/".join(["d" * 150] * 30) + "/x.txt"
    assert glob_match("**.txt", deep) and glob_match("**/x.txt", deep) and not glob_match("**.md", deep)
    assert glob_match("d*/" * 30 + "*.txt", deep)


def test_a_name_with_a_nul_byte_is_an_error_line(tiny_llama_path: Path, tmp_path: Path) -> None:
    """A piped line can hold a NUL byte, which no file name can: each command that takes a name
    says so in one line and the chat goes on (os.open's ValueError was a traceback)."""
    stdin = "".join(f"{cmd} a\0b\n" for cmd in ("/read", "/glob", "/save", "/load")) + "hi\n"
    r = chat(tiny_llama_path, stdin, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for cmd in ("/read", "/glob", "/save", "/load"):
        assert f"error: {cmd}: a name holds no NUL byte" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_broken_state_file_is_named_in_its_error(tiny_llama_path: Path, tmp_path: Path) -> None:
    """A chat reads several state files (--session, each /load): the error names which one."""
    r = chat(tiny_llama_path, "hi\n/save s.kvs\n", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cut = tmp_path / "cut.kvs"
    cut.write_bytes((tmp_path / "s.kvs").read_bytes()[:1000])
    r = chat(tiny_llama_path, f"/load {cut}\nhi\n", cwd=tmp_path)
    assert f"error: {cut}: truncated state" in r.stderr, r.stderr


def test_what_changed_since_a_save_is_said_to_be_lost(tiny_llama_path: Path, tmp_path: Path) -> None:
    """Without --session, /save keeps the conversation as it was: a chat that goes on after it
    and ends says its last turns are not kept (they went without a word), and how to keep them."""
    r = chat(tiny_llama_path, "hi\n/save s.kvs\nmore\n", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (
        "(the conversation changed since /save s.kvs and is not kept: /save s.kvs again keeps it" in r.stderr
    )
    r = chat(tiny_llama_path, "hi\n/save s.kvs\n", cwd=tmp_path)
    assert "not kept" not in r.stderr  # nothing since the save
    r = chat(tiny_llama_path, "hi\n", cwd=tmp_path)
    assert "not kept" not in r.stderr and "saved" not in r.stderr  # no /save: nothing was asked for


def test_ctrl_c_stops_a_glob_walk_not_the_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    """/glob over a large tree can walk for long (26 s for /usr here): Ctrl-C stops the walk and
    adds nothing; the chat goes on (the KeyboardInterrupt ended it, as Ctrl-C at the prompt)."""
    from kvtool.commands.run import loop, reading

    def walk(pattern: str) -> tuple[list[Path], bool]:
        raise KeyboardInterrupt

    monkeypatch.setattr(reading, "globbed", walk)
    files: list[str] = ["earlier"]
    loop._read("/glob", "/usr/**/x", files)
    assert files == ["earlier"]
