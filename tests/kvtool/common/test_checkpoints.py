"""Context checkpoints in the shared scheduler, on tiny sliding-window (Gemma 2, Gemma 3),
recurrent (Mamba-2) and hybrid (Granite hybrid) models: a conversation continued, regenerated and
edited in its last turn re-processes only the tokens after the nearest checkpoint, and answers
with the same greedy tokens as a from-scratch run; attention-only models (llama, qwen2, qwen3,
phi3, granite, olmo2) keep none."""

from __future__ import annotations

import pytest

import kvtool
from kvtool.common.checkpoints import CheckpointParams
from kvtool.common.scheduler import Scheduler, SchedulerParams
from kvtool.common.task import Request
from tests.kvtool.common.test_scheduler import GREEDY, MODELS, reference, run

KINDS = ["tiny-gemma2", "tiny-gemma3", "tiny-mamba2", "tiny-granitehybrid"]
WINDOWED = ("tiny-gemma2", "tiny-gemma3")
STEP = 64  # mid-prompt checkpoints every 64 tokens
N = 6
LONG = [(i * 7) % 200 + 3 for i in range(300)]  # token ids every tiny vocabulary has


def make(model: kvtool.Model, cps: CheckpointParams, n_slots: int = 1) -> Scheduler:
    # ubatches of 8: the window cache (8 + 8 cells) really forgets old positions
    params = kvtool.ContextParams(n_ctx=512 * n_slots, n_seq_max=n_slots, n_ubatch=8)
    return Scheduler(kvtool.Context(model, params), SchedulerParams(n_slots, checkpoints=cps))


def ask(sched: Scheduler, model: kvtool.Model, tokens: list[int]) -> tuple[int, str, list[int]]:
    (t,) = run(sched, Request(tokens, N, GREEDY, ignore_eos=True))
    assert t.generated == reference(model, tokens, N)
    assert t.timings.prompt_n == len(tokens) - t.timings.cache_n
    return t.timings.cache_n, t.timings.cache_source, t.generated


@pytest.mark.parametrize("name", KINDS)
def test_a_conversation_resumes_from_the_nearest_checkpoint(name: str) -> None:
    model = kvtool.Model(MODELS / f"{name}.gguf")
    sched = make(model, CheckpointParams(n_max=8, min_step=STEP))
    p1 = [1, *LONG]  # 301 tokens: longer than the window cache's 256 cells
    n, src, a1 = ask(sched, model, p1)
    assert (n, src) == (0, "")
    cps = sched.slots[0].checkpoints
    assert [c.n_tokens for c in cps.items] == [64, 128, 192, 256, 297]  # every STEP, 4 before the end
    # continued: everything the slot holds is reused (it goes on from where its memory stands)
    p2 = [*p1, *a1, *range(210, 240)]
    n, src, _ = ask(sched, model, p2)
    held = len(p1) + N - 1  # the last answer token was never decoded
    assert (n, src) == (held, "slot")
    assert [c.n_tokens for c in cps.items][-2:] == [320, len(p2) - 4]
    # regenerated: the end-of-prompt checkpoint (a window still holds what its last token needs)
    n, src, _ = ask(sched, model, p2)
    assert (n, src) == ((len(p2) - 1, "slot") if name in WINDOWED else (len(p2) - 4, "checkpoint"))
    # the last turn edited from its 6th token: the end of the first prompt is the nearest
    # checkpoint (the window cache still holds the positions before the edit)
    edited = [*p2[: held + 6], *range(240, 260)]
    n, src, _ = ask(sched, model, edited)
    assert (n, src) == ((held + 6, "slot") if name in WINDOWED else (297, "checkpoint"))
    assert max(c.n_tokens for c in cps.items) == len(edited) - 4
    # an early turn edited: the window has forgotten it too
    early = [*p1[:70], *range(200, 220)]
    n, src, _ = ask(sched, model, early)
    assert (n, src) == (64, "checkpoint")
    assert sched.stats.reprocessed["checkpoint_too_far_back"] >= 1
    assert [c.n_tokens for c in cps.items] == [64, len(early) - 4]


@pytest.mark.parametrize("name", KINDS)
def test_the_count_is_bounded_and_none_means_none(name: str) -> None:
    model = kvtool.Model(MODELS / f"{name}.gguf")
    prompt = [1, *LONG]
    sched = make(model, CheckpointParams(n_max=2, min_step=STEP))
    run(sched, Request(prompt, 2, GREEDY))
    assert [c.n_tokens for c in sched.slots[0].checkpoints.items] == [256, 297]  # the latest two
    sched = make(model, CheckpointParams(n_max=0))
    run(sched, Request(prompt, 2, GREEDY))
    (t,) = run(sched, Request([*prompt[:30], 7, 8], 2, GREEDY))
    assert t.timings.cache_n == 0 and t.timings.cache_reprocessed == "cannot_truncate"
    assert sched.slots[0].checkpoints.items == []


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3", "granite", "olmo2"])
def test_an_attention_only_memory_keeps_none(name: str) -> None:
    model = kvtool.Model(MODELS / f"tiny-{name}.gguf")
    sched = make(model, CheckpointParams(n_max=8, min_step=8))
    prompt = [1, *range(10, 60)]
    run(sched, Request(prompt, 2, GREEDY))
    (t,) = run(sched, Request(prompt, 2, GREEDY))
    assert sched.slots[0].checkpoints.items == []
    assert (t.timings.cache_n, t.timings.cache_source) == (len(prompt) - 1, "slot")
