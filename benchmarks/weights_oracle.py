"""The default weights beside `--weights f32`, each K/V type, against llama.cpp's teacher-forced
references: its F32 K/V, flash-attention-off run (`real/<model>/teacher_forced_faoff.npz`, what
`oracle_check.py teacher` compares with) and its default run (`teacher_forced.npz`: flash
attention on, so F16 K/V), scored as `benchmarks/kv_types_oracle.py` scores (top-1 / top-1 at
sure positions / mean KL@32 / mean |d top-1 logit|), and llama.cpp's own default run against its
F32 one (`self_scores`).

    .venv/bin/python benchmarks/weights_oracle.py gemma3-270m [--weights auto,f32] [--cache f32,f16]
        [--nudges 8] [--llama DRIVER] [--oracle DIR]

`--nudges N` decodes each setting N more times with every input embedding value moved one
float32 ulp up or down at random (seeded), and prints the spread of the F32 reference's scores:
how far last-bit rounding alone carries through the layers (the quantized activations of the
default weights amplify it; the float32 weights barely move). The oracle folder is --oracle DIR,
else as in kv_types_oracle.py.

`--llama DRIVER` (benchmarks/llama_teacher.c, built as its header says) adds llama.cpp itself,
decoded on this machine as the oracle decoded its reference, with F32 K/V and flash attention
off, F16 K/V and flash attention off, and F16 K/V and flash attention on, each scored the same
way: what a faithful implementation gets with each cache.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from kv_types_oracle import ORACLE, REAL, scores, teacher_logits

import kvtool
from kvtool.common.registry import resolve_model

LLAMA_RUNS = (("f32", 0), ("f16", 0), ("f16", 1))


class Nudged:
    """A model's token embedding with each value moved one ulp up or down at random."""

    def __init__(self, embedding: object, seed: int) -> None:
        self.embedding = embedding
        self.dense = getattr(embedding, "dense", None)
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)  # type: ignore[operator]
        up = torch.rand(x.shape, generator=self.gen) < 0.5
        inf = torch.full_like(x, float("inf"))
        return torch.where(up, torch.nextafter(x, inf), torch.nextafter(x, -inf))


def self_scores(on: np.lib.npyio.NpzFile, off: np.lib.npyio.NpzFile) -> tuple[float, float, float, float]:
    """llama.cpp's default run scored against its F32 one, as `scores` scores kvtool: the default
    run keeps its top 32 only, so an id of the F32 run's top 32 outside it is placed at its 32nd
    logit (its true logit is lower: the KL is a lower bound) and its own LSE is used."""
    ids, logits, lse = off["topk_ids"], off["topk_logits"], off["lse"]
    top = np.repeat(on["topk_logits"][:, -1:], ids.shape[1], axis=1)
    for i in range(len(ids)):
        where = {int(t): j for j, t in enumerate(on["topk_ids"][i])}
        for j, t in enumerate(ids[i]):
            if int(t) in where:
                top[i, j] = on["topk_logits"][i, where[int(t)]]
    agree = on["topk_ids"][:, 0] == ids[:, 0]
    sure = logits[:, 0] - logits[:, 1] >= 1.0
    p_ref, p_got = np.exp(logits - lse[:, None]), np.exp(top - on["lse"][:, None])
    kl = (p_ref * (np.log(p_ref + 1e-30) - np.log(p_got + 1e-30))).sum(axis=1).mean()
    d_top1 = np.abs(top[:, 0] - logits[:, 0]).mean()
    return float(agree.mean()), float(agree[sure].mean()), float(kl), float(d_top1)


def llama_logits(driver: Path, model: str, ref: np.lib.npyio.NpzFile, cache: str, fa: int) -> np.ndarray:
    """The reference's prompts through llama.cpp (`driver`, benchmarks/llama_teacher.c) with
    `cache` as the K and V type and flash attention `fa`: the rows of logits, concatenated."""
    tokens, offsets = ref["tokens"], ref["offsets"]
    spans = itertools.pairwise(offsets)
    prompts = "".join(" ".join(str(int(t)) for t in tokens[a:b]) + "\n" for a, b in spans)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.bin"
        subprocess.run([str(driver), str(resolve_model(model)), cache, str(fa), str(out)], input=prompts,
                       text=True, check=True, capture_output=True)  # fmt: skip
        return np.fromfile(out, dtype=np.float32).reshape(len(tokens), -1)


def line(values: tuple[float, ...]) -> str:
    return " / ".join(f"{x:.4f}" for x in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(REAL))
    ap.add_argument("--weights", default="auto,f32", help="weights modes, comma-separated")
    ap.add_argument("--cache", default="f32,f16", help="K/V cache types, comma-separated")
    ap.add_argument("--nudges", type=int, default=0, help="runs with the embeddings nudged by one ulp")
    ap.add_argument("--llama", type=Path, help="llama_teacher built from benchmarks/llama_teacher.c")
    ap.add_argument("--oracle", type=Path, default=ORACLE, help="the oracle folder (default: %(default)s)")
    a = ap.parse_args()
    if a.oracle is None:
        ap.error("no shared/oracle folder above this file: give --oracle DIR")
    folder = a.oracle / "real" / REAL[a.model]
    off, on = np.load(folder / "teacher_forced_faoff.npz"), np.load(folder / "teacher_forced.npz")
    print(f"{a.model}, {len(off['topk_ids'])} rows: top-1 / sure / KL@32 / |d top-1|")
    for weights in a.weights.split(","):
        model = kvtool.load_model(a.model, weights=weights)
        for cache in a.cache.split(","):
            got = teacher_logits(model, off, cache)
            print(f"kvtool --weights {weights} -ctk/-ctv {cache}: vs F32 FA-off {line(scores(got, off))}"
                  f"   vs FA-on {line(scores(got, on))}")  # fmt: skip
            if a.nudges:
                embedding = model.impl.tok_embd
                runs = []
                for seed in range(1, a.nudges + 1):
                    model.impl.tok_embd = Nudged(embedding, seed)
                    runs.append(scores(teacher_logits(model, off, cache), off))
                model.impl.tok_embd = embedding
                r = np.array(runs)
                print(f"  {a.nudges} nudged runs vs F32 FA-off: top-1 {r[:, 0].mean():.4f} "
                      f"({r[:, 0].min():.4f}-{r[:, 0].max():.4f}), |d top-1| {r[:, 3].mean():.3f} "
                      f"({r[:, 3].min():.3f}-{r[:, 3].max():.3f})")  # fmt: skip
    print(f"llama.cpp's FA-on reference vs F32 FA-off: {line(self_scores(on, off))}")
    for cache, fa in LLAMA_RUNS if a.llama else ():
        got = llama_logits(a.llama, a.model, off, cache, fa)
        print(f"llama.cpp here -ctk/-ctv {cache} -fa {'on' if fa else 'off'}: vs F32 FA-off "
              f"{line(scores(got, off))}   vs FA-on {line(scores(got, on))}")  # fmt: skip


if __name__ == "__main__":
    main()
