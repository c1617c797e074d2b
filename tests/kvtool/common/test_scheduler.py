"""The shared scheduler on the tiny models: prompt reuse by longest common prefix (and the same
tokens as a from-scratch greedy run), slot choice by similarity, stop strings, limits,
cancellation, step budgets, log-probabilities and the ledger's reasons."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvtool
from kvtool.common.scheduler import Scheduler, SchedulerParams
from kvtool.common.task import Request, Task, TokenOut

MODELS = Path(__file__).parent.parent.parent / "data" / "tiny" / "models"
GREEDY = kvtool.SamplerParams(temp=0.0)
PROMPT = [1, *range(10, 50)]


class Log:
    """TaskEvents that keep what they hear."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.outs: list[TokenOut] = []
        self.done: list[Task] = []

    def on_start(self, task: Task) -> None:
        return None

    def on_token(self, task: Task, out: TokenOut) -> None:
        self.outs.append(out)
        self.texts.append(out.text)

    def on_done(self, task: Task) -> None:
        self.done.append(task)


def reference(model: kvtool.Model, tokens: list[int], n: int) -> list[int]:
    """Greedy tokens of a fresh context, one plain decode at a time."""
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=512))
    logits = kvtool.decode_tokens(ctx, tokens, 0, 0)
    out: list[int] = []
    while len(out) < n:
        t = int(torch.argmax(logits))
        out.append(t)
        if model.is_eog(t):
            break
        logits = kvtool.decode_tokens(ctx, [t], 0, len(tokens) + len(out) - 1)
    return out


def run(sched: Scheduler, *reqs: Request) -> list[Task]:
    tasks = [sched.submit(r, Log()) for r in reqs]
    while sched.step():
        pass
    assert all(t.done.is_set() for t in tasks)
    return tasks


def make(model: kvtool.Model, n_slots: int = 2, **kw: object) -> Scheduler:
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=512 * n_slots, n_seq_max=n_slots))
    return Scheduler(ctx, SchedulerParams(n_slots, **kw))  # type: ignore[arg-type]


def test_a_shared_prefix_is_reused_and_the_answer_is_the_same(tiny_llama: kvtool.Model) -> None:
    sched = make(tiny_llama)
    (a,) = run(sched, Request(PROMPT, 8, GREEDY))
    assert (a.timings.cache_n, a.timings.prompt_n, a.reused_from) == (0, len(PROMPT), "")
    longer = [*PROMPT[:30], 60, 61, 62]
    (b,) = run(sched, Request(longer, 8, GREEDY))
    assert b.slot == a.slot  # the slot holding the prefix, by similarity
    assert (b.timings.cache_n, b.timings.prompt_n, b.reused_from) == (30, 3, "slot")
    assert b.generated == reference(tiny_llama, longer, 8)
    assert sched.stats.reused["slot"] == 30 and sched.stats.n_prompt_cached == 30
    # the same prompt again: all but the last token (its logits are needed) come from the slot
    (c,) = run(sched, Request(longer, 8, GREEDY))
    assert (c.timings.cache_n, c.generated) == (len(longer) - 1, b.generated)


def test_without_cache_prompt_nothing_is_reused_and_the_ledger_says_why(tiny_llama: kvtool.Model) -> None:
    sched = make(tiny_llama, 1)
    run(sched, Request(PROMPT, 4, GREEDY))
    (b,) = run(sched, Request(PROMPT, 4, GREEDY, cache_prompt=False))
    assert b.timings.cache_n == 0 and b.timings.prompt_n == len(PROMPT)
    assert sched.stats.reprocessed == {"cache_prompt_off": 1}
    assert sched.ctx.memory.seq_pos_max(0) == -1  # nothing kept after it


def test_a_busy_slot_and_a_low_similarity_are_counted(tiny_llama: kvtool.Model) -> None:
    sched = make(tiny_llama, 2, slot_prompt_similarity=0.9)
    run(sched, Request(PROMPT, 2, GREEDY))
    half = PROMPT[:20] + list(range(100, 120))  # shares half of its tokens: under 0.9
    (b,) = run(sched, Request(half, 2, GREEDY))
    assert b.timings.cache_n == 0 and sched.stats.reprocessed == {"below_similarity": 1}
    sched = make(tiny_llama, 2)
    run(sched, Request(PROMPT, 2, GREEDY))
    first = sched.submit(Request(PROMPT, 30, GREEDY, ignore_eos=True))
    sched.step()  # it holds the slot with the prefix
    second = sched.submit(Request([*PROMPT[:35], 7], 2, GREEDY))
    while sched.step():
        pass
    assert first.slot != second.slot and second.timings.cache_n == 0
    assert sched.stats.reprocessed["slot_busy"] == 1


def test_a_recurrent_memory_cannot_cut_back_and_answers_the_same(tiny_llama: kvtool.Model) -> None:
    model = kvtool.Model(MODELS / "tiny-mamba2.gguf")
    sched = make(model, 1)
    run(sched, Request(PROMPT, 3, GREEDY))
    other = [*PROMPT[:30], 5, 6]
    (b,) = run(sched, Request(other, 5, GREEDY))
    assert b.timings.cache_n == 0 and sched.stats.reprocessed == {"cannot_truncate": 1}
    assert b.generated == reference(model, other, 5)


def test_stop_strings_end_the_text_and_are_never_streamed(tiny_llama: kvtool.Model) -> None:
    sched = make(tiny_llama, 1)
    (a,) = run(sched, Request(PROMPT, 24, GREEDY, ignore_eos=True))
    text = a.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    log = Log()
    b = sched.submit(Request(PROMPT, 24, GREEDY, stop=(stop,), ignore_eos=True), log)
    while sched.step():
        pass
    assert b.stop == "word" and b.stopping_word == stop
    assert b.text == text[: text.index(stop)]
    assert "".join(log.texts) + b.rest() == b.text


def test_limits_cancellation_and_ignore_eos(tiny_llama: kvtool.Model) -> None:
    sched = make(tiny_llama, 1)
    (a,) = run(sched, Request(PROMPT, 5, GREEDY, ignore_eos=True))
    assert (a.stop, a.n_decoded, a.timings.predicted_n) == ("limit", 5, 5)
    assert not any(tiny_llama.is_eog(t) for t in a.generated)
    t = sched.submit(Request(PROMPT, -1, GREEDY, ignore_eos=True))
    sched.step()
    sched.step()
    t.cancel()
    sched.step()
    assert t.stop == "cancelled" and not sched.slots[0].busy
    queued = sched.submit(Request(PROMPT, 5, GREEDY))
    queued.cancel()
    assert not sched.step() and queued.stop == "cancelled"
    with pytest.raises(kvtool.ContextFullError):
        sched.submit(Request([1] * 600, 5, GREEDY))


def test_a_step_budget_chunks_prompts_without_changing_answers(tiny_llama: kvtool.Model) -> None:
    whole = make(tiny_llama, 2)
    chunked = make(tiny_llama, 2, n_step_tokens=16)
    reqs = [Request(PROMPT, 6, GREEDY), Request([*PROMPT[:10], 9, 9, 9], 6, GREEDY)]
    a = run(whole, *reqs)
    b = run(chunked, *reqs)
    assert [t.generated for t in a] == [t.generated for t in b]
    assert whole.stats.n_steps < chunked.stats.n_steps


def test_logprobs_are_the_raw_distributions(tiny_llama: kvtool.Model) -> None:
    sched = make(tiny_llama, 1)
    log = Log()
    t = sched.submit(Request(PROMPT, 1, GREEDY, n_probs=3), log)
    while sched.step():
        pass
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=512))
    want = torch.log_softmax(kvtool.decode_tokens(ctx, PROMPT, 0, 0), 0)
    (out,) = log.outs
    assert out.prob is not None and out.prob.id == t.generated[0]
    assert out.prob.logprob == pytest.approx(float(want[out.id]), abs=1e-5)
    assert [p.id for p in out.top] == torch.topk(want, 3).indices.tolist()


def test_a_full_unified_cache_takes_back_an_idle_slots_cached_prompt(tiny_llama: kvtool.Model) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True))
    sched = Scheduler(ctx, SchedulerParams(2, slot_prompt_similarity=0.0))
    first = [1, *[10 + i % 200 for i in range(150)]]
    (a,) = run(sched, Request(first, 4, GREEDY))
    assert ctx.memory.seq_pos_max(a.slot) >= 150  # kept for reuse
    other = [1, *[60 + i % 150 for i in range(150)]]
    (b,) = run(sched, Request(other, 4, GREEDY))  # does not fit beside it: the idle slot gives way
    assert b.stop == "limit" and sched.stats.n_evicted == 1 and sched.stats.n_cache_miss == 0
    assert ctx.memory.seq_pos_max(a.slot) == -1
    assert b.generated == reference(tiny_llama, other, 4)
    (c,) = run(sched, Request(first, 4, GREEDY, id_slot=a.slot))
    assert c.timings.cache_n == 0 and sched.stats.reprocessed["evicted"] == 1
