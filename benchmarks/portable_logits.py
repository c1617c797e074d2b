"""The portable C build of the CPU kernels (what a machine without AVX2 or NEON compiles) beside
this machine's native build, on whole models: logits of a prompt (one ubatch: the panel kernel)
and of decoded tokens (one row a ubatch: the row kernels and the compiled decoder layers), the
largest differences between the builds and from the float32 weights' logits (`weights="f32"`),
the argmax agreement and each build's time.

    .venv/bin/python benchmarks/portable_logits.py [-m smollm2 -m gemma3-270m] [--prompt 64] [--decode 16]
        [--cache f16]

`-m` takes a cached model's name (kvtool models list) or a GGUF file. The two builds compute the
same integer sums and differ in the order of float additions (the native one in ggml's AVX2 order,
the portable one in ggml's generic order) and in e^x (SiLU, softmax); through a model's layers
such last-bit differences move some activations across an int8 rounding step (and K/V values
across a half's or bfloat16's with such a `--cache`), so the two builds differ by about as much
as each differs from the float32 weights' logits. The
portable build must also keep no float32 copy of any matrix: the script checks that none was made.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvtool import Batch, Context, ContextParams, Model
from kvtool.backend.linear import QuantLinear
from kvtool.common.registry import resolve_model
from kvtool.kernels import cpu_lib

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


def run(
    path: Path, tokens: list[int], n_prompt: int, cache: str, weights: str = "auto"
) -> tuple[torch.Tensor, float, float, Model]:
    """(logits of every position, prompt seconds, decode seconds, the model), K and V cached as
    `cache`."""
    model = Model(path, weights=weights)
    ctx = Context(model, ContextParams(n_ctx=512, type_k=cache, type_v=cache))
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
    ap.add_argument("--cache", choices=["f32", "f16", "bf16"], default="f16", help="K and V cache type")
    args = ap.parse_args()
    cc = cpu_lib._compiler()
    built = cpu_lib.build(cc, portable=True) if cc else None
    portable = cpu_lib.load(built) if built is not None else None
    native = cpu_lib.lib()
    if portable is None or native is None:
        sys.exit("error: both the native and the portable build are needed (a C compiler)")
    builds = f"native build: {native.kvq_simd().decode()}, portable build: {portable.kvq_simd().decode()}"
    print(f"{builds}, K/V cache {args.cache}")
    print(f"{'model':<34} {'logits':<20} {'max |diff|':>10} {'/max|logit|':>11} {'argmax':>7}")
    times = []
    for name in args.model or ["smollm2", "gemma3-270m"]:
        path = resolve_model(name, fetch=False)
        probe = Model(path)
        tokens = (probe.tokenize(TEXT) * 8)[: args.prompt + args.decode]
        del probe
        exact = run(path, tokens, args.prompt, args.cache, weights="f32")[0]
        want, p_nat, d_nat, _ = run(path, tokens, args.prompt, args.cache)
        # every kernel from the portable build
        cpu_lib.lib = lambda: portable  # type: ignore[assignment]
        try:
            got, p_port, d_port, model = run(path, tokens, args.prompt, args.cache)
            copies = float_copies(model)
        finally:
            cpu_lib.lib = lambda: native  # type: ignore[assignment]
        for label, a, b in (
            ("portable vs native", got, want),
            ("native vs f32", want, exact),
            ("portable vs f32", got, exact),
        ):
            diff = float((a - b).abs().max())
            agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
            rel = diff / float(b.abs().max())
            print(f"{path.name:<34} {label:<20} {diff:>10.3g} {rel:>11.3g} {agree:>7.3f}")
        times.append((path.name, p_nat, p_port, d_nat, d_port))
        if copies:
            sys.exit(f"error: the portable build made {copies} bytes of float32 copies")
    for name, p_nat, p_port, d_nat, d_port in times:
        print(f"{name}: prompt {p_nat:.2f} s native, {p_port:.2f} s portable;", end=" ")
        print(f"decode {d_nat:.2f} s native, {d_port:.2f} s portable")


if __name__ == "__main__":
    main()
