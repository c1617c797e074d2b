"""Sampler stages against hand computations (llama.cpp semantics) and the chain's statistics."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.sampler_stages import (
    Candidates,
    apply_penalties,
    greedy,
    min_p,
    top_k,
    top_p,
    typical,
)
from kvtool.sampling import Sampler, SamplerParams

PROBS = [0.05, 0.2, 0.5, 0.1, 0.15]  # ids 0..4; sorted by prob: 2, 1, 4, 3, 0
OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}


def _row(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def _cands(probs: list[float]) -> Candidates:
    return Candidates.from_logits(_row(probs))


def _ids(c: Candidates) -> list[int]:
    return c.ids.tolist()


# ---- stages -------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_highest_sorted() -> None:
    assert _ids(top_k(_cands(PROBS), 3)) == [2, 1, 4]
    assert _ids(top_k(_cands(PROBS), 1)) == [2]
    assert _ids(top_k(_cands(PROBS), 99)) == [2, 1, 4, 3, 0]
    assert _ids(top_k(_cands(PROBS), 0)) == [0, 1, 2, 3, 4]  # off
    assert _ids(top_k(_cands(PROBS), -1)) == [0, 1, 2, 3, 4]


def test_top_k_ties_prefer_lower_ids() -> None:
    c = Candidates.from_logits(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0]))
    assert _ids(top_k(c, 3)) == [1, 3, 2]
    assert _ids(top_k(c, 4)) == [1, 3, 2, 4]


def _top_p_reference(probs: np.ndarray, p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    total = 0.0
    for n, i in enumerate(order, start=1):
        total += probs[i]
        if total >= p:
            return set(order[:n])
    return set(order)


def test_top_p_hand_values() -> None:
    assert _ids(top_p(_cands(PROBS), 0.6)) == [2, 1]  # 0.5 < 0.6 <= 0.7
    assert _ids(top_p(_cands(PROBS), 0.75)) == [2, 1, 4]  # 0.7 < 0.75 <= 0.85
    assert _ids(top_p(_cands(PROBS), 0.01)) == [2]  # never fewer than one
    assert _ids(top_p(_cands(PROBS), 0.6, min_keep=3)) == [2, 1, 4]
    assert _ids(top_p(_cands(PROBS), 1.0)) == [0, 1, 2, 3, 4]  # off


@pytest.mark.parametrize("seed", range(5))
def test_top_p_matches_reference_on_random_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=50).astype(np.float32) * 2
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    for p in (0.1, 0.5, 0.9, 0.99):
        got = set(_ids(top_p(Candidates.from_logits(torch.from_numpy(logits)), p)))
        assert got == _top_p_reference(probs, p)


@pytest.mark.parametrize("scale", [0.0, 0.5, 4.0])
def test_top_p_large_rows_head_and_full_sort(scale: float) -> None:
    # scale 0: a flat row, where the 256-token head cannot hold the nucleus (full-sort path).
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=5000) * scale).astype(np.float32)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    for p in (0.051, 0.503, 0.951):  # off the flat row's 1/5000 grid
        kept = top_p(Candidates.from_logits(torch.from_numpy(logits)), p)
        assert set(_ids(kept)) == _top_p_reference(probs, p)
        assert kept.sorted


def test_min_p_threshold_relative_to_max() -> None:
    # p_max = 0.5: 0.25 -> threshold 0.125 keeps {0.5, 0.2, 0.15}; 0.35 -> 0.175 keeps {0.5, 0.2}
    assert _ids(min_p(_cands(PROBS), 0.25)) == [1, 2, 4]  # unsorted input keeps id order
    assert _ids(min_p(_cands(PROBS), 0.35)) == [1, 2]
    assert _ids(min_p(_cands(PROBS), 0.9)) == [2]
    assert _ids(min_p(_cands(PROBS), 0.9, min_keep=2)) == [2, 1]
    assert _ids(min_p(top_k(_cands(PROBS), 4), 0.25)) == [2, 1, 4]  # sorted input stays sorted
    assert _ids(min_p(_cands(PROBS), 0.0)) == [0, 1, 2, 3, 4]  # off


def _typical_reference(probs: list[float], p: float) -> set[int]:
    entropy = -sum(q * math.log(q) for q in probs)
    order = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - entropy))
    total = 0.0
    for n, i in enumerate(order, start=1):
        total += probs[i]
        if total > p:
            return set(order[:n])
    return set(order)


def test_typical_can_drop_the_most_likely_token() -> None:
    # H = 1.089 nats; surprise 0.916 (p=0.4) is farther from H than 1.204 (p=0.3).
    probs = [0.4, 0.3, 0.3]
    kept = typical(_cands(probs), 0.5)
    assert set(_ids(kept)) == {1, 2} == _typical_reference(probs, 0.5)
    assert greedy(kept) == 1
    assert _ids(typical(_cands(probs), 1.0)) == [0, 1, 2]  # off


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8, 0.95])
def test_typical_matches_reference(p: float) -> None:
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(30)).tolist()
    kept = typical(_cands(probs), p)
    assert set(_ids(kept)) == _typical_reference(probs, p)
    assert kept.sorted and (kept.logits[:-1] >= kept.logits[1:]).all()


def test_penalties_by_hand() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    out = apply_penalties(logits, {0: 2, 1: 1, 4: 1}, repeat=2.0, frequency=0.1, presence=0.5)
    expected = [2.0 / 2 - 0.2 - 0.5, -1.0 * 2 - 0.1 - 0.5, 0.5, 3.0, 0.0 - 0.1 - 0.5]
    assert out.tolist() == pytest.approx(expected)
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # input untouched
    assert apply_penalties(logits, {0: 1}, 1.0, 0.0, 0.0) is logits  # neutral
    assert apply_penalties(logits, {99: 1}, 2.0, 0.0, 0.0).tolist() == logits.tolist()  # out of vocab


# ---- the chain ----------------------------------------------------------------------------


def _greedy_sampler(**kw: float) -> Sampler:
    return Sampler(SamplerParams(temp=0.0, seed=1, **{**OFF, **kw}))


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    s = _greedy_sampler()
    assert s.sample(torch.tensor([0.1, 5.0, -2.0, 4.9])) == 1
    assert s.sample(torch.tensor([1.0, 7.0, 7.0, 7.0])) == 1
    assert Sampler(SamplerParams(temp=-1.0)).sample(torch.tensor([0.0, 0.0, 3.0])) == 2
    # Default truncation stages run before the argmax and never remove it (typical off).
    assert Sampler(SamplerParams(temp=0.0)).sample(torch.tensor([3.0, 1.0, 2.0])) == 0


def test_repeat_penalty_window() -> None:
    row = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.8, 1.0, 1.5])
    # Penalized (/1.5): 5 -> 1.33, 6 -> 1.2, 7 -> 0.67; 8 (1.5) wins once 5 is in the window.
    for last_n, expected in [(2, 5), (3, 8), (0, 5), (-1, 8)]:
        s = _greedy_sampler(repeat_penalty=1.5, repeat_last_n=last_n)
        for t in (5, 6, 7):
            s.accept(t)
        assert s.sample(row) == expected, last_n
    s = _greedy_sampler(repeat_penalty=1.5, repeat_last_n=3)
    for t in (5, 6, 7, 1, 2, 3):
        s.accept(t)
    assert s.sample(row) == 5  # 5, 6 and 7 have left the window
    s.accept(5)  # window is now 2, 3, 5
    assert s.sample(row) == 6
    s.reset()
    assert s.sample(row) == 5


def test_frequency_and_presence_penalties() -> None:
    row = torch.tensor([1.0, 0.9, 0.0])
    s = _greedy_sampler(presence_penalty=0.2)
    s.accept(0)
    assert s.sample(row) == 1
    s = _greedy_sampler(frequency_penalty=0.06)
    s.accept(0)
    assert s.sample(row) == 0  # 1.0 - 0.06 > 0.9
    s.accept(0)
    assert s.sample(row) == 1  # 1.0 - 0.12 < 0.9


def test_sample_does_not_accept_or_modify_input() -> None:
    s = _greedy_sampler(repeat_penalty=10.0)
    row = torch.tensor([1.0, 2.0])
    assert [s.sample(row) for _ in range(3)] == [1, 1, 1]
    s.accept(1)
    assert s.sample(row) == 0
    assert row.tolist() == [1.0, 2.0]


def _draws(s: Sampler, row: torch.Tensor, n: int) -> list[int]:
    return [s.sample(row) for _ in range(n)]


def test_same_seed_same_draws_and_reset_replays() -> None:
    row = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplerParams(seed=1234, temp=1.0, **OFF)
    a, b = Sampler(params), Sampler(params)
    first = _draws(a, row, 50)
    assert first == _draws(b, row, 50)
    a.reset()
    assert _draws(a, row, 50) == first
    assert _draws(Sampler(SamplerParams(seed=1235, temp=1.0, **OFF)), row, 50) != first


@pytest.mark.parametrize("seed", [-1, 0xFFFFFFFF])
def test_random_seed_is_exposed_and_reproduces(seed: int) -> None:
    row = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    s = Sampler(SamplerParams(seed=seed, temp=1.0, **OFF))
    assert 0 <= s.seed < 0xFFFFFFFF
    again = Sampler(SamplerParams(seed=s.seed, temp=1.0, **OFF))
    assert _draws(s, row, 30) == _draws(again, row, 30)
    assert Sampler(SamplerParams(seed=7)).seed == 7
    assert Sampler(SamplerParams(seed=-2)).seed == 0xFFFFFFFE  # uint32, as llama.cpp


def _frequencies(params: SamplerParams, row: torch.Tensor, n: int) -> np.ndarray:
    s = Sampler(params)
    return np.bincount(_draws(s, row, n), minlength=row.numel()) / n


def _assert_close(freq: np.ndarray, probs: np.ndarray, n: int) -> None:
    sigma = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-12), (freq, probs)


def test_distribution_matches_softmax() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5])
    n = 20000
    for temp in (1.0, 0.5, 2.0):
        probs = torch.softmax(row.double() / temp, 0).numpy()
        _assert_close(_frequencies(SamplerParams(seed=42, temp=temp, **OFF), row, n), probs, n)


def test_truncation_happens_before_temperature() -> None:
    # top_p = 0.6 on untempered probs keeps ids 2 and 1 (0.5 + 0.2); a high temperature then
    # flattens the pair but cannot bring back the others.
    params = SamplerParams(seed=3, temp=10.0, **{**OFF, "top_p": 0.6})
    freq = _frequencies(params, _row(PROBS), 4000)
    assert set(np.nonzero(freq)[0].tolist()) == {1, 2}
    pair = torch.softmax(_row(PROBS)[[2, 1]].double() / 10.0, 0).numpy()
    _assert_close(freq[[2, 1]], pair, 4000)


def test_top_k_distribution_renormalizes() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5])
    freq = _frequencies(SamplerParams(seed=5, temp=1.0, **{**OFF, "top_k": 3}), row, 20000)
    probs = np.zeros(8)
    probs[[4, 7, 0]] = torch.softmax(row[[4, 7, 0]].double(), 0).numpy()
    _assert_close(freq, probs, 20000)


def test_large_vocab_default_chain() -> None:
    row = torch.randn(262144, generator=torch.Generator().manual_seed(1)) * 3
    s = Sampler(SamplerParams(seed=9, repeat_penalty=1.1, top_k=0))
    for t in range(100):
        s.accept(t)
    tokens = _draws(s, row, 5)
    assert all(0 <= t < 262144 for t in tokens)
    assert Sampler(SamplerParams(temp=0.0)).sample(row) == int(torch.argmax(row))


def test_state_round_trip_continues_the_same_draws() -> None:
    """get_state/set_state: a fresh sampler given another's state draws what it would have."""
    row = torch.linspace(-2.0, 2.0, 50)
    params = SamplerParams(seed=7, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3)
    a = Sampler(params)
    for _ in range(5):
        a.accept(a.sample(row))
    b = Sampler(SamplerParams(seed=99, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3))
    b.set_state(*a.get_state())
    assert b.seed == a.seed
    for _ in range(10):
        ta, tb = a.sample(row), b.sample(row)
        assert ta == tb
        a.accept(ta)
        b.accept(tb)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_skips_filters_that_cannot_change_its_pick(seed: int) -> None:
    # The sampler's greedy path (no top-k/top-p/min-p passes) against the whole chain run by
    # hand, on rows with many ties at the top and with penalties.
    g = torch.Generator().manual_seed(seed)
    for _ in range(25):
        row = torch.randint(-3, 4, (300,), generator=g).float() / 2  # coarse values: ties
        k = int(torch.randint(0, 50, (1,), generator=g))
        params = SamplerParams(temp=0.0, top_k=k, top_p=0.5, min_p=0.3, min_keep=2, repeat_penalty=1.5)
        s = Sampler(params)
        accepted = torch.randint(0, 300, (5,), generator=g).tolist()
        for t in accepted:
            s.accept(t)
        pen = apply_penalties(row, Counter(accepted), params.repeat_penalty, 0.0, 0.0)
        c = Candidates.from_logits(pen)
        c = min_p(top_p(top_k(c, params.top_k), params.top_p, 2), params.min_p, 2)
        assert s.sample(row) == greedy(c)


def test_samplers_order_is_llama_cpps_chain_order() -> None:
    """--samplers: each stage runs where the list puts it (llama.cpp's common_sampler_init)."""
    row = torch.tensor([3.0, 2.9, 0.0])

    def pick(order: tuple[str, ...], **kw: float) -> int:
        s = Sampler(SamplerParams(temp=0.0, repeat_penalty=2.0, samplers=order, **{**OFF, **kw}))
        s.accept(0)  # token 0 seen once: the penalty halves its logit to 1.5
        return s.sample(row)

    assert pick(("penalties", "temperature")) == 1  # penalized, then greedy
    assert pick(("temperature", "penalties")) == 0  # greedy first: the penalty comes too late
    assert pick(("top_k", "penalties", "temperature"), top_k=1) == 0  # only token 0 survives top-k
    assert pick(("penalties", "top_k", "temperature"), top_k=1) == 1
    assert pick(("penalties", "temperature"), top_k=1) == 1  # a stage left out does nothing


def test_samplers_without_temperature_draw_at_temperature_one() -> None:
    """As in llama.cpp, --temp acts only through the temperature stage: without it, the chain
    draws from the logits as they are."""
    row = torch.tensor([0.0, 0.0])
    s = Sampler(SamplerParams(seed=3, temp=0.0, samplers=("top_k",), **OFF))
    assert {s.sample(row) for _ in range(50)} == {0, 1}


def test_sampler_names_read_as_llama_cpp_reads_them() -> None:
    from kvtool.sampling import sampler_order

    assert sampler_order(["top-k", "TEMP", "nucleus", "typ", "minp", "dry"]) == (
        "top_k", "temperature", "top_p", "typ_p", "min_p", "dry"
    )  # fmt: skip
    with pytest.raises(KvtoolError, match="unknown sampler 'mirostat'"):
        Sampler(SamplerParams(samplers=("top_k", "mirostat")))
