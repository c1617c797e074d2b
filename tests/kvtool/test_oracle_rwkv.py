"""RWKV-6 and RWKV-7 against llama.cpp: every tiny scenario in both KV modes (tests/data/tiny,
copied from the oracle; the plain files, since no attention is involved), logits within 1e-3
relative and seq_pos_min/max after every step, replayed as for the attention models; and the
rollback snapshots the RWKV layers hand to the recurrent memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtool
from kvtool.batch import BatchAllocator
from kvtool.memory.base import Memory
from kvtool.memory.spec import MemoryParams
from tests.kvtool.test_oracle_tiny import DATA, rel_err
from tests.kvtool.test_oracle_tiny import tiny_model as load

ARCHS = ["rwkv6", "rwkv7"]


@pytest.mark.parametrize("n_ubatch", [1, 5, 24])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_split_into_ubatches(arch: str, n_ubatch: int) -> None:
    """The `single` prompt cut into ubatches of n_ubatch tokens: the states carried from one
    ubatch to the next (token shifts and WKV) give llama.cpp's one-ubatch logits."""
    z = np.load(DATA / arch / "single_kvu1.npz")
    n = int(z["step_offsets"][1])
    ctx = kvtool.Context(
        load(arch), kvtool.ContextParams(n_ctx=256, n_batch=256, n_ubatch=n_ubatch, n_seq_max=1)
    )
    ctx.decode(kvtool.Batch.from_tokens([int(t) for t in z["tokens"][:n]], seq_id=0, pos0=0, logits="all"))
    assert rel_err(ctx.logits().numpy(), z["logits"][:n]) <= 1e-3


def decode_rows(model: kvtool.Model, memory: Memory, toks: list[int], pos0: int) -> torch.Tensor:
    """Decodes `toks` on sequence 0 from pos0 (every row an output), as Context.decode does."""
    alloc = BatchAllocator(
        kvtool.Batch.from_tokens(toks, seq_id=0, pos0=pos0, logits="all"), model.n_vocab, 1, memory
    )
    mctx = memory.init_batch(alloc, 512)
    rows = []
    while True:
        mctx.apply()
        rows.append(model.forward(mctx.ubatch, mctx))
        if not mctx.next():
            return torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_equals_fresh_decode(arch: str) -> None:
    """With n_rs_seq=3 the memory asks for the states after each of the last tokens; taking
    back 3 tokens and decoding others gives the logits of a fresh decode of the same tokens."""
    model = load(arch)
    spec = model.memory_spec()
    toks = [int(t) for t in np.random.default_rng(7).integers(3, model.n_vocab, 23)]
    keep, redo = toks[:17], toks[20:]
    mem = spec.build(MemoryParams(n_ctx_seq=256, n_seq_max=1, n_ubatch=512, n_rs_seq=3))
    decode_rows(model, mem, toks[:20], 0)
    assert mem.seq_rm(0, 17, -1)
    assert mem.seq_pos_max(0) == 16
    got = decode_rows(model, mem, redo, 17)
    fresh = spec.build(MemoryParams(n_ctx_seq=256, n_seq_max=1, n_ubatch=512))
    want = decode_rows(model, fresh, keep + redo, 0)[17:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
