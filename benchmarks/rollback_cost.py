"""What the failed-decode rollback's eager copy costs a decode step of a sliding-window model.

Before a ubatch writes its cells, `KVCacheContext._save` copies each touched stream's cell
bookkeeping and the K/V rows of cells that held a token before the batch (docs/architecture.md,
the rollback), so a failed decode can put them back. Once a window cache has wrapped, every
decode step takes over such a cell. This decodes past the wrap and prints (1) the time spent in
`_save` per step against the whole step, and (2) the median step with and without the copy
(`_save` replaced by nothing), in alternating rounds of 16 steps.

    .venv/bin/python benchmarks/rollback_cost.py [--model gemma3-270m] [-c 4096] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvtool
from kvtool.common.registry import resolve_model
from kvtool.memory import kv_cache_context as kcc
from kvtool.memory.composite import Composite
from kvtool.memory.kv_cache import KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="gemma3-270m", help="a known name or a GGUF path (a sliding-window model)"
    )
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12, help="A/B rounds of 16 steps each")
    args = ap.parse_args()

    kvtool.set_n_threads(args.threads)
    model = kvtool.Model(resolve_model(args.model, fetch=False))
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=args.ctx_size, n_batch=512, n_ubatch=512))
    swa = ctx.memory.parts.get("swa") if isinstance(ctx.memory, Composite) else None
    if not isinstance(swa, KVCache):
        raise SystemExit(f"error: {args.model} has no sliding-window cache")
    prompt = [(7 * i) % 5000 + 100 for i in range(swa.n_cells + 100)]  # past the window cache's wrap
    kvtool.decode_tokens(ctx, prompt, 0, 0)
    pos = len(prompt)

    def step() -> float:
        nonlocal pos
        t = time.perf_counter()
        ctx.decode(kvtool.Batch.from_tokens([int(ctx.logits_ith(-1).argmax())], seq_id=0, pos0=pos))
        pos += 1
        return time.perf_counter() - t

    save = kcc.KVCacheContext._save
    spent = [0.0]

    def timed(self: kcc.KVCacheContext, s: int, idx: object) -> None:
        t = time.perf_counter()
        save(self, s, idx)  # type: ignore[arg-type]
        spent[0] += time.perf_counter() - t

    def nothing(self: kcc.KVCacheContext, s: int, idx: object) -> None:
        return None

    kcc.KVCacheContext._save = timed  # type: ignore[method-assign]
    for _ in range(8):
        step()
    spent[0], n = 0.0, 64
    total = sum(step() for _ in range(n))
    print(f"{args.model}, n_ctx {args.ctx_size}, window cache {swa.n_cells} cells, {args.threads} threads")
    share = 100 * spent[0] / total
    print(f"_save: {spent[0] / n * 1e6:.1f} us per step of {total / n * 1e3:.2f} ms ({share:.2f} %)")

    with_copy: list[float] = []
    without: list[float] = []
    for r in range(args.rounds):
        order = [(save, with_copy), (nothing, without)]
        for impl, out in order if r % 2 == 0 else order[::-1]:
            kcc.KVCacheContext._save = impl  # type: ignore[method-assign]
            out += [step() for _ in range(16)]
    kcc.KVCacheContext._save = save  # type: ignore[method-assign]
    a, b = statistics.median(with_copy), statistics.median(without)
    print(
        f"median step: with the copy {a * 1e3:.3f} ms, without {b * 1e3:.3f} ms: {100 * (a - b) / b:+.2f} % "
        f"({len(with_copy)} steps each)"
    )


if __name__ == "__main__":
    main()
