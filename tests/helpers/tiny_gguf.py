"""Writes tiny random GGUF models with gguf.GGUFWriter (tests run offline on these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

WORDS = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁hello", "▁world", "s", "ing", "ed"]


@dataclass(frozen=True)
class TinyLlama:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    n_ctx_train: int = 512
    rope_base: float = 10000.0
    seed: int = 0
    chat_template: str | None = None  # tokenizer.chat_template, if any


def spm_vocab(n_vocab: int = 0) -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, 256 byte tokens, then a few words (llama.cpp's SPM conventions), then
    filler words up to n_vocab tokens where that is larger (a real model's vocabulary size)."""
    words = WORDS + [f"▁w{i}" for i in range(n_vocab - 259 - len(WORDS))]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def add_dims(w: gguf.GGUFWriter, cfg: Any, eps: float) -> None:
    """The hyper-parameters every tiny model writes (cfg has TinyLlama's field names)."""
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(eps)


def add_spm_vocab(w: gguf.GGUFWriter, n_vocab: int = 0) -> int:
    """The tiny SPM vocabulary (of n_vocab tokens where that is larger) and its special ids;
    returns n_vocab."""
    tokens, scores, types = spm_vocab(n_vocab)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    return len(tokens)


def random_weights(rng: np.random.Generator) -> tuple:  # type: ignore[type-arg]
    """lin(n_out, n_in): N(0, 1/n_in) weights; norm(n): 1 + N(0, 0.05^2), as the oracle models."""

    def lin(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)

    return lin, norm


def finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama(path: Path, cfg: TinyLlama = TinyLlama()) -> Path:
    rng = np.random.default_rng(cfg.seed)
    hd = cfg.n_embd // cfg.n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    add_dims(w, cfg, 1e-5)
    w.add_rope_dimension_count(hd)
    n_vocab = add_spm_vocab(w)
    if cfg.chat_template is not None:
        w.add_chat_template(cfg.chat_template)
    lin, norm = random_weights(rng)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, cfg.n_embd)).astype(np.float32))
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(cfg.n_embd))
        w.add_tensor(p + "attn_q.weight", lin(cfg.n_head * hd, cfg.n_embd))
        w.add_tensor(p + "attn_k.weight", lin(cfg.n_head_kv * hd, cfg.n_embd))
        w.add_tensor(p + "attn_v.weight", lin(cfg.n_head_kv * hd, cfg.n_embd))
        w.add_tensor(p + "attn_output.weight", lin(cfg.n_embd, cfg.n_head * hd))
        w.add_tensor(p + "ffn_norm.weight", norm(cfg.n_embd))
        w.add_tensor(p + "ffn_gate.weight", lin(cfg.n_ff, cfg.n_embd))
        w.add_tensor(p + "ffn_up.weight", lin(cfg.n_ff, cfg.n_embd))
        w.add_tensor(p + "ffn_down.weight", lin(cfg.n_embd, cfg.n_ff))
    w.add_tensor("output_norm.weight", norm(cfg.n_embd))
    w.add_tensor("output.weight", lin(n_vocab, cfg.n_embd))
    return finish(w, path)
