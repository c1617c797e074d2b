"""Each block format's one-row matmul (a decoded token's kind) in bytes of weights read per second,
beside the machine's read bandwidth, at each thread count asked for.

    .venv/bin/python benchmarks/qmatmul_bandwidth.py [-t 1,2] [--mib 1024] [-r 5] [--rows 1]

`--rows 8` multiplies 8 activation rows a matmul instead (batched decode at B = 8: the pair
kernels of an AVX-512 VNNI build, the 8-row kernels elsewhere), where the arithmetic, not the
memory, sets the pace: it prints the weights' GB/s the same way.

The weights have the shapes of a 1B model's feed-forward (gate and up [8192, 2048], down
[2048, 8192]), repeated until they fill `--mib` (far more than the caches), and are multiplied
one after another as a decode does, one activation row each: every byte comes from memory once
per pass. The read bandwidth is benchmarks/read_bandwidth.c (compiled here with cc) reading a
buffer of the same size with the same threads. Best of `-r` passes each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtool.kernels import cpu_lib, qmatmul
from kvtool.kernels.dequant import Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0

NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
HALF_AT = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}
SHAPES = [(8192, 2048), (8192, 2048), (2048, 8192)]  # gate, up, down of a 1B model


def blocks(rng: np.random.Generator, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """Random blocks whose halves are small normal numbers (no NaN, infinity or subnormal)."""
    elems, size = qmatmul.BLOCKS[qtype]
    b = rng.integers(0, 256, size=(shape[0] * shape[1] // elems, size), dtype=np.uint8)
    for at in HALF_AT[qtype]:
        b[:, at : at + 2] = np.full((b.shape[0], 1), 1e-3, dtype=np.float16).view(np.uint8)
    return torch.from_numpy(b).reshape(shape[0], -1)


def read_bandwidth(mib: int, threads: int, rounds: int) -> float:
    src = Path(__file__).with_name("read_bandwidth.c")
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "read_bandwidth"
        subprocess.run(["cc", "-O2", "-pthread", "-o", str(exe), str(src)], check=True)
        out = subprocess.run([str(exe), str(mib), str(threads), str(rounds)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: read_bandwidth exited with {out.returncode}")
    return float(out.stdout)


def kernel_bandwidth(qtype: int, mib: int, rounds: int, n_rows: int) -> float:
    """GB/s of weights through the matmul of `n_rows` activation rows, best of `rounds` passes."""
    rng = np.random.default_rng(0)
    per_layer = sum(s[0] * s[1] for s in SHAPES) * qmatmul.BLOCKS[qtype][1] // qmatmul.BLOCKS[qtype][0]
    layers = max(1, (mib << 20) // per_layer)
    weights = [qmatmul.QWeight([blocks(rng, qtype, s)], qtype, [s]) for _ in range(layers) for s in SHAPES]
    xs = {k: torch.randn(n_rows, k) for k in {s[1] for s in SHAPES}}
    lib = cpu_lib.lib()
    best = 0.0
    for _ in range(rounds + 1):  # the first pass maps the pages in
        t0 = time.perf_counter()
        for w in weights:
            w(xs[w.k], lib)
        best = max(best, layers * per_layer / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--mib", type=int, default=1024, help="weights per format, MiB")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--types", default=",".join(NAMES.values()))
    ap.add_argument("--rows", type=int, default=1, help="activation rows a matmul (batched decode: its B)")
    a = ap.parse_args()
    if not qmatmul.available():
        sys.exit("error: the compiled kernels are not available (no C compiler?)")
    threads = [int(t) for t in a.threads.split(",")]
    types = [q for q, n in NAMES.items() if n in a.types.split(",")]
    rows: dict[str, list[float]] = {}
    for t in threads:
        cpu_lib.set_threads(t)
        rows.setdefault("read bandwidth (read_bandwidth.c)", []).append(read_bandwidth(a.mib, t, a.rounds))
        for q in types:
            rows.setdefault(NAMES[q], []).append(kernel_bandwidth(q, a.mib, a.rounds, a.rows))
    what = "a one-row matmul" if a.rows == 1 else f"a matmul of {a.rows} activation rows"
    print(f"\nGB/s of weights through {what}, {a.mib} MiB per format, best of {a.rounds}\n")
    head = " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads)
    print(f"| kernel | {head} |")
    print("|---|" + "---|" * len(threads))
    bw = rows["read bandwidth (read_bandwidth.c)"]
    for name, vals in rows.items():
        read = name.startswith("read")
        cells = [f"{v:.1f}" if read else f"{v:.1f} ({v / b:.0%})" for v, b in zip(vals, bw, strict=True)]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
