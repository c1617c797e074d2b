"""Fills a GGUF file's tensors, in place, with random values of their own types.

    python benchmarks/random_weights.py MODEL.gguf [--seed 0]

For speed runs of a model that cannot travel (a lent GPU machine takes 64 MiB of files; SmolLM2
is 98 MB): carry the file's header (metadata and tensor infos: `head -c DATA_OFFSET`), extend it
to the full size on the machine (`truncate -s SIZE`: zeros) and fill it here. The values are
normal (weights scaled by 0.02, norms around 1) and quantized with gguf-py, so every block has
finite scales; zeros would hide unwritten outputs and can time faster than real data.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np


def fill(path: str, seed: int) -> int:
    """Fills every tensor of the GGUF at `path` in place; returns how many it filled."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(path, "r+")
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml's ne, outermost first
        x = rng.standard_normal(shape, dtype=np.float32)
        x = 1.0 + 0.1 * x if len(shape) == 1 else 0.02 * x  # 1-D: norms and biases
        if t.tensor_type == T.F32:
            t.data[...] = x.reshape(t.data.shape)
        elif t.tensor_type == T.F16:
            t.data[...] = x.astype(np.float16).reshape(t.data.shape)
        else:
            t.data[...] = quantize(x, t.tensor_type).reshape(t.data.shape)
    reader.data.flush()
    return len(reader.tensors)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="GGUF file, full size (its tensors are overwritten)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        n = fill(a.model, a.seed)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"error: {a.model}: {e}", file=sys.stderr)
        return 1
    print(f"{a.model}: {n} tensors filled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
