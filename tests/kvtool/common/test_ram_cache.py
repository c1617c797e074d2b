"""The host-RAM prompt cache as the scheduler's prefix source: a prompt a slot dropped for
another conversation comes back from RAM (with its checkpoints, for memories that cannot be cut
back) and answers as a from-scratch run; the budget holds, least recently used out first."""

from __future__ import annotations

import pytest

import kvtool
from kvtool.common.checkpoints import CheckpointParams
from kvtool.common.ram_cache import Entry, RamCache
from kvtool.common.scheduler import Scheduler, SchedulerParams
from kvtool.common.task import Request
from tests.kvtool.common.test_scheduler import GREEDY, MODELS, reference, run

LONG = [1, *[(i * 7) % 200 + 3 for i in range(300)]]
OTHER = [2, *[(i * 5) % 190 + 7 for i in range(200)]]
N = 5


def make(model: kvtool.Model, ram: RamCache) -> Scheduler:
    params = kvtool.ContextParams(n_ctx=1024, n_ubatch=8)
    cps = CheckpointParams(n_max=8, min_step=64)
    return Scheduler(kvtool.Context(model, params), SchedulerParams(1, checkpoints=cps, sources=(ram,)))


def ask(sched: Scheduler, model: kvtool.Model, tokens: list[int]) -> tuple[int, str, list[int]]:
    (t,) = run(sched, Request(tokens, N, GREEDY, ignore_eos=True))
    assert t.generated == reference(model, tokens, N)
    return t.timings.cache_n, t.timings.cache_source, t.generated


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-mamba2", "tiny-granitehybrid"])
def test_a_dropped_conversation_comes_back_from_ram(name: str) -> None:
    model = kvtool.Model(MODELS / f"{name}.gguf")
    ram = RamCache(-1)
    sched = make(model, ram)
    _, _, a = ask(sched, model, LONG)
    assert ask(sched, model, OTHER)[:2] == (0, "")  # the slot drops LONG: RAM keeps it
    assert list(ram.entries) == [tuple(LONG + a[:-1])] and ram.stats.n_saved == 1
    follow = [*LONG, *a, 9, 10, 11]  # the conversation goes on
    n, src, _ = ask(sched, model, follow)
    assert (n, src) == (len(LONG) + N - 1, "ram") and ram.stats.n_hits == 1
    assert [k[: len(OTHER)] == tuple(OTHER) for k in ram.entries] == [True, False]  # OTHER went too
    # regenerated after another drop: all but the last token, or the end-of-prompt checkpoint
    ask(sched, model, OTHER)
    n, src, _ = ask(sched, model, LONG)
    assert src == "ram" and n == (len(LONG) - 1 if name == "tiny-llama" else len(LONG) - 4)


class Sink:
    def __init__(self) -> None:
        self.got: list[Entry] = []

    def __call__(self, e: Entry) -> None:
        self.got.append(e)


def test_the_budget_holds_and_evicted_entries_go_to_the_next_tier() -> None:
    sink = Sink()
    ram = RamCache(250, on_evict=sink)
    ram.put(Entry((1, 2, 3), b"a" * 100))
    ram.put(Entry((4, 5), b"b" * 100))
    assert ram.best([1, 2, 3, 9]) == (ram.entries[(1, 2, 3)], 3)
    ram.entries.move_to_end((1, 2, 3))  # used: (4, 5) is now the least recent
    ram.put(Entry((6,), b"c" * 100))
    assert list(ram.entries) == [(1, 2, 3), (6,)] and [e.tokens for e in sink.got] == [(4, 5)]
    assert ram.nbytes == 200 and ram.stats.n_evicted == 1
    ram.put(Entry((1, 2, 3, 4), b"d" * 50))  # extends (1, 2, 3): that one is dropped
    assert list(ram.entries) == [(6,), (1, 2, 3, 4)] and ram.nbytes == 150
    ram.put(Entry((7,), b"e" * 251))  # over the whole budget: straight to the next tier
    assert ram.stats.n_refused == 1 and sink.got[-1].tokens == (7,) and (7,) not in ram.entries
    assert ram.best([8, 8]) == (None, 0)
