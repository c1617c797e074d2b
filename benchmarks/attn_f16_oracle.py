"""What llama.cpp's attention arithmetic over an f16 cache would change: its graph without flash
attention multiplies K q^T and V P with ggml_mul_mat, whose F16 weights take the other operand
as halves (vec_dot_type F16), so Q and the softmax's probabilities are rounded to f16; kvtool's
prompt attention computes both in float32 from the f16 cache. This replays the oracle's
teacher-forced prompts with kvtool's prompt attention (`attention_ref`) replaced by that
arithmetic (torch's softmax in float32, then halves), scored against the F32 FA-off reference
(top-1 / sure / KL@32 / |d top-1|) and against llama.cpp's own F16 runs (top-1 agreement and
mean |d| at its top-1), beside kvtool as it is. A measurement, not an engine mode: the
compiled decode attention (16 rows or fewer) is left as it is.

    .venv/bin/python benchmarks/attn_f16_oracle.py LLAMA_TEACHER smollm2 gemma3-270m

LLAMA_TEACHER: benchmarks/llama_teacher.c built as its header says.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from kv_types_oracle import ORACLE, REAL, scores, teacher_logits
from weights_oracle import line, llama_logits

import kvtool
import kvtool.kernels.attention as attn
import kvtool.kernels.attention_ref as attn_ref
from kvtool.kernels.kq_mask import KQMask
from kvtool.kernels.kv_quant import KVType

ATTENTION_REF = attn_ref.attention_ref


Tensor = torch.Tensor


def attention_f16_mul_mat(  # attention_ref's parameters
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | KQMask, scale: float,
    tk: KVType | None = None, tv: KVType | None = None, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`attention_ref` with ggml_mul_mat's halves over an f16 K and V: q and the probabilities
    rounded to f16, products and sums in float32."""
    if softcap or k.dtype != torch.float16 or v.dtype != torch.float16 or (tk is not None and tk.quantized):
        return ATTENTION_REF(q, k, v, mask, scale, tk, tv, softcap)
    m = mask if isinstance(mask, KQMask) else KQMask(mask)
    g = q.shape[2] // k.shape[2]
    kk, vv = k.float().repeat_interleave(g, dim=2), v.float().repeat_interleave(g, dim=2)
    s = torch.einsum("sqhd,skhd->shqk", q.half().float(), kk) * scale + m._bias[:, None]
    p = torch.softmax(s, dim=-1).half().float()
    out = torch.einsum("shqk,skhd->sqhd", p, vv)
    return out if m.empty is None else out.masked_fill(m.empty.unsqueeze(-1), 0.0)


def agreement(got: np.ndarray, other: np.ndarray) -> str:
    """Top-1 agreement with `other` and mean |d| of the logit at its top-1."""
    t = other.argmax(axis=1)[:, None]
    d = np.abs(np.take_along_axis(got, t, 1) - np.take_along_axis(other, t, 1)).mean()
    return f"{np.mean(got.argmax(axis=1) == t[:, 0]):.4f} / {d:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama", type=Path, help="llama_teacher built from benchmarks/llama_teacher.c")
    ap.add_argument("models", nargs="+", choices=sorted(REAL))
    ap.add_argument("--oracle", type=Path, default=ORACLE, help="the oracle folder (default: %(default)s)")
    a = ap.parse_args()
    if a.oracle is None:
        ap.error("no shared/oracle folder above this file: give --oracle DIR")
    for name in a.models:
        off = np.load(a.oracle / "real" / REAL[name] / "teacher_forced_faoff.npz")
        fa_off, fa_on = (llama_logits(a.llama, name, off, "f16", fa) for fa in (0, 1))
        model = kvtool.load_model(name)
        print(f"{name}: vs F32 FA-off top-1 / sure / KL / |d top-1|; vs llama.cpp F16 FA off, on: top-1, |d|")
        for label, fn in (
            ("kvtool f16", ATTENTION_REF),
            ("kvtool f16, mul_mat halves", attention_f16_mul_mat),
        ):
            attn.attention_ref = attn_ref.attention_ref = fn  # the dispatch's and the blocks' reference
            try:
                got = teacher_logits(model, off, "f16")
            finally:
                attn.attention_ref = attn_ref.attention_ref = ATTENTION_REF
            print(
                f"  {label:28} {line(scores(got, off))};  {agreement(got, fa_off)}, {agreement(got, fa_on)}"
            )
        print(f"  {'llama.cpp F16 FA on':28} {line(scores(fa_on, off))};  {agreement(fa_on, fa_off)}, -")


if __name__ == "__main__":
    main()
