"""`run` with a memory that cannot be cut back (tiny Mamba-2, ChatML template): each turn keeps
a checkpoint 4 tokens before its prompt's end, a saved conversation carries them, and a resumed
one (a --session file, a store) goes on from its state: the next turn re-processes only what
follows the last checkpoint, and replies as a from-scratch run of the same prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvtool
from kvtool.commands.run.chat import ChatSession

MODEL = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-mamba2.gguf"
GREEDY = kvtool.SamplerParams(temp=0.0)


def scratch(model: kvtool.Model, tokens: list[int], n: int) -> list[int]:
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=1024))
    logits = kvtool.decode_tokens(ctx, tokens, 0, 0)
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = kvtool.decode_tokens(ctx, [out[-1]], 0, len(tokens) + len(out) - 1)
    return out


@pytest.mark.parametrize("n_checkpoints", [0, 8])
def test_a_resumed_conversation_goes_on_from_its_state(n_checkpoints: int, tmp_path: Path) -> None:
    model = kvtool.Model(MODEL)
    prompts: list[list[int]] = []

    def session() -> ChatSession:
        ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=1024))
        return ChatSession(ctx, kvtool.Sampler(GREEDY), n_checkpoints=n_checkpoints)

    chat = session()
    for text in ("hello there, how are you doing today", "and what about tomorrow then"):
        chat.respond(text, n_predict=8, on_tokens=lambda t, n: prompts.append(t))
    chat.save_state(tmp_path / "chat.kvs")
    resumed = session()
    resumed.load_state(tmp_path / "chat.kvs")
    assert resumed.messages == chat.messages
    _, gen = resumed.respond("a third question", n_predict=8, on_tokens=lambda t, n: prompts.append(t))
    assert gen.tokens == scratch(model, prompts[-1], 8)
    if n_checkpoints:  # from the second prompt's end-of-prompt checkpoint
        assert resumed.timings.n_prompt == len(prompts[-1]) - (len(prompts[-2]) - 4)
        assert [c.n_tokens for c in resumed.checkpoints.items][-1] == len(prompts[-1]) - 4
    else:  # the rendering of the reply differs from what the state holds: from scratch
        assert resumed.timings.n_prompt == len(prompts[-1])


def test_a_state_without_checkpoints_still_loads() -> None:
    model = kvtool.Model(MODEL)
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=1024))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), n_checkpoints=8)
    chat.respond("hello", n_predict=4)
    data = ctx.state_seq_get_data(
        0, tokens=chat.cached, app={"chat": {"system": None, "messages": chat.messages}}
    )
    again = ChatSession(
        kvtool.Context(model, kvtool.ContextParams(n_ctx=1024)), kvtool.Sampler(GREEDY), n_checkpoints=8
    )
    again.restore_data(data)
    assert again.cached == chat.cached and again.checkpoints.items == []
