"""Each op of kvtool's forward fed llama.cpp's own input and compared with llama.cpp's output, for
one prompt of a llama-family or Gemma 3 model: relative error ||kvtool - llama.cpp|| /
||llama.cpp|| per op, worst and median over the layers. Where an op gives llama.cpp's bits it
prints 0; the quantized matmuls differ in the order of float additions.

    cc -O2 benchmarks/llama_tensors.c ... -o llama_tensors    (its header says how)
    ./llama_tensors MODEL.gguf DUMP TOKEN...
    .venv/bin/python benchmarks/ops_vs_llama.py MODEL DUMP [--weights auto]

MODEL is the same GGUF file (or a cached model's name); DUMP the folder llama_tensors wrote for
the same tokens (flash attention off, F32 K/V: llama.cpp's teacher-forced reference settings).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import kvtool
from kvtool.models.layers import geglu, gelu_ggml, swiglu_normed
from kvtool.models.rope import apply_rope


class Dump:
    """llama.cpp's tensors by name (and op), as llama_tensors.c wrote them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.entries: dict[str, list[tuple[str, str, list[int]]]] = defaultdict(list)
        self.order: list[tuple[str, str, str, list[int]]] = []
        for line in (folder / "index.txt").read_text().splitlines():
            num, name, op, ne = line.split("\t")
            shape = [int(x) for x in ne.split()]
            self.entries[name].append((num, op, shape))
            self.order.append((num, name, op, shape))

    def _load(self, num: str, shape: list[int]) -> torch.Tensor:
        a = np.fromfile(self.folder / f"{num}.bin", dtype=np.float32)
        return torch.from_numpy(a.reshape(shape[::-1]).squeeze().copy())

    def get(self, name: str, op: str | None = None) -> torch.Tensor:
        num, _, shape = next(e for e in self.entries[name] if op is None or e[1] == op)
        return self._load(num, shape)

    def after(self, name: str, op: str, nth_op: str) -> torch.Tensor:
        """The first tensor with op `nth_op` computed after `name` (`op`): unnamed nodes."""
        num = next(e[0] for e in self.entries[name] if e[1] == op)
        nxt = next(e for e in self.order if e[0] > num and e[2] == nth_op)
        return self._load(nxt[0], nxt[3])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float((a - b).norm() / b.norm())


def attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64: q [n, H, d], k and v [n, Hkv, d] -> [n, H * d]."""
    n, g = q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s + torch.triu(torch.full((n, n), -float("inf"), dtype=torch.float64), 1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(n, -1)


def compare(model: kvtool.Model, d: Dump, ids: list[int]) -> dict[str, list[float]]:
    m = model.impl
    hp, ops, n = m.hp, m.ops, len(ids)
    gemma = hasattr(m, "q_scale")
    out: dict[str, list[float]] = defaultdict(list)
    emb = m.tok_embd(torch.tensor(ids))
    out["token embedding"].append(
        rel(emb * m.embd_scale if gemma else emb, d.get("inp_scaled" if gemma else "embd"))
    )
    for il in range(hp.n_layer):
        L, rope = m.layers[il], m.rope(il)
        rot = rope.rotation(torch.arange(n))
        x_in = d.get("inp_scaled" if gemma else "embd") if il == 0 else d.get(f"l_out-{il - 1}")
        out["RMS norm (attention)"].append(
            rel(ops.rms_norm_ggml(x_in, L.attn_norm, hp.eps), d.get(f"attn_norm-{il}"))
        )
        q, k, v = L.wqkv(d.get(f"attn_norm-{il}"))
        for name, got in (("Q", q), ("K", k), ("V", v)):
            out[f"{name} matmul"].append(rel(got, d.get(f"{name}cur-{il}", "MUL_MAT")))
        q_in = d.get(f"Qcur-{il}", "MUL_MAT").reshape(n, hp.n_head, -1)
        k_in = d.get(f"Kcur-{il}", "MUL_MAT").reshape(n, hp.n_head_kv[il], -1)
        if gemma:
            out["Q head norm"].append(
                rel(ops.rms_norm_ggml(q_in, L.q_norm, hp.eps), d.get(f"Qcur_normed-{il}"))
            )
            out["K head norm"].append(
                rel(ops.rms_norm_ggml(k_in, L.k_norm, hp.eps), d.get(f"Kcur_normed-{il}"))
            )
            q_in = d.get(f"Qcur_normed-{il}").reshape(n, hp.n_head, -1)
            k_in = d.get(f"Kcur_normed-{il}").reshape(n, hp.n_head_kv[il], -1)
        q_rot, k_rot = d.get(f"Qcur-{il}", "ROPE"), d.get(f"Kcur-{il}", "ROPE")
        out["RoPE (Q)"].append(rel(apply_rope(q_in, rot, rope), q_rot))
        out["RoPE (K)"].append(rel(apply_rope(k_in, rot, rope), k_rot))
        scale = m.kq_scale if not gemma else 1.0
        if gemma:
            q_scaled = d.after(f"Qcur-{il}", "ROPE", "SCALE")
            out["Q scale"].append(rel(q_rot * m.q_scale, q_scaled))
            q_rot = q_scaled
        v_rows = d.get(f"Vcur-{il}", "MUL_MAT").reshape(n, hp.n_head_kv[il], -1)
        att = d.get(f"kqv_out-{il}")
        out["attention: llama.cpp's against float64"].append(
            rel(
                att,
                attention_f64(
                    q_rot.reshape(n, hp.n_head, -1), k_rot.reshape(n, hp.n_head_kv[il], -1), v_rows, scale
                ),
            )
        )
        wo_ref = d.after(f"kqv_out-{il}", "CONT", "MUL_MAT")
        out["output matmul (attention)"].append(rel(L.wo(att), wo_ref))
        ffn_in = d.get(f"sa_out-{il}" if gemma else f"ffn_inp-{il}")
        if gemma:
            post = ops.rms_norm_ggml(wo_ref, L.attn_post_norm, hp.eps)
            out["RMS norm (after attention)"].append(rel(post, d.get(f"attn_post_norm-{il}")))
        out["RMS norm (FFN)"].append(
            rel(ops.rms_norm_ggml(ffn_in, L.ffn_norm, hp.eps), d.get(f"ffn_norm-{il}"))
        )
        gate, up = L.ffn_gate_up(d.get(f"ffn_norm-{il}"))
        out["gate matmul"].append(rel(gate, d.get(f"ffn_gate-{il}")))
        out["up matmul"].append(rel(up, d.get(f"ffn_up-{il}")))
        g_ref, u_ref = d.get(f"ffn_gate-{il}"), d.get(f"ffn_up-{il}")
        if gemma:
            out["GELU product"].append(rel(gelu_ggml(g_ref) * u_ref, d.get(f"ffn_geglu-{il}")))
            hidden = d.get(f"ffn_geglu-{il}")
        else:
            out["SwiGLU product (torch's SiLU)"].append(rel(F.silu(g_ref) * u_ref, d.get(f"ffn_swiglu-{il}")))
            hidden = d.get(f"ffn_swiglu-{il}")
        out["down matmul"].append(rel(L.ffn_down(hidden), d.get(f"ffn_out-{il}")))
        if gemma:  # the feed-forward in one compiled call: its parts' last bits cross int8 steps
            whole = geglu(d.get(f"ffn_norm-{il}"), L.ffn_gate_up, L.ffn_down)
        else:
            whole = swiglu_normed(ffn_in, L.ffn_norm, hp.eps, L.ffn_gate_up, L.ffn_down)
        out["the whole feed-forward"].append(rel(whole, d.get(f"ffn_out-{il}")))
        if gemma:
            post = ops.rms_norm_ggml(d.get(f"ffn_out-{il}"), L.ffn_post_norm, hp.eps)
            out["RMS norm (after FFN)"].append(rel(post, d.get(f"ffn_post_norm-{il}")))
    last = d.get(f"l_out-{hp.n_layer - 1}")
    out["RMS norm (output)"].append(rel(ops.rms_norm_ggml(last, m.output_norm, hp.eps), d.get("result_norm")))
    out["logit matmul"].append(rel(m.output(d.get("result_norm")), d.get("result_output")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the GGUF file or a cached model's name")
    ap.add_argument("dump", type=Path, help="the folder llama_tensors wrote")
    ap.add_argument("--weights", default="auto")
    a = ap.parse_args()
    model = kvtool.load_model(a.model, weights=a.weights)
    tokens = (a.dump / "tokens.txt").read_text().split()
    res = compare(model, Dump(a.dump), [int(t) for t in tokens])
    print(f"{a.model} ({model.arch}), {len(tokens)} tokens, --weights {a.weights}: relative error per op")
    for name, values in res.items():
        print(f"  {name:40s} worst {max(values):.2e}  median {float(np.median(values)):.2e}")


if __name__ == "__main__":
    main()
