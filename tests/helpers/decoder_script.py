"""A decode script for the compiled decoder call's tests: three sequences' prompts (one longer
than a compiled ubatch takes), steps of a token of every sequence in one batch, then two tokens
of one; and a count of which ubatches the call ran."""

from __future__ import annotations

from typing import Any

import torch

from kvtool import Batch, Context, ContextParams, Model
from kvtool.kernels.decoder_cpu import DecoderWeights


def decode_script(
    model: Model, kv_unified: bool, cache_type: str, steps: int = 4, type_v: str | None = None
) -> list[torch.Tensor]:
    """Every batch's logits: prompts of 20, 5 and 3 tokens (outputs the last two), `steps` steps of
    one token of each sequence, then two tokens of sequence 1 (only the second an output). K of
    `cache_type`, V of `type_v` (the same by default)."""
    p = ContextParams(
        n_ctx=256, n_seq_max=4, kv_unified=kv_unified, type_k=cache_type, type_v=type_v or cache_type
    )
    ctx = Context(model, p)
    out = []

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        b = Batch()
        for tok, pos, seq, want in rows:
            b.add(tok, pos, (seq,), want)
        ctx.decode(b)
        out.append(ctx.logits().clone())

    lens = [20, 5, 3]
    for s, n in enumerate(lens):
        decode([(7 + (s * 5 + i) % 200, i, s, i >= n - 2) for i in range(n)])
    for step in range(steps):
        decode([(30 + step * 3 + s, lens[s] + step, s, True) for s in range(3)])
    decode([(9, lens[1] + steps, 1, False), (10, lens[1] + steps + 1, 1, True)])
    return out


def expected_runs(n_layer: int, steps: int = 4) -> list[tuple[int, int]]:
    """(rows, layers run compiled) per decode of `decode_script`: the 20-row prompt has more rows
    of a stream than the call takes; the others ran it, every layer where every row is an
    output, all but the last where some are not."""
    return [(20, 0), (5, n_layer - 1), (3, n_layer - 1)] + [(3, n_layer)] * steps + [(2, n_layer - 1)]


def count_runs(dec: DecoderWeights) -> list[tuple[int, int]]:
    """Wraps `dec.run` to record (rows, layers run) per call; returns the list it fills."""
    ran: list[tuple[int, int]] = []
    run = dec.run

    def counted(x: torch.Tensor, il0: int, caches: list[Any], *args: Any) -> bool:
        done = run(x, il0, caches, *args)
        ran.append((x.shape[0], len(caches) if done else 0))
        return done

    dec.run = counted  # type: ignore[method-assign]
    return ran
