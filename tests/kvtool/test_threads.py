"""-t and -tb: decode steps and prompts compute with their own thread counts (llama.cpp's
n_threads and n_threads_batch)."""

from __future__ import annotations

import pytest

import kvtool
from kvtool import threads
from kvtool.backend.linear import QUANT_MAX_ROWS
from kvtool.kernels import cpu_lib


def test_prompts_use_the_batch_threads_and_decode_steps_the_others(
    tiny_llama: kvtool.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(threads, "_n_threads", threads.compute_threads())
    monkeypatch.setattr(threads, "_n_threads_batch", None)
    seen: list[tuple[int, int]] = []  # (the pool's threads, torch's) while a forward runs
    forward = tiny_llama.impl.forward
    pool: list[int] = []
    monkeypatch.setattr(cpu_lib, "set_threads", pool.append)

    def spy(ub, mctx):  # type: ignore[no-untyped-def]
        seen.append((pool[-1] if tiny_llama._native else -1, torch.get_num_threads()))
        return forward(ub, mctx)

    monkeypatch.setattr(tiny_llama.impl, "forward", spy)
    n = threads.compute_threads()
    assert kvtool.set_n_threads(None, n_batch=n + 2) == n  # -tb alone leaves -t as it is
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, n_ubatch=64))
    prompt = list(range(3, 3 + QUANT_MAX_ROWS + 8))
    ctx.decode(kvtool.Batch.from_tokens(prompt, seq_id=0, pos0=0, logits="last"))
    ctx.decode(kvtool.Batch.from_tokens([5], seq_id=0, pos0=len(prompt), logits="last"))
    torch.set_num_threads(n)
    if tiny_llama._native:
        assert seen == [(n + 2, n + 2), (n, 1)]
    else:  # torch computes everything: its threads follow the ubatch's kind
        assert [t for _, t in seen] == [n + 2, n]
