"""Tiny random GGUF models of the llama family (llama, qwen2, qwen3, phi3, granite, olmo2) and of
gemma2, in dimensions and options the oracle's files do not have: the tensors each architecture
has, written from llama.cpp's load_arch_tensors (src/models/<arch>.cpp), not from kvtool's code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.helpers.tiny_gguf import add_spm_vocab, finish, random_weights


@dataclass(frozen=True)
class TinyArch:
    arch: str
    n_embd: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 0  # 0: n_embd // n_head, no key_length written
    n_ff: int = 96
    rope_base: float = 10000.0
    tied: bool = False
    fused_qkv: bool = False  # one attn_qkv tensor instead of attn_q, attn_k, attn_v
    biases: bool = (
        False  # Q/K/V biases (fused or apart), and output and feed-forward biases where the arch has them
    )
    rope_factors: str = ""  # "rope_freqs" (llama) or "short_long" (phi3's LongRoPE factors)
    keys: tuple[tuple[str, Any], ...] = ()  # more `{arch}.<key>` values
    seed: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def write_tiny_arch(path: Path, cfg: TinyArch) -> Path:
    rng = np.random.default_rng(cfg.seed)
    lin, norm = random_weights(rng)
    a, E, F, hd = cfg.arch, cfg.n_embd, cfg.n_ff, cfg.hd
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    w = gguf.GGUFWriter(str(path), a)
    w.add_name(f"tiny-{a}" if a != "phi3" else "tiny-phi")  # llama.cpp wants special tokens of a "phi3"
    w.add_block_count(cfg.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    if cfg.head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in cfg.keys:  # llama.cpp reads counts as uint32
        vtype = gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.get_type(value)
        w.add_key_value(f"{a}.{key}", value, vtype)
    n_vocab = add_spm_vocab(w)

    def bias(n: int) -> np.ndarray:
        return (0.3 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, E)).astype(np.float32))
    if cfg.rope_factors == "rope_freqs":
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, hd // 2).astype(np.float32))
    elif cfg.rope_factors == "short_long":
        w.add_tensor("rope_factors_short.weight", rng.uniform(1.0, 3.0, hd // 2).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", rng.uniform(4.0, 40.0, hd // 2).astype(np.float32))
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        if a != "olmo2":
            w.add_tensor(p + "attn_norm.weight", norm(E))
        if cfg.fused_qkv:
            w.add_tensor(p + "attn_qkv.weight", lin(q + 2 * kv, E))
            if cfg.biases:
                w.add_tensor(p + "attn_qkv.bias", bias(q + 2 * kv))
        else:
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(p + name + ".weight", lin(n, E))
                if cfg.biases:
                    w.add_tensor(p + name + ".bias", bias(n))
        w.add_tensor(p + "attn_output.weight", lin(E, q))
        if cfg.biases and a in ("llama", "granite"):
            w.add_tensor(p + "attn_output.bias", bias(E))
        if a == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        if a == "olmo2":
            w.add_tensor(p + "attn_q_norm.weight", norm(q))
            w.add_tensor(p + "attn_k_norm.weight", norm(kv))
        if a in ("olmo2", "gemma2"):
            w.add_tensor(p + "post_attention_norm.weight", norm(E))
            w.add_tensor(p + "post_ffw_norm.weight", norm(E))
        if a != "olmo2":
            w.add_tensor(p + "ffn_norm.weight", norm(E))
        if a == "phi3":
            w.add_tensor(p + "ffn_up.weight", lin(2 * F, E))
        else:
            w.add_tensor(p + "ffn_gate.weight", lin(F, E))
            w.add_tensor(p + "ffn_up.weight", lin(F, E))
        w.add_tensor(p + "ffn_down.weight", lin(E, F))
        if cfg.biases and a in ("llama", "granite"):
            w.add_tensor(p + "ffn_gate.bias", bias(F))
            w.add_tensor(p + "ffn_up.bias", bias(F))
            w.add_tensor(p + "ffn_down.bias", bias(E))
    w.add_tensor("output_norm.weight", norm(E))
    if not cfg.tied:
        w.add_tensor("output.weight", lin(n_vocab, E))
    return finish(w, path)


# Each architecture in options the oracle's tiny models do not have (oracle README section 8).
VARIANTS = {
    "llama": TinyArch("llama", fused_qkv=True, biases=True, rope_factors="rope_freqs", n_head_kv=1, seed=1),
    "qwen2": TinyArch("qwen2", n_head=8, n_head_kv=2, biases=True, tied=True, rope_base=1e6, seed=2),
    "qwen3": TinyArch(
        "qwen3", n_embd=48, n_head=6, n_head_kv=3, head_dim=32, tied=True, rope_base=1e6, seed=3
    ),
    "phi3": TinyArch(
        "phi3",
        n_head_kv=2,
        rope_factors="short_long",
        keys=(
            ("rope.scaling.attn_factor", 1.19),
            ("rope.scaling.original_context_length", 512),
            ("attention.sliding_window", 8),  # as llama.cpp, not applied
        ),
        seed=4,
    ),
    "gemma2": TinyArch(
        "gemma2",
        n_layer=5,
        n_head=4,
        n_head_kv=1,
        head_dim=16,
        tied=True,
        rope_base=1e5,
        keys=(
            ("attention.sliding_window", 5),
            ("attention.sliding_window_pattern", 3),
            ("rope.freq_base_swa", 5000.0),
            ("attn_logit_softcapping", 20.0),
            ("final_logit_softcapping", 15.0),
        ),
        seed=5,
    ),
    "granite": TinyArch(
        "granite",
        fused_qkv=True,
        biases=True,
        keys=(("embedding_scale", 6.0), ("residual_scale", 0.22), ("logit_scale", 8.0)),
        seed=6,
    ),
    "olmo2": TinyArch(
        "olmo2", n_layer=5, n_head_kv=2, rope_base=5e5, keys=(("attention.sliding_window", 6),), seed=7
    ),
}
