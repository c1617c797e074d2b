"""The whole engine on a device against the CPU engine and llama.cpp's reference outputs.

test_device_cuda.py runs `check_all("cuda")` in a process without TRITON_INTERPRET (so the
kernels are compiled for the GPU); test_device.py runs the same checks on the CPU, where they
compare the CPU engine with itself and llama.cpp, to keep them honest without a GPU.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

import kvtool
from tests.kvtool.test_oracle_tiny import ATTN, DATA, RECURRENT, rel_err, replay

SMOLLM2 = Path(__file__).parent.parent / "data" / "smollm2"


def _tiny(arch: str, device: str, weights: str = "f32") -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf", weights=weights, device=device)


def check_tiny_scenarios(device: str, quick: bool = False) -> None:
    """Every architecture, both KV modes: llama.cpp's logits within its 1e-3 bar, and the CPU
    engine's within 1e-4 (f32 weights; fp32 dots in the kernels, no TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the default, stated: f32 matmuls stay f32
    failed = []  # every case is run: one failure's errors alone do not say what is wrong
    for arch in ATTN[:1] if quick else ATTN + RECURRENT:
        cpu, dev = _tiny(arch, "cpu"), _tiny(arch, device)
        for scenario in ("multi",) if quick else ("single", "multi", "fork", "state_seq"):
            for unified in (0, 1):
                suffix = "_faoff" if arch in ATTN else ""
                z = np.load(DATA / arch / f"{scenario}_kvu{unified}{suffix}.npz")
                got = replay(dev, z, bool(unified))
                e_llama, e_cpu = rel_err(got, z["logits"]), rel_err(got, replay(cpu, z, bool(unified)))
                if not (e_llama <= 1e-3 and e_cpu <= 1e-4):
                    where = f"{arch} {scenario} kvu{unified}"
                    failed.append(f"{where}: {e_llama:.2e} off llama.cpp, {e_cpu:.2e} off the CPU")
    assert not failed, "\n".join(failed)


def check_seeded_sampling(device: str, quick: bool = False) -> None:
    """The same seed samples the same tokens on the device as on the CPU (logits go to the CPU
    in float32 for sampling)."""
    runs = []
    for d in ("cpu", device):
        m = _tiny("llama", d)
        ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=256, n_seq_max=1))
        sampler = kvtool.Sampler(kvtool.SamplerParams(seed=1234, temp=0.9))
        prompt = [1, 5, 9, 14, 3]
        logits = kvtool.decode_tokens(ctx, prompt, 0, 0)
        out: list[int] = []
        for i in range(8 if quick else 32):
            t = sampler.sample(logits)
            sampler.accept(t)
            out.append(t)
            logits = kvtool.decode_tokens(ctx, [t], 0, len(prompt) + i)
        runs.append(out)
    assert runs[0] == runs[1], runs


def check_smollm2_greedy(device: str, quick: bool = False) -> None:
    """SmolLM2 (a real model) in f32 weights on the device: llama.cpp's greedy tokens up to its
    first near-tie (the rule of tests/kvtool/test_real_smollm2.py), and the default (bf16 on
    CUDA) agreeing with the CPU on the first tokens of every prompt."""
    for weights in ("f32", "auto"):
        m = kvtool.load_model("smollm2", weights=weights, device=device)
        runs = json.loads((SMOLLM2 / "greedy_faoff.json").read_text())["greedy"]
        for r in runs[:1] if quick else runs:
            gaps = r["generated_top1_minus_top2"]
            must = next((i for i, g in enumerate(gaps) if g < 0.5), len(gaps))
            if weights == "auto":
                must = min(must, 4)  # bf16 weights: the first tokens, not the whole run
            ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=2048, n_seq_max=1, kv_unified=True))
            logits = kvtool.decode_tokens(ctx, r["prompt_ids"], 0, 0)
            got, pos = [], len(r["prompt_ids"])
            for _ in range(must):
                t = int(torch.argmax(logits))
                got.append(t)
                logits = kvtool.decode_tokens(ctx, [t], 0, pos)
                pos += 1
            assert got == r["generated_ids"][:must], (weights, r["prompt"][:40])


def check_decode_graphs(device: str, quick: bool = False) -> None:
    """Decode steps replayed from CUDA graphs (kvtool/graphs.py) give what op-by-op compute
    gives: three sequences decoding greedily together, in both KV modes, for both attention
    architectures, float and quantized caches; the steps were replayed, and no graph was turned
    off (warnings are errors)."""
    # the architectures whose forward splits (the hybrids' does not); tiny gemma3's heads of 32
    # take block types
    for arch, tk, tv in (("llama", "f16", "f16"), ("gemma3", "f16", "f16"), ("gemma3", "q8_0", "q8_0"),
                         ("gemma3", "q5_1", "iq4_nl")):  # fmt: skip
        m = _tiny(arch, device)
        for unified in (False, True):
            runs = []
            for graphs in (True, False):
                p = kvtool.ContextParams(
                    n_ctx=1024, n_seq_max=3, kv_unified=unified, cuda_graphs=graphs, type_k=tk, type_v=tv
                )
                ctx = kvtool.Context(m, p)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    runs.append(np.concatenate(list(greedy_steps(ctx, 3, 4, 8 if quick else 40))))
                if graphs:
                    assert ctx.graphs is not None and ctx.graphs.on, arch
                    assert ctx.graphs.n_replayed >= (6 if quick else 38), (arch, ctx.graphs.n_replayed)
            graph, eager = runs
            assert np.array_equal(graph.argmax(-1), eager.argmax(-1)), (arch, tk, tv, unified)  # fed back
            assert rel_err(graph, eager) <= 1e-5, (arch, tk, tv, unified)


def greedy_steps(
    ctx: kvtool.Context, n_seq: int, n_prompt: int, n_gen: int, rm_at: int = -1, reload_at: int = -1
) -> Iterator[np.ndarray]:
    """Every sequence's prompt in one batch, then greedy decode steps of all sequences together
    (sequence 1 drops its last 3 positions before step `rm_at`; the context is saved, cleared
    and loaded again before step `reload_at`); the logits of each step."""
    b = kvtool.Batch()
    for s in range(n_seq):
        for i in range(n_prompt):
            b.add((7 * s + 3 * i + 1) % 50, i, [s], i == n_prompt - 1)
    ctx.decode(b)
    pos = [n_prompt] * n_seq
    for step in range(n_gen):
        logits = ctx.logits()
        yield logits.numpy().copy()
        if step == rm_at:
            ctx.memory.seq_rm(1, pos[1] - 3, -1)
            pos[1] -= 3
        if step == reload_at:
            data = ctx.state_get_data()
            ctx.clear()
            ctx.state_set_data(data)
        b = kvtool.Batch()
        for s in range(n_seq):
            b.add(int(logits[s].argmax()), pos[s], [s], True)
            pos[s] += 1
        ctx.decode(b)
    yield ctx.logits().numpy().copy()


CHECKS = [check_tiny_scenarios, check_seeded_sampling, check_decode_graphs, check_smollm2_greedy]


def check_all(device: str, real: bool = True) -> None:
    for check in CHECKS:
        if check is check_smollm2_greedy and not real:
            continue
        check(device)
        print(f"{check.__name__}: ok on {device}")
