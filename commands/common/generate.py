"""The token generation loop shared by the verbs, its timings, and text streaming."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kvtool

if TYPE_CHECKING:
    import torch


@dataclass
class Timings:
    """Tokens and seconds of prompt processing and of generation, summed over turns."""

    n_prompt: int = 0
    t_prompt: float = 0.0
    n_gen: int = 0
    t_gen: float = 0.0

    def line(self) -> str:
        pp = self.n_prompt / self.t_prompt if self.t_prompt > 0 else 0.0
        tg = self.n_gen / self.t_gen if self.t_gen > 0 else 0.0
        return (
            f"prompt: {self.n_prompt} tokens in {self.t_prompt:.2f} s ({pp:.1f} t/s) | "
            f"generation: {self.n_gen} tokens in {self.t_gen:.2f} s ({tg:.1f} t/s)"
        )


@dataclass
class Generation:
    """The tokens a generation produced and why it stopped. `error`: what ended it otherwise
    (output that could not be written, a failed decode): the caller records what was generated,
    then raises it."""

    tokens: list[int]
    stop: str  # "eog" | "length" | "ctx_full" | "interrupted" | "error"
    shifts: list[tuple[int, int]] = field(default_factory=list)  # (n_keep, n_discard), in order
    error: BaseException | None = None


def shift_context(ctx: kvtool.Context, seq: int, n_past: int, n_keep: int) -> int:
    """The context shift of llama.cpp's tools: keep `n_keep` positions, discard half of the rest
    (kvtool.context_shift). Returns the positions discarded (0: nothing left to discard)."""
    n_discard = (n_past - n_keep) // 2
    if n_discard < 1:
        return 0
    kvtool.context_shift(ctx, seq, n_keep, n_discard)
    return n_discard


class TextStream:
    """Token pieces to text, holding back incomplete UTF-8 sequences."""

    def __init__(self, model: kvtool.Model) -> None:
        self.model = model
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self.model.token_to_piece(token, special=False))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def generate(
    ctx: kvtool.Context,
    sampler: kvtool.Sampler,
    logits: torch.Tensor,
    pos: int,
    n_predict: int,
    on_token: Callable[[int], None] | None = None,
    seq: int = 0,
    timings: Timings | None = None,
    ignore_eos: bool = False,
    n_keep: int | None = None,
) -> Generation:
    """Samples until end of generation, n_predict tokens (-1: no limit) or a full context.
    Every accepted token except an end-of-generation one is decoded into the memory.
    `ignore_eos` bans end-of-generation tokens (llama.cpp's --ignore-eos). With `n_keep`
    (llama.cpp's --context-shift), a full context is shifted (`shift_context`) instead of
    stopping the generation; the shifts are listed in the result. An interrupt (Ctrl-C,
    SIGTERM) stops it; any other exception too, returned in `error`, never lost with the
    tokens generated before it."""
    import torch  # here, not at import: `kvtool --help` must not load torch

    model = ctx.model
    banned = torch.tensor(sorted(model.vocab.eog_ids), dtype=torch.long) if ignore_eos else None
    out: list[int] = []
    shifts: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    stop = "length"
    error: BaseException | None = None
    try:
        while n_predict < 0 or len(out) < n_predict:
            if banned is not None:
                logits = logits.index_fill(0, banned, float("-inf"))
            tok = sampler.sample(logits)
            sampler.accept(tok)
            if model.is_eog(tok):
                stop = "eog"
                break
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if n_predict >= 0 and len(out) >= n_predict:
                break
            if pos >= ctx.n_ctx_seq and n_keep is not None:
                n_discard = shift_context(ctx, seq, pos, n_keep)
                pos -= n_discard
                if n_discard:
                    shifts.append((n_keep, n_discard))
            if pos >= ctx.n_ctx_seq:
                stop = "ctx_full"
                break
            try:
                ctx.decode(kvtool.Batch.from_tokens([tok], seq_id=seq, pos0=pos, logits="last"))
            except kvtool.DecodeError as e:
                if e.status != 1:
                    raise
                stop = "ctx_full"
                break
            pos += 1
            logits = ctx.logits_ith(-1)
    except KeyboardInterrupt:
        stop = "interrupted"
    except BaseException as e:  # a closed stdout, a decode that failed: the caller raises it
        stop, error = "error", e
    if timings is not None:
        timings.n_gen += len(out)
        timings.t_gen += time.perf_counter() - t0
    return Generation(out, stop, shifts, error)
