"""Where a conversation goes when its own place takes no save (issue 28, item 3)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

import kvtool
from kvtool.commands.run import rescue
from kvtool.commands.run.chat import ChatSession

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_state_goes_to_the_state_folder_else_the_temp_folder(
    tiny_llama: kvtool.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=512))
    s = ChatSession(ctx, kvtool.Sampler(kvtool.SamplerParams(temp=0)))
    s.respond("hi", n_predict=3)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    first = rescue.rescue(s.state_data(), s.messages, rescue.name_for("/a/b/chat.kvs"))
    assert first is not None and first.parent == tmp_path / "state" / "kvtool" / "rescued"
    assert (kvtool.inspect_state(first).app or {})["chat"]["messages"] == s.messages
    (tmp_path / "blocked").write_text("a file where the state folder would go")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "blocked"))
    second = rescue.rescue(s.state_data(), s.messages, "x")
    assert second is not None and second.parent.parent == tmp_path / "tmp"


def test_without_a_state_the_messages_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    path = rescue.rescue(None, MSGS, "chat")
    assert path is not None and path.suffix == ".json"
    assert json.loads(path.read_text(encoding="utf-8")) == {"messages": MSGS}


def test_nowhere_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "f"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "f"))
    assert rescue.rescue(b"x", MSGS, "chat") is None
