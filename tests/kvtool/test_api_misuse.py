"""Every misuse of the engine API is a KvtoolError (a TypeError for an argument of the wrong
type) and changes nothing (issue 28, item 8): before, negative positions were decoded into the
cache (a state saved after would not load), seq_add moved positions past int32, the sampler
read a batch of rows as one row and answered a token id past the vocabulary, and ids out of
range or of the wrong type raised OverflowError, IndexError, ValueError or AttributeError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams, KvtoolError
from tests.helpers.memory_snapshot import snapshot

TINY = Path(__file__).parent.parent / "data" / "tiny" / "models"
BIG = 2**70


def _batch(tokens: list[Any], pos: list[Any], seqs: list[Any], logits: list[bool] | None = None) -> Batch:
    return Batch(list(tokens), list(pos), list(seqs), logits or [True] * len(tokens))


# (name, call on (ctx, model), the error it must raise)
CASES: list[tuple[str, Callable[[Context, kvtool.Model], object], type[Exception]]] = [
    ("decode at a negative position", lambda c, m: c.decode(Batch.from_tokens([1, 2], 1, -5)), KvtoolError),
    ("decode past int32", lambda c, m: c.decode(Batch.from_tokens([1, 2], 1, 2**31 - 2)), KvtoolError),
    ("decode at 2**40", lambda c, m: c.decode(_batch([1], [2**40], [(1,)])), KvtoolError),
    ("a token past int64", lambda c, m: c.decode(_batch([BIG], [0], [(1,)])), KvtoolError),
    ("a sequence past int64", lambda c, m: c.decode(_batch([1], [0], [(BIG,)])), KvtoolError),
    ("fields of other lengths", lambda c, m: c.decode(_batch([1, 2], [0], [(1,)])), KvtoolError),
    ("a float token", lambda c, m: c.decode(_batch([1.0], [0], [(1,)])), TypeError),
    ("a string position", lambda c, m: c.decode(_batch([1], ["0"], [(1,)])), TypeError),
    ("a list, not a batch", lambda c, m: c.decode([1, 2]), TypeError),  # type: ignore[arg-type]
    ("Batch.add of a string", lambda c, m: Batch().add("x", 0), TypeError),  # type: ignore[arg-type]
    ("Batch.add of a float", lambda c, m: Batch().add(1.5, 0), TypeError),  # type: ignore[arg-type]
    ("Batch.add of one seq id", lambda c, m: Batch().add(1, 0, 0), TypeError),  # type: ignore[arg-type]
    ("Batch.add of a string of ids", lambda c, m: Batch().add(1, 0, "01"), TypeError),
    ("seq_add past int32", lambda c, m: c.memory.seq_add(0, 0, -1, 2**40), KvtoolError),
    ("seq_add to the last position", lambda c, m: c.memory.seq_add(0, 0, -1, 2**31 - 3), KvtoolError),
    ("seq_div by 0", lambda c, m: c.memory.seq_div(0, 0, -1, 0), KvtoolError),
    ("seq_rm of a float", lambda c, m: c.memory.seq_rm(0, 0.5, -1), TypeError),  # type: ignore[arg-type]
    ("seq_rm of a string", lambda c, m: c.memory.seq_rm("0", 0, -1), TypeError),  # type: ignore[arg-type]
    ("seq_cp out of range", lambda c, m: c.memory.seq_cp(0, 99, 0, -1), KvtoolError),
    ("seq_keep out of range", lambda c, m: c.memory.seq_keep(99), KvtoolError),
    ("seq_pos_max out of range", lambda c, m: c.memory.seq_pos_max(99), KvtoolError),
    ("seq_pos_min of -1", lambda c, m: c.memory.seq_pos_min(-1), KvtoolError),
    ("logits_ith out of range", lambda c, m: c.logits_ith(99), KvtoolError),
    ("logits_ith from the end", lambda c, m: c.logits_ith(-99), KvtoolError),
    ("logits_ith past int64", lambda c, m: c.logits_ith(BIG), KvtoolError),
    ("logits_ith of a string", lambda c, m: c.logits_ith("0"), TypeError),  # type: ignore[arg-type]
    ("context_shift of -1 kept", lambda c, m: kvtool.context_shift(c, 0, -1, 1), KvtoolError),
    ("context_shift past int32", lambda c, m: kvtool.context_shift(c, 0, 1, 2**40), KvtoolError),
    ("detokenize past the vocabulary", lambda c, m: m.detokenize([m.n_vocab]), KvtoolError),
    ("token_to_piece of -1", lambda c, m: m.token_to_piece(-1), KvtoolError),
    ("detokenize past int64", lambda c, m: m.detokenize([BIG]), KvtoolError),
    ("tokenize None", lambda c, m: m.tokenize(None), TypeError),  # type: ignore[arg-type]
    ("tokenize half a surrogate pair", lambda c, m: m.tokenize("a\udcff"), KvtoolError),
    ("set_n_threads past 512", lambda c, m: kvtool.set_n_threads(100_000), KvtoolError),
    ("ContextParams of a float", lambda c, m: Context(m, ContextParams(n_seq_max=1.5)), TypeError),  # type: ignore[arg-type]
    ("state of a string", lambda c, m: c.state_set_data("x"), TypeError),  # type: ignore[arg-type]
]

SAMPLER: list[tuple[str, Callable[[kvtool.Sampler, int], object], type[Exception]]] = [
    ("two rows", lambda s, v: s.sample(torch.zeros(2, v)), KvtoolError),
    ("a scalar", lambda s, v: s.sample(torch.tensor(1.0)), KvtoolError),
    ("a list", lambda s, v: s.sample([0.0] * v), TypeError),  # type: ignore[arg-type]
    ("a numpy row", lambda s, v: s.sample(np.zeros(v)), TypeError),  # type: ignore[arg-type]
    ("int logits", lambda s, v: s.sample(torch.zeros(v, dtype=torch.long)), TypeError),
    ("accept of -1", lambda s, v: s.accept(-1), KvtoolError),
    ("accept of a string", lambda s, v: s.accept("a"), TypeError),  # type: ignore[arg-type]
]


@pytest.fixture(scope="module")
def models() -> dict[str, kvtool.Model]:
    return {a: kvtool.Model(TINY / f"tiny-{a}.gguf") for a in ("llama", "mamba", "granitehybrid")}


def _context(model: kvtool.Model) -> Context:
    ctx = Context(model, ContextParams(n_ctx=256, n_batch=64, n_ubatch=32, n_seq_max=2))
    ctx.decode(Batch.from_tokens([1, 2, 3], 0, 0))
    return ctx


@pytest.mark.parametrize("arch", ["llama", "mamba", "granitehybrid"])
@pytest.mark.parametrize(("name", "call", "error"), CASES, ids=[c[0] for c in CASES])
def test_a_misuse_is_the_api_s_error_and_changes_nothing(
    models: dict[str, kvtool.Model], arch: str, name: str, call: Callable[..., object], error: type[Exception]
) -> None:
    model = models[arch]
    if "context_shift" in name and arch != "llama":
        pytest.skip("only a KV cache shifts positions")
    ctx = _context(model)
    before = (snapshot(ctx.memory), ctx.logits().clone(), kvtool.set_n_threads())
    with pytest.raises(error) as e:
        call(ctx, model)
    assert type(e.value) is not Exception
    after = (snapshot(ctx.memory), ctx.logits(), kvtool.set_n_threads())
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2] == after[2]
    # and the context still works: its state saves and loads, it decodes on
    data = ctx.state_get_data()
    ctx.state_set_data(data)
    ctx.decode(Batch.from_tokens([4], 0, 3))


@pytest.mark.parametrize(("name", "call", "error"), SAMPLER, ids=[c[0] for c in SAMPLER])
def test_a_sampler_misuse_is_refused(name: str, call: Callable[..., object], error: type[Exception]) -> None:
    s = kvtool.Sampler(kvtool.SamplerParams(seed=1, temp=0.8, repeat_penalty=1.1))
    with pytest.raises(error):
        call(s, 32)
    assert 0 <= s.sample(torch.randn(32)) < 32  # still samples, within the row


@pytest.mark.parametrize(
    "params",
    [
        kvtool.SamplerParams(temp="hot"),  # type: ignore[arg-type]
        kvtool.SamplerParams(top_k=1.5),  # type: ignore[arg-type]
        kvtool.SamplerParams(repeat_last_n=2**70),
    ],
)
def test_sampler_params_of_the_wrong_kind_are_refused(params: kvtool.SamplerParams) -> None:
    with pytest.raises((TypeError, KvtoolError)):
        kvtool.Sampler(params)


def test_numpy_ints_are_ints(models: dict[str, kvtool.Model]) -> None:
    """What a caller computes with numpy is taken as it is: only floats, strings and bools are not."""
    ctx = _context(models["llama"])
    b = Batch()
    b.add(np.int64(4), np.int32(3), [np.int64(0)], True)
    ctx.decode(b)
    assert ctx.memory.seq_pos_max(np.int64(0)) == 3
    assert ctx.logits_ith(np.int64(0)).shape == (models["llama"].n_vocab,)
