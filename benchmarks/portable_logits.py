"""The portable C build of the CPU kernels (what a machine without AVX2 or NEON compiles) beside
this machine's native build, on whole models: logits of a prompt (one ubatch: the panel kernel)
and of decoded tokens (one row a ubatch: the row kernels and the compiled decoder layers), the
largest differences, the argmax agreement and each build's time.

    .venv/bin/python benchmarks/portable_logits.py [-m smollm2 -m gemma3-270m] [--prompt 64] [--decode 16]

`-m` takes a cached model's name (kvtool models list) or a GGUF file. The two builds compute the
same integer sums and differ in the order of float additions (the native one in ggml's AVX2 order,
the portable one in ggml's generic order), so the logits agree closely, not bit for bit. The
portable build must also keep no float32 copy of any matrix: the script checks that none was made.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvtool import Batch, Context, ContextParams, Model
from kvtool.common.registry import resolve_model
from kvtool.kernels import cpu_lib
from kvtool.models.linear import QuantLinear

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and "
    "France built wooden machines that riders pushed along with their feet. Pedals came later, "
    "attached to the front wheel, and the chain drive that moves the rear wheel followed decades after."
)


def quant_linears(obj: object, seen: set[int] | None = None) -> list[QuantLinear]:
    """The QuantLinear objects reachable from `obj` through attributes, lists and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, QuantLinear):
        return [obj]
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else None
    if children is None:
        children = getattr(obj, "__dict__", {}).values()
    return [q for c in children for q in quant_linears(c, seen)]


def run(path: Path, tokens: list[int], n_prompt: int) -> tuple[torch.Tensor, float, float, Model]:
    """(logits of every position, prompt seconds, decode seconds, the model)."""
    model = Model(path)
    ctx = Context(model, ContextParams(n_ctx=512))
    t0 = time.perf_counter()
    prompt = tokens[:n_prompt]
    ctx.decode(Batch(prompt, list(range(n_prompt)), [(0,)] * n_prompt, [True] * n_prompt))
    rows = [ctx.logits().clone()]
    t1 = time.perf_counter()
    for i in range(n_prompt, len(tokens)):
        ctx.decode(Batch([tokens[i]], [i], [(0,)], [True]))
        rows.append(ctx.logits().clone())
    t2 = time.perf_counter()
    return torch.cat(rows), t1 - t0, t2 - t1, model


def float_copies(model: Model) -> int:
    """Bytes of float32 copies the quantized matrices made."""
    return sum(q._dense.numel() * 4 for q in quant_linears(model.impl) if q._dense is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", help="model name or GGUF file (repeatable)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens, one ubatch")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded one at a time after it")
    args = ap.parse_args()
    cc = cpu_lib._compiler()
    built = cpu_lib.build(cc, portable=True) if cc else None
    portable = cpu_lib.load(built) if built is not None else None
    native = cpu_lib.lib()
    if portable is None or native is None:
        sys.exit("error: both the native and the portable build are needed (a C compiler)")
    print(f"native build: {native.kvq_simd().decode()}, portable build: {portable.kvq_simd().decode()}")
    head = f"{'max |diff|':>11} {'/max|logit|':>11} {'argmax':>7} {'prompt s':>17} {'decode s':>15}"
    print(f"{'model':<34} {head}")
    for name in args.model or ["smollm2", "gemma3-270m"]:
        path = resolve_model(name, fetch=False)
        probe = Model(path)
        tokens = (probe.tokenize(TEXT) * 8)[: args.prompt + args.decode]
        del probe
        want, p_nat, d_nat, _ = run(path, tokens, args.prompt)
        # every kernel from the portable build
        cpu_lib.lib = lambda: portable  # type: ignore[assignment]
        try:
            got, p_port, d_port, model = run(path, tokens, args.prompt)
            copies = float_copies(model)
        finally:
            cpu_lib.lib = lambda: native  # type: ignore[assignment]
        diff = float((got - want).abs().max())
        rel = diff / float(want.abs().max())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        print(
            f"{path.name:<34} {diff:>11.3g} {rel:>11.3g} {agree:>7.3f} "
            f"{p_nat:>7.2f} / {p_port:<7.2f} {d_nat:>6.2f} / {d_port:<6.2f}"
        )
        if copies:
            sys.exit(f"error: the portable build made {copies} bytes of float32 copies")
    print("prompt s and decode s: native / portable")


if __name__ == "__main__":
    main()
