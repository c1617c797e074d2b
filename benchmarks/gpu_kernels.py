"""kvtool's Triton attention beside torch's SDPA on one CUDA GPU, on the same data in one run.

    .venv/bin/python benchmarks/gpu_kernels.py [--dtype fp16] [--heads 32 --kv-heads 8 --head-dim 128]
                                               [--cases decode-1x4k,prompt-4k] [--reps 50] [--json out.json]

For each case (issue 13's table by default) it times, with CUDA events after a warm-up:
kvtool's kernel deciding visibility from cell metadata (`attention_triton` given the cells, as
the engine uses it on CUDA), the same kernel reading a dense float mask, torch's
`scaled_dot_product_attention` as it chooses, and for prompts its flash backend alone. Decode
rows report the share of the measured device copy bandwidth (K and V bytes read per call
over the time); prompt rows the TFLOP/s and their share of the measured fp16/bf16 matmul peak.
Each kvtool output is checked against SDPA's (the max abs difference in the table). Without a CUDA
GPU (or with TRITON_INTERPRET set) it refuses in one line: interpreter timings mean nothing.
One call at a time includes the launch from Python (tens of microseconds for a Triton kernel,
more than a small decode kernel runs); the engine replays decode steps from CUDA graphs, so the
cells kernel and SDPA are also timed inside a graph of GRAPH_CALLS calls, and the shares are
taken from those times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Case:
    name: str  # the key for --cases
    label: str  # the table's row
    n_stream: int
    n_q: int  # queries per stream: 1 for decode, the prompt length for prompts
    n_kv: int  # cells per stream

    @property
    def prompt(self) -> bool:
        return self.n_q > 1


CASES = [
    Case("decode-1x4k", "decode, 1 stream, 4k cells", 1, 1, 4096),
    Case("decode-1x32k", "decode, 1 stream, 32k cells", 1, 1, 32768),
    Case("decode-16x4k", "decode, 16 streams, 4k cells", 16, 1, 4096),
    Case("decode-64x2k", "decode, 64 streams, 2k cells", 64, 1, 2048),
    Case("prompt-4k", "prompt, 4096 tokens, causal", 1, 4096, 4096),
]
_BY_NAME = {c.name: c for c in CASES}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dtype", choices=["fp16", "bf16"], default="fp16", help="Q, K and V type (default fp16)."
    )
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cases", default=",".join(_BY_NAME), help="Comma list of: " + ", ".join(_BY_NAME))
    p.add_argument("--reps", type=int, default=50, help="Timed calls per measurement (median).")
    p.add_argument("--json", help="Also write the rows here.")
    a = p.parse_args(argv)
    unknown = [n for n in a.cases.split(",") if n not in _BY_NAME]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)} (one of: {', '.join(_BY_NAME)})")
    if a.heads < 1 or a.kv_heads < 1 or a.heads % a.kv_heads:
        p.error("--heads must be a positive multiple of --kv-heads")
    if a.head_dim < 16 or a.head_dim > 256:
        p.error("--head-dim must be between 16 and 256")
    if a.reps < 1:
        p.error("--reps must be at least 1")
    a.case_list = [_BY_NAME[n] for n in a.cases.split(",")]
    return a


def cuda_refusal() -> str | None:
    """Why this machine cannot time the kernels, or None."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: unset it to time compiled kernels"
    import torch

    if not torch.cuda.is_available():
        return f"benchmarks/gpu_kernels.py needs a CUDA GPU (torch {torch.__version__} sees none)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "benchmarks/gpu_kernels.py needs triton (pip install 'kvtool[gpu]')"
    return None


def time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls, each between CUDA events, after a warm-up."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


GRAPH_CALLS = 20


def time_graph_ms(fn: Callable[[], object], reps: int) -> float | None:
    """Median milliseconds of one `fn` call replayed from a CUDA graph of GRAPH_CALLS calls (the
    kernels' own time, without the launches from Python); None where `fn` cannot be captured."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # lazy initialisations stay out of the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except RuntimeError:
        return None
    return time_ms(graph.replay, reps) / GRAPH_CALLS


def copy_bandwidth(reps: int) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), max(5, reps // 5))
    return 2 * src.numel() / (ms / 1e3)


def matmul_peak(dtype, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Measured tensor-core FLOP/s of an 8192^3 matmul in `dtype`."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b, max(5, reps // 5))
    return 2 * n**3 / (ms / 1e3)


def run_case(c: Case, a: argparse.Namespace, bw: float, peak: float) -> dict[str, object]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvtool.kernels.attention_triton import attention_triton
    from kvtool.kernels.visibility import Cells

    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    S, H, Hkv, D = c.n_stream, a.heads, a.kv_heads, a.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(S, c.n_q, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(S, c.n_kv, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(S, c.n_kv, Hkv, D, device="cuda", dtype=dtype, generator=g)
    # cells 0..n_kv-1 of sequence 0 in every stream; queries at the newest positions
    pos = torch.arange(c.n_kv, device="cuda").expand(S, c.n_kv).contiguous()
    q_pos = torch.arange(c.n_kv - c.n_q, c.n_kv, device="cuda").expand(S, c.n_q).contiguous()
    cells = Cells(pos, torch.ones_like(pos), q_pos, torch.zeros_like(q_pos))
    vis = pos[:, None, :] <= q_pos[:, :, None]  # [S, n_q, n_kv]
    mask = torch.zeros(vis.shape, device="cuda", dtype=dtype).masked_fill(~vis, float("-inf"))
    scale = 1.0 / D**0.5
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # SDPA's [S, H, L, D]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=c.prompt, scale=scale, enable_gqa=True)

    row: dict[str, object] = {"case": c.label}
    want = sdpa().transpose(1, 2)
    for key, fn in (
        ("kvtool_cells_ms", lambda: attention_triton(q, k, v, cells, scale)),
        ("kvtool_mask_ms", lambda: attention_triton(q, k, v, mask, scale)),
    ):
        row[key] = time_ms(fn, a.reps)
        row[key.replace("_ms", "_max_diff")] = float((fn() - want).abs().max())
    row["sdpa_ms"] = time_ms(sdpa, a.reps)
    row["kvtool_cells_graph_ms"] = time_graph_ms(lambda: attention_triton(q, k, v, cells, scale), a.reps)
    row["sdpa_graph_ms"] = time_graph_ms(sdpa, a.reps)
    kernel_ms = row["kvtool_cells_graph_ms"] or row["kvtool_cells_ms"]
    if c.prompt:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                row["sdpa_flash_ms"] = time_ms(sdpa, a.reps)
        except RuntimeError as e:  # no flash kernel for this shape or dtype
            row["sdpa_flash_ms"] = None
            row["sdpa_flash_note"] = str(e).splitlines()[0]
        flops = 4 * S * H * c.n_q * c.n_kv * D / 2  # QK^T and PV, causal: half the pairs
        row["kvtool_cells_tflops"] = flops / (kernel_ms / 1e3) / 1e12  # type: ignore[operator]
        row["share_of_peak"] = flops / (kernel_ms / 1e3) / peak  # type: ignore[operator]
    else:
        n_bytes = (k.numel() + v.numel()) * k.element_size()
        row["share_of_copy_bw"] = n_bytes / (kernel_ms / 1e3) / bw  # type: ignore[operator]
    return row


def table(rows: list[dict[str, object]], head: str) -> str:
    def ms(x: object) -> str:
        return "n/a" if x is None else f"{x:.3f} ms"

    out = [
        head,
        "",
        "| case | kvtool Triton (cells) | kvtool Triton (mask) | torch SDPA | SDPA flash "
        "| cells, in a graph | SDPA, in a graph | share (cells, in a graph) | vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "share_of_peak" in r:
            share = f"{r['kvtool_cells_tflops']:.0f} TFLOP/s, {100 * r['share_of_peak']:.0f} % of peak"  # type: ignore[operator]
        else:
            share = f"{100 * r['share_of_copy_bw']:.0f} % of copy bw"  # type: ignore[operator]
        flash = ms(r.get("sdpa_flash_ms")) if "sdpa_flash_ms" in r else "-"
        cells = f"{r['kvtool_cells_ms']:.3f} ms"
        out.append(
            f"| {r['case']} | {cells} | {ms(r['kvtool_mask_ms'])} | {ms(r['sdpa_ms'])} | {flash} "
            f"| {ms(r.get('kvtool_cells_graph_ms'))} | {ms(r.get('sdpa_graph_ms'))} | {share} "
            f"| {r['kvtool_cells_max_diff']:.1e} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    why = cuda_refusal()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import torch
    import triton

    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    bw, peak = copy_bandwidth(a.reps), matmul_peak(dtype, a.reps)
    rows = [run_case(c, a, bw, peak) for c in a.case_list]
    name = torch.cuda.get_device_name()
    head = (
        f"{name}, torch {torch.__version__}, triton {triton.__version__}, {a.dtype}; heads {a.heads}, "
        f"KV heads {a.kv_heads}, head dim {a.head_dim}; copy {bw / 1e9:.0f} GB/s, "
        f"matmul {peak / 1e12:.0f} TFLOP/s (both measured)"
    )
    print(table(rows, head))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "args": {k: v for k, v in vars(a).items() if k != "case_list"},
                       "copy_bw": bw, "matmul_peak": peak, "cases": [asdict(c) for c in a.case_list],
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
