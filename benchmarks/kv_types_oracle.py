"""How far each K/V cache type moves kvtool from llama.cpp's F32 reference, beside how far it
moves llama.cpp itself: the oracle's teacher-forced rows (`real/<model>/teacher_forced_faoff.npz`,
F32 K/V, flash attention off) decoded by kvtool with `-ctk T -ctv T`, scored with the metrics of
`real/kvquant_summary.json` (top-1 agreement, at sure positions, mean KL over the reference's
top 32, mean |d top-1 logit|), and that file's figures for llama.cpp with the same type.

    .venv/bin/python benchmarks/kv_types_oracle.py smollm2 f16 q8_0 q5_1 q4_0 iq4_nl

The oracle folder is --oracle DIR, else the first shared/oracle beside a folder above this file
(../shared/oracle from the project root, ../../shared/oracle from a worktree under it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import kvtool

ORACLE = next(
    (d / "shared" / "oracle" for d in Path(__file__).resolve().parents if (d / "shared" / "oracle").is_dir()),
    None,
)
REAL = {"smollm2": "smollm2-135m-instruct-q4_1", "gemma3-270m": "gemma-3-270m-q4_k_m"}


def scores(got: np.ndarray, ref: np.lib.npyio.NpzFile) -> tuple[float, float, float, float]:
    """(top-1, top-1 where the reference leads by >= 1.0, mean KL@32, mean |d top-1 logit|)."""
    ids, logits, lse = ref["topk_ids"], ref["topk_logits"], ref["lse"]
    agree = got.argmax(axis=1) == ids[:, 0]
    sure = logits[:, 0] - logits[:, 1] >= 1.0
    top = np.take_along_axis(got, ids, axis=1)
    mx = got.max(axis=1)
    got_lse = np.log(np.exp(got - mx[:, None]).sum(axis=1)) + mx
    p_ref, p_got = np.exp(logits - lse[:, None]), np.exp(top - got_lse[:, None])
    kl = (p_ref * (np.log(p_ref + 1e-30) - np.log(p_got + 1e-30))).sum(axis=1).mean()
    d_top1 = np.abs(top[:, 0] - logits[:, 0]).mean()
    return float(agree.mean()), float(agree[sure].mean()), float(kl), float(d_top1)


def teacher_logits(model: kvtool.Model, ref: np.lib.npyio.NpzFile, cache: str) -> np.ndarray:
    """Each of the reference's prompts decoded as one batch with every row an output, as
    llama.cpp did, with `cache` as the K and V type: the rows of logits, concatenated."""
    tokens, offsets = ref["tokens"], ref["offsets"]
    rows = []
    for i in range(len(offsets) - 1):
        p = kvtool.ContextParams(n_ctx=2048, n_seq_max=1, kv_unified=True, type_k=cache, type_v=cache)
        ctx = kvtool.Context(model, p)
        ids = [int(x) for x in tokens[offsets[i] : offsets[i + 1]]]
        ctx.decode(kvtool.Batch.from_tokens(ids, seq_id=0, pos0=0, logits="all"))
        rows.append(np.asarray(ctx.logits(), dtype=np.float32))
    return np.concatenate(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(REAL))
    ap.add_argument("types", nargs="+", help="K and V cache types")
    ap.add_argument("--oracle", type=Path, default=ORACLE, help="the oracle folder (default: %(default)s)")
    a = ap.parse_args()
    if a.oracle is None:
        ap.error("no shared/oracle folder above this file: give --oracle DIR")
    folder = a.oracle / "real" / REAL[a.model]
    ref = np.load(folder / "teacher_forced_faoff.npz")
    runs = json.loads((a.oracle / "real" / "kvquant_summary.json").read_text())["models"][REAL[a.model]][
        "runs"
    ]
    model = kvtool.load_model(a.model)
    n = len(ref["topk_ids"])
    print(f"{a.model}, {n} rows: top-1 / sure / KL@32 / |d top-1| against llama.cpp's F32 FA-off")
    for t in a.types:
        ours = " / ".join(f"{x:.4f}" for x in scores(teacher_logits(model, ref, t), ref))
        r = runs.get(f"kv{t}")
        keys = ("top1_agreement", "top1_agreement_sure_positions", "mean_kl_top32", "mean_abs_d_top1_logit")
        theirs = " / ".join(f"{r[k]:.4f}" for k in keys) if r else "-"
        print(f"{t:>7}  kvtool {ours}   llama.cpp {theirs}")


if __name__ == "__main__":
    main()
