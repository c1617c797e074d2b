"""What a state's model identity costs: the SHA-256 of the whole GGUF that a state save or load
checks (computed once per loaded model, at its first save or load), against the model's load
time and a sequence state's save. Prints one row per model.

    .venv/bin/python -m benchmarks.state_identity [-m smollm2 -m gemma3-270m] [-r 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import kvtool


def median_ms(f, reps: int) -> float:  # type: ignore[no-untyped-def]
    """The median of `reps` timed calls of f(), in milliseconds."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", help="known name or GGUF path (repeat)")
    ap.add_argument("-r", "--reps", type=int, default=5)
    args = ap.parse_args()
    print("| model | file MB | load ms | content hash ms | GB/s | 1st seq save ms (hashes) | next saves ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.model or ["smollm2", "gemma3-270m"]:
        kvtool.load_model(name)  # warm the page cache and the compiled kernels
        t = time.perf_counter()
        m = kvtool.load_model(name)
        load = (time.perf_counter() - t) * 1e3
        size = m.path.stat().st_size
        hashed = median_ms(lambda m=m: hashlib.sha256(m.file._mm).hexdigest(), args.reps)
        ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=512, n_batch=512, n_ubatch=512))
        kvtool.decode_tokens(ctx, m.tokenize("The quick brown fox jumps over the lazy dog. " * 20), 0, 0)
        t = time.perf_counter()
        ctx.state_seq_get_data(0)
        first = (time.perf_counter() - t) * 1e3
        later = median_ms(lambda ctx=ctx: ctx.state_seq_get_data(0), args.reps)
        print(
            f"| {name} | {size / 1e6:.1f} | {load:.0f} | {hashed:.0f} | {size / hashed / 1e6:.2f} "
            f"| {first:.0f} | {later:.0f} |"
        )


if __name__ == "__main__":
    main()
