"""Decoding more tokens than one llama_decode takes, and resuming a sequence: the loops every
application of the engine needs (llama.cpp's tools each carry their own copy of them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtool.batch import Batch
from kvtool.checks import POS_END, as_int
from kvtool.context import Context
from kvtool.errors import KvtoolError
from kvtool.memory.base import SeqAdd, SeqRm


class ContextFullError(KvtoolError):
    """The tokens do not fit in the context."""


def decode_batch(ctx: Context, batch: Batch) -> None:
    """Decodes a batch of any size in consecutive views of at most n_batch tokens (a
    llama_decode each). Only the last view's logits can be read afterwards."""
    for i in range(0, len(batch), ctx.n_batch):
        j = i + ctx.n_batch
        ctx.decode(Batch(batch.tokens[i:j], batch.pos[i:j], batch.seq_ids[i:j], batch.logits[i:j]))


def decode_tokens(ctx: Context, tokens: Sequence[int], seq: int, pos0: int) -> torch.Tensor:
    """Decodes `tokens` on sequence `seq` at positions pos0.. and returns the last token's
    logits. Raises ContextFullError, before decoding anything, when they do not fit."""
    _check_fits(ctx, tokens, pos0)
    decode_batch(ctx, Batch.from_tokens(tokens, seq_id=seq, pos0=pos0, logits="last"))
    return ctx.logits_ith(-1)


def _check_fits(ctx: Context, tokens: Sequence[int], pos0: int) -> None:
    if not tokens:
        raise ValueError("nothing to decode")
    if pos0 + len(tokens) > ctx.n_ctx_seq:
        raise ContextFullError(
            f"the prompt needs {pos0 + len(tokens)} positions but the context holds {ctx.n_ctx_seq} "
            f"per sequence (raise -c/--ctx-size)"
        )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def resume_seq(
    ctx: Context, seq: int, tokens: Sequence[int], held: Sequence[int] = ()
) -> tuple[int, torch.Tensor]:
    """Makes sequence `seq` hold `tokens` at positions 0.. and returns (positions kept, the
    logits after the last token), decoding as little as it can (llama-server's prompt cache).

    `held` are the token ids the caller last put at positions 0.. of `seq`. Their longest
    common prefix with `tokens` is kept when the memory still holds it, and holds what a token
    after it attends to (a sliding window may have forgotten that: then everything is decoded
    again); at least the last token is decoded again, for its logits. Every other position of
    `seq` is removed first, whatever the memory holds (after a failed decode it may hold more
    than `held`). Raises ContextFullError, with the memory unchanged, when `tokens` do not fit;
    after any other error `seq` holds the kept prefix of what it held."""
    _check_fits(ctx, tokens, 0)
    n_held = ctx.memory.seq_pos_max(seq) + 1
    keep = min(_common_prefix(held, tokens), len(tokens) - 1, n_held)
    if not ctx.can_resume(seq, keep):
        keep = 0
    ctx.memory.seq_rm(seq, keep, -1)
    try:
        logits = decode_tokens(ctx, tokens[keep:], seq, keep)
    except BaseException:  # earlier n_batch views may have gone in: back to the kept prefix
        ctx.memory.seq_rm(seq, keep, -1)
        raise
    return keep, logits


def context_shift(ctx: Context, seq: int, n_keep: int, n_discard: int) -> None:
    """llama.cpp's context shift: removes positions [n_keep, n_keep + n_discard) of `seq` and
    moves every later position down by n_discard (the memory re-rotates their K at its next
    update, before the next decode). Raises KvtoolError, changing nothing, when the memory
    cannot move positions (a recurrent state, a window cache smaller than the context) or the
    arguments are out of range."""
    if not ctx.memory.can_shift():
        raise KvtoolError("this model's memory cannot shift positions (no context shift)")
    if not 0 <= as_int(n_keep, "n_keep") < POS_END or not 1 <= as_int(n_discard, "n_discard") < POS_END:
        raise KvtoolError(
            f"a context shift needs 0 <= n_keep and 1 <= n_discard, below {POS_END}: "
            f"got {n_keep}, {n_discard}"
        )
    n_past = ctx.memory.seq_pos_max(seq) + 1
    # both planned before either is applied: a refused move leaves the discarded tokens in place
    rm = ctx.memory.plan(SeqRm(seq, n_keep, n_keep + n_discard))
    add = ctx.memory.plan(SeqAdd(seq, n_keep + n_discard, n_past, -n_discard))
    rm()
    add()
