"""`Context.state_save_file` writes only state files: through a symlink, never over a FIFO, a
folder or a file of another kind (issue 14, defect 1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvtool
from kvtool import StateError
from kvtool.state import check_state_path, write_atomic


def context(model: kvtool.Model) -> kvtool.Context:
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_batch=64, n_ubatch=64))
    kvtool.decode_tokens(ctx, model.tokenize("hello world"), 0, 0)
    return ctx


def test_a_state_replaces_a_state_through_a_symlink(tiny_llama: kvtool.Model, tmp_path: Path) -> None:
    ctx = context(tiny_llama)
    link = tmp_path / "s.kvs"
    link.symlink_to(tmp_path / "target.kvs")
    n = ctx.state_save_file(link)
    assert ctx.state_save_file(link) == n  # the second save replaces the first
    assert link.is_symlink() and (tmp_path / "target.kvs").stat().st_size == n
    assert check_state_path(link) == (tmp_path / "target.kvs").resolve()


def test_what_is_not_a_state_file_is_refused_and_kept(tiny_llama: kvtool.Model, tmp_path: Path) -> None:
    ctx = context(tiny_llama)
    (tmp_path / "notes.txt").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name, msg in (
        ("notes.txt", "is not a kvtool state file"),
        ("fifo", "is a FIFO"),
        ("dir", "is a directory"),
    ):
        with pytest.raises(StateError, match=msg):
            ctx.state_save_file(tmp_path / name)
        with pytest.raises(StateError, match=msg):
            check_state_path(tmp_path / name)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "notes.txt"]
    write_atomic(tmp_path / "notes.txt", ctx.state_get_data(), overwrite=True)  # asked for
    assert kvtool.inspect_state(tmp_path / "notes.txt").kind == "context"


def test_loading_a_fifo_does_not_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StateError, match="not a regular file"):
        kvtool.inspect_state(tmp_path / "fifo")
