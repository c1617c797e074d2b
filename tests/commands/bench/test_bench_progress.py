"""A long prompt in `kvtool bench` reports its progress (issue 14, defect 4: `bench -p 100000`
ran for minutes without a word): one report per n_batch chunk, and the chunks decode exactly
what one decode_tokens call does."""

from __future__ import annotations

import random
from pathlib import Path

import kvtool
from kvtool.commands.bench.logic import first_token, run_prompt


def test_long_prompt_reports_each_chunk_and_decodes_the_same(tiny_llama_path: Path) -> None:
    model = kvtool.Model(tiny_llama_path)
    params = kvtool.ContextParams(n_ctx=512, n_batch=64, n_ubatch=64)
    seen: list[tuple[int, int]] = []
    ctx = kvtool.Context(model, params)
    run_prompt(ctx, 200, random.Random(7), lambda done, total: seen.append((done, total)))
    assert seen == [(64, 200), (128, 200), (192, 200), (200, 200)]
    assert ctx.memory.seq_pos_max(0) == 199

    rng = random.Random(7)  # the same tokens, in one call
    toks = [first_token(model, rng)] + [rng.randrange(model.n_vocab) for _ in range(199)]
    ref = kvtool.Context(model, params)
    want = kvtool.decode_tokens(ref, toks, 0, 0)
    assert ctx.logits_ith(-1).equal(want)
