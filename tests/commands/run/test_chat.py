"""ChatSession: turns decode only their new tokens, the memory and `cached` agree after a
failed turn, --ignore-eos is a constructor argument; on SmolLM2, a chat answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kvtool
from kvtool.commands.common.progress import PROMPT_CHUNK
from kvtool.commands.run.chat import ChatSession
from tests.helpers.tiny_gemma3 import write_tiny_gemma3
from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama

GREEDY = kvtool.SamplerParams(temp=0.0)


def test_recovers_when_memory_holds_more_than_it_knows(tiny_llama: kvtool.Model) -> None:
    """A prompt decode that failed part-way leaves cells the session never recorded; the next
    turn must cut them, not trip over llama.cpp's Y = X + 1 rule."""
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False)
    ctx.decode(kvtool.Batch.from_tokens([5, 6, 7, 8]))  # cells the session does not know about
    _, gen = chat.respond("hello", n_predict=3)
    assert len(gen.tokens) == 3
    assert ctx.memory.seq_pos_max(0) + 1 == len(chat.cached)


def test_a_turn_decodes_only_its_new_tokens(tiny_llama: kvtool.Model) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False)
    chat.respond("hello there", n_predict=4)
    n0 = ctx.n_decoded
    chat.respond(" more", n_predict=1)
    new = tiny_llama.tokenize(" more", add_special=False)
    # the first reply's last sampled token, then the new text's tokens
    assert ctx.n_decoded - n0 == 1 + len(new)
    first = tiny_llama.tokenize("hello there", add_special=True)
    assert chat.timings.n_prompt == len(first) + 1 + len(new)


def test_raw_text_continues_after_the_whole_reply(tiny_llama: kvtool.Model) -> None:
    """The reply's last sampled token is shown but not decoded yet: the next turn keeps it."""
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False)
    _, gen = chat.respond("hello there", n_predict=4)
    assert gen.stop == "length"
    first = tiny_llama.tokenize("hello there", add_special=True)
    chat.respond(" more", n_predict=1)
    more = tiny_llama.tokenize(" more", add_special=False)
    assert chat.cached[: len(first) + 4 + len(more)] == first + gen.tokens + more


def test_raw_prompt_parses_special_tokens_then_typed_text_does_not(tiny_llama: kvtool.Model) -> None:
    """llama-completion: the first prompt is tokenized with its special tokens parsed (`<s>` is
    the BOS token), text typed after it is plain text."""
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False)
    _, gen = chat.respond("a<s>b", n_predict=2)
    first = tiny_llama.tokenize("a<s>b", add_special=True, parse_special=True)
    assert first != tiny_llama.tokenize("a<s>b", add_special=True, parse_special=False)
    chat.respond("c<s>", n_predict=1)
    typed = tiny_llama.tokenize("c<s>", add_special=False, parse_special=False)
    assert chat.cached[: len(first) + 2 + len(typed)] == first + gen.tokens + typed


def test_a_prompt_that_does_not_fit_keeps_the_conversation(tiny_llama: kvtool.Model) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False)
    chat.respond("hello", n_predict=2)
    cached = list(chat.cached)
    with pytest.raises(kvtool.ContextFullError):
        chat.respond(" x" * 400, n_predict=2)
    assert chat.cached == cached and ctx.memory.seq_pos_max(0) + 1 == len(cached)


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["on_tokens", "generate"])
def test_an_interrupt_before_the_reply_drops_the_whole_turn(
    tiny_llama: kvtool.Model, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A signal that lands after the user's message is added but before the reply begins (as
    its tokens are shown, or between the prompt's decode and the first sampled token) leaves
    the messages as they were: a kept user message without its reply made the next turn render
    two user messages in a row, and the saved conversation showed a turn never answered."""
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=True)
    chat.respond("hello", n_predict=3)
    messages = [dict(m) for m in chat.messages]
    if where == "generate":
        monkeypatch.setattr(sys.modules[ChatSession.__module__], "generate", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        chat.respond("and then?", n_predict=3, on_tokens=_interrupt if where == "on_tokens" else None)
    assert chat.messages == messages
    assert ctx.memory.seq_pos_max(0) + 1 == len(chat.cached)
    monkeypatch.undo()
    chat.respond("how does it end", n_predict=3)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2


def test_ignore_eos_bans_end_of_generation(tiny_llama: kvtool.Model) -> None:
    def reply(ignore_eos: bool) -> list[int]:
        ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
        chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False, ignore_eos=ignore_eos)
        _, gen = chat.respond("hello", n_predict=40)
        return gen.tokens if gen.stop == "length" else [*gen.tokens, -1]

    assert reply(False)[-1] == -1  # greedy, this prompt ends before 40 tokens
    banned = reply(True)
    assert len(banned) == 40 and not set(banned) & tiny_llama.vocab.eog_ids


@pytest.mark.real
def test_one_shot_chat_answers() -> None:
    smollm2 = kvtool.load_model("smollm2")
    ctx = kvtool.Context(smollm2, kvtool.ContextParams(n_ctx=2048, n_seq_max=1, kv_unified=True))
    sampler = kvtool.Sampler(GREEDY)
    chat = ChatSession(ctx, sampler)
    text, _ = chat.respond("What is the capital of France?", n_predict=24)
    assert "Paris" in text
    # a second turn decodes only its new tokens: the first turn stays in the memory
    n_before = len(chat.cached)
    text2, _ = chat.respond("And of Italy?", n_predict=24)
    assert chat.cached[:n_before] == chat.prompt_tokens()[:n_before]
    assert "Rome" in text2


def test_context_shift_keeps_generating_and_cached_matches_memory(tmp_path: Path) -> None:
    """A reply longer than the context shifts it (keeping the BOS and 3 tokens) and goes on. On a
    1-layer model the K/V of a token depend on it and its position alone, so after the shifts
    the memory must compute what the session's `cached` tokens decoded afresh compute."""
    model = kvtool.Model(write_tiny_llama(tmp_path / "l1.gguf", TinyLlama(n_layer=1, seed=1)))
    # f32 K: a shifted row is re-rotated exactly only if it is not rounded again
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False, ignore_eos=True, keep=3)
    _, gen = chat.respond("hello there", n_predict=400)
    assert len(gen.tokens) == 400 and gen.stop == "length" and len(gen.shifts) >= 2
    assert all(k == 4 for k, _ in gen.shifts)  # BOS + keep
    first = model.tokenize("hello there", add_special=True)
    assert chat.cached[:4] == first[:4]
    assert len(chat.cached) == ctx.memory.seq_pos_max(0) + 1 <= 256
    ctx.decode(kvtool.Batch.from_tokens([9], pos0=len(chat.cached)))
    ref = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    ref.decode(kvtool.Batch.from_tokens([*chat.cached, 9]))
    torch.testing.assert_close(ctx.logits_ith(-1), ref.logits_ith(-1), rtol=1e-4, atol=1e-4)


def test_context_shift_off_stops_at_a_full_context(tiny_llama: kvtool.Model) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False, ignore_eos=True)
    _, gen = chat.respond("hello there", n_predict=400)
    assert gen.stop == "ctx_full" and not gen.shifts and len(chat.cached) == 256


def test_context_shift_on_a_memory_that_cannot_shift_is_refused(tmp_path: Path) -> None:
    """gemma3 with a 256-cell window cache beside a 1024-cell context cannot move positions."""
    model = kvtool.Model(write_tiny_gemma3(tmp_path / "g3.gguf"))
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=1024, n_ubatch=8))
    with pytest.raises(kvtool.KvtoolError, match="cannot shift"):
        ChatSession(ctx, kvtool.Sampler(GREEDY), keep=0)
    ChatSession(ctx, kvtool.Sampler(GREEDY))  # without a context shift it chats as before


@pytest.mark.parametrize("use_template", [False, True])
def test_context_shift_keeps_chatting_turn_after_turn(tmp_path: Path, use_template: bool) -> None:
    """Turns that no longer fit shift the memory and append to it (the template's text after
    the last reply, or the raw text); the memory still computes what `cached` decoded afresh
    computes (1-layer model)."""
    model = kvtool.Model(write_tiny_llama(tmp_path / "l1.gguf", TinyLlama(n_layer=1, seed=1)))
    # f32 K: a shifted row is re-rotated exactly only if it is not rounded again
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=use_template, ignore_eos=True, keep=2)
    for turn in range(4):
        _, gen = chat.respond(f"turn {turn}: tell me more", n_predict=120)
        assert len(gen.tokens) == 120
        assert len(chat.cached) == ctx.memory.seq_pos_max(0) + 1 <= 256
    assert chat.shifted
    ctx.decode(kvtool.Batch.from_tokens([9], pos0=len(chat.cached)))
    ref = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    ref.decode(kvtool.Batch.from_tokens([*chat.cached, 9]))
    torch.testing.assert_close(ctx.logits_ith(-1), ref.logits_ith(-1), rtol=1e-4, atol=1e-4)


def test_a_long_prompt_decoded_in_chunks_gives_the_same_reply(tiny_llama: kvtool.Model) -> None:
    """The chunks that let `run` show a prompt's progress change nothing the model sees."""
    text = " ".join(["the cat sat on the mat and the dog ran"] * 12)  # several PROMPT_CHUNKs
    replies, reports = [], []
    for on_prompt in (None, lambda done, total: reports.append((done, total))):
        ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=1024))
        sampler = kvtool.Sampler(kvtool.SamplerParams(temp=0))
        session = ChatSession(ctx, sampler, use_template=False)
        replies.append(session.respond(text, 8, on_prompt=on_prompt)[1].tokens)
        prompt = ctx.model.tokenize(text, add_special=True)
        assert session.cached[: len(prompt)] == prompt
    total = reports[-1][1]
    assert replies[0] == replies[1]
    assert total > 2 * PROMPT_CHUNK and reports[-1][0] == total
    assert [d for d, _ in reports] == sorted({d for d, _ in reports})  # grows, chunk by chunk
