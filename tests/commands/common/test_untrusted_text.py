"""Text from a file, a user or a model prints as it is on every verb: rich markup (`[/x]`,
`[bold]`, `[link=...]`), emoji codes and backslashes are not read (issue 14, defect 3)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import gguf
import pytest

from kvtool.commands.common.text import console, plain
from tests.helpers.cli import kvtool_cli
from tests.helpers.tiny_gguf import write_tiny_llama

HOSTILE = ["[/x]", "[bold]b[/bold]", "[link=https://e.x]l", "back\\", "\\[/y]", ":smile:", "[/]"]
NAME = "[/x] [bold]b [link=https://e.x]l :smile: back\\"


@pytest.mark.parametrize("text", HOSTILE)
def test_console_and_labels_print_text_literally(text: str) -> None:
    out = io.StringIO()
    c = console()
    c.file = out
    c.print(f"a {text}", style="dim")
    c.print(plain(text))
    assert out.getvalue() == f"a {text}\n{text}\n"


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model named NAME in its GGUF, in a folder whose path holds `[/x]` and `[bold]`."""
    folder = tmp_path_factory.mktemp("m") / "[bold]" / "[" / "x]"
    folder.mkdir(parents=True)
    real = gguf.GGUFWriter.add_name
    try:
        gguf.GGUFWriter.add_name = lambda self, _name: real(self, NAME)  # type: ignore[method-assign]
        return write_tiny_llama(folder / "[link=x]tiny\\.gguf")
    finally:
        gguf.GGUFWriter.add_name = real  # type: ignore[method-assign]


def test_run_shows_the_model_name_and_path_as_they_are(
    hostile_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    r = kvtool_cli(monkeypatch, capsys, "run", "-m", str(hostile_model), "-p", "hi", "-n", "2", "-v")
    assert r.code == 0, r.err
    assert f"model: {NAME} (llama, {hostile_model})" in r.err
    assert f"note: {hostile_model.name} has no chat template" in r.err


def test_store_names_list_and_print_as_they_are(
    tiny_llama_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = tmp_path / "[/x]" / "chats.db"
    store.parent.mkdir(parents=True)
    # a typed line that ends in a backslash goes on (llama-cli's continuation): the name given
    # on the command line ends in one instead
    turns = "hello\n/save [bold]co\\py\n/list\n"
    args = ["run", "-m", str(tiny_llama_path), "-n", "2", "--store", str(store)]
    r = kvtool_cli(monkeypatch, capsys, *args, "--conversation-name", "[/x]\\", stdin=turns)
    assert r.code == 0, r.err
    assert "saved as '[bold]co\\py'" in r.err
    assert "\n[bold]co\\py (2), [/x]\\* (2)\n" in r.err  # the /list line: each turn is saved as it ends
    r = kvtool_cli(monkeypatch, capsys, *args, "--conversation-name", "[bold]co\\py", stdin="/list\n")
    assert r.code == 0 and "(conversation '[bold]co\\py' of the store: 1 turn" in r.err, r.err
    r = kvtool_cli(monkeypatch, capsys, "state", "list", "--store", str(store))
    assert r.code == 0, r.err
    assert "│ [/x]\\ " in r.out and "│ [bold]co\\py " in r.out and "chats.db" in r.out


def test_state_inspect_and_save_print_paths_as_they_are(
    tiny_llama_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / "[bold]" / "[" / "x]"
    folder.mkdir(parents=True)
    state = folder / "s\\.kvs"
    r = kvtool_cli(
        monkeypatch, capsys, "state", "save", "-m", str(tiny_llama_path), "-p", "hi", "-o", str(state)
    )
    assert r.code == 0 and f"to {state}:" in r.err, r.err
    r = kvtool_cli(monkeypatch, capsys, "state", "inspect", str(state))
    assert r.code == 0 and f"file: {state} (" in r.out, r.err


def test_parallel_prints_questions_and_paths_as_they_are(
    tiny_llama_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / "[" / "x]"
    folder.mkdir(parents=True)
    questions = folder / "q.txt"
    questions.write_text("[/x] what?\n", encoding="utf-8")
    model = folder / "m.gguf"
    shutil.copy(tiny_llama_path, model)
    system = folder / "system.txt"
    system.write_text("[bold]be brief[/x]\n", encoding="utf-8")
    args = ["parallel", "-m", str(model), "-f", str(questions), "--system-file", str(system), "-n", "2"]
    r = kvtool_cli(monkeypatch, capsys, *args)
    assert r.code == 0, r.err
    assert "1 prompt: [/x] what?" in r.out and f"Model and path used:  {model}" in r.out


def test_an_unknown_model_name_with_markup_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    r = kvtool_cli(monkeypatch, capsys, "run", "-m", "[/x]", "-p", "hi")
    assert "[/x]" in r.one_error_line()


def test_no_verb_styles_text_with_markup_tags() -> None:
    """The consoles read no markup, so a `[yellow]...[/]` in a verb would print as brackets:
    styles are given with style= (this catches one merged in from an older branch)."""
    import ast
    import re

    tag = re.compile(r"\[/?(?:dim|red|yellow|green|bold|italic|magenta|cyan|blue)\b[^\]]*\]|\[/\]")
    root = Path(__file__).parents[3] / "commands"
    found = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and tag.search(node.value)
    ]
    assert not found


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31m\u202eevil\x9b"


def test_control_characters_are_shown_escaped() -> None:
    """A stored conversation's name holding escape sequences cleared the screen and set the
    window title when listed (issue 28, item 10): every string a console prints, and every
    label, shows its control characters as escapes; tabs and newlines stay."""
    out = io.StringIO()
    c = console()
    c.file = out
    c.print(f"name {ESCAPES}\nend")
    c.print(plain(ESCAPES))
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07\x9b\u202e"), repr(text)
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in text and "\\u202eevil\\x9b" in text and "\nend\n" in text


def test_a_store_name_with_escapes_lists_escaped(
    tiny_llama_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = tmp_path / "chats.db"
    args = [
        "run",
        "-m",
        str(tiny_llama_path),
        "-n",
        "2",
        "--store",
        str(store),
        "--conversation-name",
        ESCAPES,
    ]
    r = kvtool_cli(monkeypatch, capsys, *args, stdin="hello\n/list\n")
    assert r.code == 0 and "\x1b" not in r.err and "\\x1b]0;pwned" in r.err, r.err
    r = kvtool_cli(monkeypatch, capsys, "state", "list", "--store", str(store))
    assert r.code == 0 and "\x1b" not in r.out and "\\x1b]0;pwned" in r.out, r.out
    r = kvtool_cli(monkeypatch, capsys, "run", "-m", f"/nonexistent/{ESCAPES}.gguf", "-p", "hi")
    assert "\x1b" not in r.err and "\\x1b" in r.one_error_line()
