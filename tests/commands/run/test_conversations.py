"""Resumable chats: a ChatSession saved and resumed elsewhere continues the conversation as if
never interrupted; a pool keeps only the active conversations in the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvtool
from kvtool import StateError
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.pool import ConversationPool
from kvtool.common.store import ConversationStore

PARAMS = kvtool.SamplerParams(seed=3, temp=0.8)


def ctx_of(m: kvtool.Model, unified: bool, n_ctx: int = 512, n_seq_max: int = 4) -> kvtool.Context:
    params = kvtool.ContextParams(
        n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_seq_max=n_seq_max, kv_unified=unified
    )
    return kvtool.Context(m, params)


def session(ctx: kvtool.Context, seq: int = 0) -> ChatSession:
    return ChatSession(ctx, kvtool.Sampler(PARAMS), system="be brief", seq=seq)


def talk(s: ChatSession, *turns: str) -> list[str]:
    return [s.respond(t, n_predict=5)[0] for t in turns]


@pytest.mark.parametrize("unified", [True, False])
def test_resumed_chat_continues_like_an_uninterrupted_one(
    tiny_llama: kvtool.Model, tmp_path: Path, unified: bool
) -> None:
    a = session(ctx_of(tiny_llama, True))
    talk(a, "hello", "the cat sat")
    n = a.save_state(tmp_path / "chat.kvs")
    assert n == (tmp_path / "chat.kvs").stat().st_size

    b = session(ctx_of(tiny_llama, unified, n_ctx=1536, n_seq_max=3), seq=2)
    b.system = None
    info = b.load_state(tmp_path / "chat.kvs")
    assert info.kind == "sequence"
    assert b.messages == a.messages and b.cached == a.cached and b.system == "be brief"
    assert b.ctx.memory.seq_pos_max(2) + 1 == len(b.cached)
    assert talk(b, "on the mat", "and then") == talk(a, "on the mat", "and then")


def test_a_state_without_a_conversation_changes_nothing(tiny_llama: kvtool.Model, tmp_path: Path) -> None:
    ctx = ctx_of(tiny_llama, True)
    s = session(ctx)
    talk(s, "hello")
    before, msgs, cached = ctx.state_get_data(), list(s.messages), list(s.cached)
    with pytest.raises(StateError, match="no chat conversation"):
        s.restore_data(ctx.state_seq_get_data(0))  # cells but no messages
    ctx.state_save_file(tmp_path / "bare.kvs", 0)
    with pytest.raises(StateError, match="no chat conversation"):
        s.load_state(tmp_path / "bare.kvs")
    # every cell, K/V row and the logits are as they were
    assert ctx.state_get_data() == before and s.messages == msgs and s.cached == cached


def test_pool_keeps_only_active_conversations_in_memory(tiny_llama: kvtool.Model, tmp_path: Path) -> None:
    ctx = ctx_of(tiny_llama, True, n_seq_max=2)
    store = ConversationStore(tmp_path / "c.db")
    pool = ConversationPool(ctx, store, lambda seq: session(ctx, seq))
    ref = session(ctx_of(tiny_llama, True))  # conversation "a", never evicted

    assert talk(pool.open("a"), "hello") == talk(ref, "hello")
    talk(pool.open("b"), "the dog")
    used = ctx.n_used_cells()
    talk(pool.open("c"), "a cat")  # no free sequence: "a" goes to the store
    assert pool.active == ["b", "c"] and store.get("a") is not None
    assert ctx.n_used_cells() < used + 20

    a = pool.open("a")  # evicts "b", restores "a" from the store
    assert pool.active == ["c", "a"]
    assert a.messages == ref.messages
    assert talk(a, "more") == talk(ref, "more")
    pool.close_all()
    assert ctx.n_used_cells() == 0
    assert sorted(r.name for r in store.list()) == ["a", "b", "c"]
    store.close()
