"""The sampler at its limits (issue 14, defect 6): filters that would remove every candidate keep
the best one, as llama.cpp's do; NaN or infinite logits and meaningless parameters are one-line
KvtoolErrors, never an IndexError from deep inside the chain."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool import KvtoolError, Sampler, SamplerParams

ROW = torch.tensor([0.5, 3.0, -1.0, 2.9, 0.0])


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(seed=1, min_p=2.0),  # p_i >= 2 * p_max holds for no token
        SamplerParams(seed=1, min_p=1.0, top_k=0, top_p=1.0),
        SamplerParams(seed=1, min_p=5.0, top_k=0, top_p=1.0, temp=0.0),
        SamplerParams(seed=1, top_p=0.0, min_p=0.0),
        SamplerParams(seed=1, top_p=0.0, min_p=2.0, typical_p=0.0, top_k=1),
    ],
)
def test_a_filter_that_removes_everything_keeps_the_best_token(params: SamplerParams) -> None:
    s = Sampler(params)
    assert [s.sample(ROW) for _ in range(5)] == [1] * 5  # token 1 has the highest logit


def test_min_keep_still_widens_what_min_p_keeps() -> None:
    s = Sampler(SamplerParams(seed=1, min_p=2.0, min_keep=2, top_k=0, top_p=1.0, temp=100.0))
    assert {s.sample(ROW) for _ in range(200)} == {1, 3}  # the two best, nothing else


@pytest.mark.parametrize(
    ("row", "msg"),
    [
        (torch.tensor([0.5, math.nan, 1.0]), "NaN logits"),
        (torch.full((4,), math.nan), "NaN logits"),
        (torch.tensor([0.5, math.inf, 1.0]), "infinite logits"),
        (torch.full((3,), -math.inf), "every token is banned"),
    ],
)
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_broken_logits_are_one_line_errors(row: torch.Tensor, msg: str, temp: float) -> None:
    with pytest.raises(KvtoolError, match=msg):
        Sampler(SamplerParams(seed=1, temp=temp)).sample(row)


def test_banned_tokens_are_not_broken_logits() -> None:
    row = torch.tensor([-math.inf, 1.0, -math.inf, 0.5])
    assert Sampler(SamplerParams(seed=1, temp=0.0)).sample(row) == 1
    s = Sampler(SamplerParams(seed=1, temp=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert {s.sample(row) for _ in range(100)} == {1, 3}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temp", math.nan),
        ("top_p", math.nan),
        ("min_p", math.inf),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("presence_penalty", math.nan),
        ("repeat_last_n", -2),
        ("min_keep", -1),
    ],
)
def test_meaningless_parameters_are_refused(field: str, value: float) -> None:
    with pytest.raises(KvtoolError, match=field):
        Sampler(SamplerParams(**{field: value}))
