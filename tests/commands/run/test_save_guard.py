"""No conversation is lost (issue 14, defects 1 and 2): `/save` to a place that takes no state
is an error line and the chat goes on; `--session` is checked before the chat; a `/load`
that fails changes nothing and is not saved over the session; two processes on one stored
conversation keep both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvtool
import kvtool.commands.run  # registers the verb
from kvtool.commands import app
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.pool import ConversationPool
from kvtool.common import registry
from kvtool.common.store import ConversationConflictError, ConversationStore

runner = CliRunner()
PARAMS = kvtool.SamplerParams(seed=3, temp=0.8)


def chat(model: Path, stdin: str, *extra: str) -> tuple[int, str, str]:
    args = ["run", "-m", str(model), "-n", "3", "--temp", "0", "-c", "512", *extra]
    r = runner.invoke(app, args, input=stdin)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def messages(path: Path) -> list[dict[str, str]]:
    return (kvtool.inspect_state(path).app or {})["chat"]["messages"]


def test_save_to_a_directory_is_an_error_and_the_chat_goes_on(tiny_llama_path: Path, tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    session = tmp_path / "chat.kvs"
    stdin = f"hello\n/save {tmp_path / 'dir'}\n/save {notes}\nthe cat\n"
    rc, out, err = chat(tiny_llama_path, stdin, "--session", str(session))
    assert rc == 0, err
    assert f"error: {tmp_path / 'dir'} is a directory: kvtool writes only regular files" in err
    assert f"error: {notes} exists and is not a kvtool state file: not overwriting it" in err
    assert "> the cat" in out  # the turn after the failed saves was answered
    assert len(messages(session)) == 4  # and the whole chat was kept
    assert notes.read_text() == "keep me\n" and (tmp_path / "dir").is_dir()


def test_save_through_a_symlink_keeps_the_link(tiny_llama_path: Path, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    link = tmp_path / "mine.kvs"
    link.symlink_to(tmp_path / "real" / "mine.kvs")
    rc, _, err = chat(tiny_llama_path, f"hello\n/save {link}\n/save {link}\n")
    assert rc == 0, err
    assert link.is_symlink() and len(messages(tmp_path / "real" / "mine.kvs")) == 2


def no_model(name: str, **_: object) -> Path:
    raise AssertionError("the model was loaded before the session path was checked")


@pytest.mark.parametrize("where", ["missing/chat.kvs", "/proc/kvtool-chat.kvs", "dir", "fifo"])
def test_a_session_that_cannot_be_saved_is_refused_before_the_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    path = where if where.startswith("/") else str(tmp_path / where)
    monkeypatch.setattr(registry, "resolve_model", no_model)
    r = runner.invoke(app, ["run", "--session", path], input="hello\n")
    assert isinstance(r.exception, kvtool.StateError), r.exception
    assert "> hello" not in r.stdout


def test_session_error_is_one_line_from_the_cli(tiny_llama_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(tiny_llama_path)]
    r = subprocess.run(
        [*cmd, "--session", "/proc/kvtool-chat.kvs"],
        input="hello\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr.strip()
        == "error: cannot write /proc/kvtool-chat.kvs: /proc takes no new files (No such file or directory)"
    )


class BrokenRng(kvtool.Sampler):
    """Saves a random state of the right size that the generator refuses (all zeros)."""

    def get_state(self) -> tuple[int, list[int], torch.Tensor]:
        seed, history, rng = super().get_state()
        return seed, history, torch.zeros_like(rng)


def bad_conversation(model: kvtool.Model, path: Path) -> None:
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=512, n_batch=256, n_ubatch=256))
    s = ChatSession(ctx, BrokenRng(PARAMS), system="other")
    s.respond("a completely different conversation", n_predict=4)
    s.save_state(path)


def test_a_load_that_fails_in_its_sampler_part_changes_nothing(
    tiny_llama: kvtool.Model, tmp_path: Path
) -> None:
    bad_conversation(tiny_llama, tmp_path / "bad.kvs")
    with pytest.raises(kvtool.StateError, match="sampler"):
        kvtool.inspect_state(tmp_path / "bad.kvs")  # refused before anything is applied
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=512, n_batch=256, n_ubatch=256))
    s = ChatSession(ctx, kvtool.Sampler(PARAMS))
    s.respond("hello", n_predict=3)
    before = (ctx.state_get_data(), list(s.messages), list(s.cached), s.sampler.get_state()[2].clone())
    with pytest.raises(kvtool.StateError):
        s.load_state(tmp_path / "bad.kvs")
    assert ctx.state_get_data() == before[0] and s.messages == before[1] and s.cached == before[2]
    assert torch.equal(s.sampler.get_state()[2], before[3])


def test_a_failed_load_is_not_saved_over_the_session(
    tiny_llama_path: Path, tiny_llama: kvtool.Model, tmp_path: Path
) -> None:
    bad_conversation(tiny_llama, tmp_path / "bad.kvs")
    session = tmp_path / "chat.kvs"
    rc, _, err = chat(tiny_llama_path, "hello\n", "--session", str(session))
    assert rc == 0, err
    mine = messages(session)
    rc, out, err = chat(
        tiny_llama_path, f"/load {tmp_path / 'bad.kvs'}\nthe cat\n", "--session", str(session)
    )
    assert rc == 0, err
    assert f"error: {tmp_path / 'bad.kvs'}: corrupted state: bad sampler random state" in err
    assert "> the cat" in out
    assert messages(session)[:2] == mine and len(messages(session)) == 4


def session_of(ctx: kvtool.Context, seq: int) -> ChatSession:
    return ChatSession(ctx, kvtool.Sampler(PARAMS), seq=seq)


def test_two_pools_on_one_conversation_keep_both(tiny_llama: kvtool.Model, tmp_path: Path) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=512, n_seq_max=2))
    db = tmp_path / "c.db"
    notes: list[str] = []
    a = ConversationPool(ctx, ConversationStore(db), lambda s: session_of(ctx, s), notes.append)
    a.open("c").respond("hello", n_predict=2)
    a.save("c")
    ctx2 = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=512, n_seq_max=2))
    b = ConversationPool(ctx2, ConversationStore(db), lambda s: session_of(ctx2, s))
    b.open("c").respond("b says the dog", n_predict=2)
    a.open("c").respond("a says the cat", n_predict=2)
    b.close_all()  # b saves first
    with pytest.raises(ConversationConflictError):
        a.save("c")  # an explicit save over b's is refused
    a.close_all()  # the save at exit keeps a's conversation under a new name
    assert notes == ["conversation 'c' was saved by another process meanwhile: this one is kept as 'c~2'"]
    store = ConversationStore(db)
    said = {name: [m["content"] for m in store.messages(name) or []] for name in ("c", "c~2")}
    assert "b says the dog" in said["c"] and "a says the cat" not in said["c"]
    assert "a says the cat" in said["c~2"] and "b says the dog" not in said["c~2"]


def test_a_chat_process_does_not_overwrite_another_ones_turns(
    tiny_llama_path: Path, tiny_llama: kvtool.Model, tmp_path: Path
) -> None:
    db = tmp_path / "c.db"
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=512, n_seq_max=2))
    other = ConversationPool(ctx, ConversationStore(db), lambda s: session_of(ctx, s))
    other.open("c").respond("hello", n_predict=2)
    other.close_all()
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(tiny_llama_path), "-n", "2", "-c", "512"]
    p = subprocess.Popen(
        [*cmd, "--store", str(db), "--conversation-name", "c"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stderr is not None
    loaded = [p.stderr.readline() for _ in range(2)]  # the no-template note, then what it resumed
    assert loaded[1].startswith("(conversation 'c' of the store: 1 turn, "), loaded  # it has loaded 'c'
    other.open("c").respond("the other process says hi", n_predict=2)  # and saves meanwhile
    other.close_all()
    _, err = p.communicate("the chat process says hi\n", timeout=600)
    assert p.returncode == 0, err
    assert "this one is kept as 'c~2'" in err
    store = ConversationStore(db)
    assert "the other process says hi" in str(store.messages("c"))
    assert "the chat process says hi" in str(store.messages("c~2"))
