"""ChatSession: turns decode only their new tokens, the memory and `cached` agree after a
failed turn, --ignore-eos is a constructor argument; on SmolLM2, a chat answers."""

from __future__ import annotations

import pytest

import kvtool
from kvtool.commands.common.progress import PROMPT_CHUNK
from kvtool.commands.run.chat import ChatSession

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


def test_a_prompt_that_does_not_fit_keeps_the_conversation(tiny_llama: kvtool.Model) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256))
    chat = ChatSession(ctx, kvtool.Sampler(GREEDY), use_template=False)
    chat.respond("hello", n_predict=2)
    cached = list(chat.cached)
    with pytest.raises(kvtool.ContextFullError):
        chat.respond(" x" * 400, n_predict=2)
    assert chat.cached == cached and ctx.memory.seq_pos_max(0) + 1 == len(cached)


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
