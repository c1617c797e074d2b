"""The compiled decode attention alone, per K/V cache type pair, at a depth: milliseconds per
token over a model's layers, optionally for several builds of the kernels side by side.

    .venv/bin/python benchmarks/kv_attention.py [--pairs f16/f16,q8_0/q8_0] [-d 4096] [-t 1] [-r 10]
        [--lib NAME=PATH.so ...]

Shapes default to SmolLM2-135M's (30 layers, 9 query heads on 3 KV heads of 64): one query row
per layer over `-d` visible keys of a cache of `-d` + 256 cells (the padding hidden, as a
context's mask gives it), each layer its own K and V (random values stored in each type), so a
token reads every layer's cache from memory as a decode does. Rounds alternate over the builds
and pairs; the table gives each one's median and best round. `-t 1` (the default) times the
calling thread's CPU time, which another process on the machine disturbs less than wall time;
more threads time the wall. `--lib` takes a kernel build (cpu_lib's shared object, e.g. one
built from another commit) to compare with this tree's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvtool.kernels import attention_cpu, cpu_lib
from kvtool.kernels.kv_quant import KV_TYPES, quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="f16/f16,q8_0/q8_0,q8_0/f16,f16/q8_0", help="K/V type pairs")
    ap.add_argument("-d", "--depth", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=10)
    ap.add_argument("-n", "--tokens", type=int, default=3, help="tokens timed per round")
    ap.add_argument("--lib", action="append", default=[], help="NAME=PATH of another kernel build")
    a = ap.parse_args()

    own = cpu_lib.lib()
    if own is None:
        raise SystemExit("kv_attention: the CPU kernels are not built here")
    libs = [("this", own)]
    for spec in a.lib:
        name, _, path = spec.partition("=")
        other = cpu_lib.load(Path(path))
        if other is None:
            raise SystemExit(f"kv_attention: {path} does not load")
        libs.append((name, other))
    H, Hkv, D = (int(x) for x in a.heads.split(","))
    pairs = [tuple(p.split("/")) for p in a.pairs.split(",")]
    for p in pairs:
        if len(p) != 2 or not all(x in KV_TYPES for x in p):
            raise SystemExit(f"kv_attention: bad pair {'/'.join(p)} (types: {', '.join(KV_TYPES)})")
    torch.set_num_threads(1)
    for _, lib in libs:
        lib.kvq_set_threads(a.threads)

    cells = a.depth + 256
    gen = torch.Generator().manual_seed(0)
    raw = [torch.randn(1, cells, Hkv, D, generator=gen) for _ in range(2 * a.layers)]
    caches = {t: [quantize(r, KV_TYPES[t]) for r in raw] for p in pairs for t in p}
    q = torch.randn(1, 1, H, D, generator=gen) * 2
    mask = torch.full((1, 1, cells), float("-inf"))
    mask[..., : a.depth] = 0.0
    clock = time.process_time if a.threads == 1 else time.perf_counter

    times: dict[tuple[str, str], list[float]] = {}
    real = cpu_lib.lib
    try:
        for _ in range(a.rounds):
            for name, lib in libs:
                cpu_lib.lib = lambda lib=lib: lib  # type: ignore[assignment]
                for tk, tv in pairs:
                    K, V, kt, vt = caches[tk], caches[tv], KV_TYPES[tk], KV_TYPES[tv]
                    t0 = clock()
                    for _ in range(a.tokens):
                        for j in range(a.layers):
                            attention_cpu.attention_cpu(q, K[2 * j], V[2 * j + 1], mask, 1 / D**0.5, kt, vt)
                    times.setdefault((f"{tk}/{tv}", name), []).append((clock() - t0) / a.tokens * 1e3)
    finally:
        cpu_lib.lib = real  # type: ignore[method-assign]

    shape = f"{a.layers} layers, heads {H}/{Hkv} x {D}, depth {a.depth}, {a.threads} thread(s)"
    print(f"attention ms per token: {shape}")
    print("| K/V | build | median | best |\n|---|---|---:|---:|")
    for (pair, name), ts in times.items():
        print(f"| {pair} | {name} | {statistics.median(ts):.2f} | {min(ts):.2f} |")


if __name__ == "__main__":
    main()
