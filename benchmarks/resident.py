"""Prints how much memory a model holds in each weights mode: the process's resident set (VmRSS)
after loading, after a few single-token decodes, and after one prompt of many rows (where a
quantized format without the compiled panel kernel makes its dense float32 copy).

    .venv/bin/python benchmarks/resident.py MODEL.gguf auto [--prompt 512]

One mode per process, so that each number starts from the same empty interpreter.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise OSError("no VmRSS in /proc/self/status")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("weights", choices=["auto", "f32", "f16", "bf16"])
    p.add_argument("--prompt", type=int, default=512, help="tokens of the many-row prompt")
    a = p.parse_args(argv)
    import kvtool

    base = rss_mb()  # torch and kvtool imported
    model = kvtool.Model(a.model, weights=a.weights)
    loaded = rss_mb()
    n = a.prompt
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=2 * n + 64, n_batch=n, n_ubatch=n, n_seq_max=2))
    for i in range(16):
        kvtool.decode_tokens(ctx, [1 + i], 0, i)
    decoded = rss_mb()
    kvtool.decode_tokens(ctx, [1 + i % 200 for i in range(a.prompt)], 1, 0)
    prompted = rss_mb()
    print(
        f"{a.model} {a.weights}: resident MB above the interpreter: loaded {loaded - base:.0f}, "
        f"after 16 decodes {decoded - base:.0f}, after a {a.prompt}-token prompt {prompted - base:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
