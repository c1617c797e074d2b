"""Writes a tiny random `gemma3` GGUF with gguf.GGUFWriter (the tests run offline on it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.helpers.tiny_gguf import add_dims, add_spm_vocab, finish, random_weights


@dataclass(frozen=True)
class TinyGemma3:
    n_embd: int = 48
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16  # differs from n_embd / n_head, as in the real models
    n_ff: int = 96
    n_ctx_train: int = 4096
    n_swa: int = 8
    swa_pattern: int | list[bool] | None = 2  # None: no key (llama.cpp's default of 6 applies)
    rope_base: float = 1_000_000.0
    rope_base_swa: float | None = None  # None: no key (10000 applies)
    final_logit_softcapping: float | None = None
    seed: int = 0


def write_tiny_gemma3(path: Path, cfg: TinyGemma3 = TinyGemma3()) -> Path:
    rng = np.random.default_rng(cfg.seed)
    hd = cfg.head_dim
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    add_dims(w, cfg, 1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_sliding_window(cfg.n_swa)
    if cfg.swa_pattern is not None:
        w.add_sliding_window_pattern(cfg.swa_pattern)
    if cfg.rope_base_swa is not None:
        w.add_float32(f"{w.arch}.rope.freq_base_swa", cfg.rope_base_swa)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    n_vocab = add_spm_vocab(w)
    lin, norm = random_weights(rng)  # norms are stored "as used": Gemma's +1 is already in

    w.add_tensor("token_embd.weight", (0.2 * rng.standard_normal((n_vocab, cfg.n_embd))).astype(np.float32))
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(cfg.n_embd))
        w.add_tensor(p + "attn_q.weight", lin(cfg.n_head * hd, cfg.n_embd))
        w.add_tensor(p + "attn_k.weight", lin(cfg.n_head_kv * hd, cfg.n_embd))
        w.add_tensor(p + "attn_v.weight", lin(cfg.n_head_kv * hd, cfg.n_embd))
        w.add_tensor(p + "attn_output.weight", lin(cfg.n_embd, cfg.n_head * hd))
        w.add_tensor(p + "attn_q_norm.weight", norm(hd))
        w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        w.add_tensor(p + "post_attention_norm.weight", norm(cfg.n_embd))
        w.add_tensor(p + "ffn_norm.weight", norm(cfg.n_embd))
        w.add_tensor(p + "ffn_gate.weight", lin(cfg.n_ff, cfg.n_embd))
        w.add_tensor(p + "ffn_up.weight", lin(cfg.n_ff, cfg.n_embd))
        w.add_tensor(p + "ffn_down.weight", lin(cfg.n_embd, cfg.n_ff))
        w.add_tensor(p + "post_ffw_norm.weight", norm(cfg.n_embd))
    w.add_tensor("output_norm.weight", norm(cfg.n_embd))  # output is tied to token_embd
    return finish(w, path)
