"""Writes a GGUF of a real model's shapes with random weights of one quantization type, for speed
measurements (speed does not depend on the values; llama.cpp and kvtool both load it):

    .venv/bin/python benchmarks/random_model.py qwen3-0.6b Q2_K /tmp/qwen3-0.6b-Q2_K.gguf

Every matrix (the token embedding too, tied output) is of the given type, as `llama-quantize
--pure` writes; norms are F32. The vocabulary is an SPM one of byte tokens and filler words, of
the real model's size. Types gguf can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) hold quantized
random normals; the others random blocks with scales of about the same spread.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.tiny_gguf import add_dims, add_spm_vocab

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rope_base: float
    n_ctx_train: int = 32768


SHAPES = {
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1e6),
}
# llama.cpp's general.file_type for a file of one type (llama_ftype; the K-quants' smallest mix)
FILE_TYPES = {T.Q4_0: 2, T.Q4_1: 3, T.Q8_0: 7, T.Q5_0: 8, T.Q5_1: 9, T.Q2_K: 10, T.Q3_K: 11}
FILE_TYPES |= {T.Q4_K: 14, T.Q5_K: 16, T.Q6_K: 18, T.IQ4_NL: 25, T.IQ4_XS: 30}
# per random-block type: byte offsets of its fp16 scales, and the largest |value| a scale multiplies
_SCALES = {
    T.Q2_K: ([80, 82], 45),
    T.Q3_K: ([108], 128),
    T.IQ4_XS: ([0], 4064),
    T.IQ4_NL: ([0], 127),
    T.Q4_K: ([0, 2], 945),
    T.Q5_K: ([0, 2], 1953),
    T.Q6_K: ([208], 4096),
}


def matrix(qtype: T, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A random [n_out, k] weight of `qtype`, as the GGUF's raw bytes [n_out, row bytes]."""
    if qtype in _SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        b = rng.integers(0, 256, size=(n_out * k // block, size), dtype=np.uint8)
        at, top = _SCALES[qtype]
        for a in at:
            d = np.asarray(rng.uniform(0.5, 2.0, b.shape[0])) / (top * math.sqrt(k))
            b[:, a : a + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        return b.reshape(n_out, -1)
    return quantize((rng.standard_normal((n_out, k)) / math.sqrt(k)).astype(np.float32), qtype)


def write(shape: Shape, qtype: T, path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    s, a = shape, shape.arch
    w = gguf.GGUFWriter(str(path), a)
    w.add_name(f"random-{a}")
    add_dims(w, s, eps=1e-6)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_file_type(FILE_TYPES[qtype])
    add_spm_vocab(w, s.n_vocab)

    def mat(name: str, n_out: int, k: int) -> None:
        w.add_tensor(name, matrix(qtype, n_out, k, rng), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    E, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    mat("token_embd.weight", s.n_vocab, E)
    for il in range(s.n_layer):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", E)
        mat(p + "attn_q.weight", q, E)
        mat(p + "attn_k.weight", kv, E)
        mat(p + "attn_v.weight", kv, E)
        mat(p + "attn_output.weight", E, q)
        norm(p + "attn_q_norm.weight", s.head_dim)
        norm(p + "attn_k_norm.weight", s.head_dim)
        norm(p + "ffn_norm.weight", E)
        mat(p + "ffn_gate.weight", s.n_ff, E)
        mat(p + "ffn_up.weight", s.n_ff, E)
        mat(p + "ffn_down.weight", E, s.n_ff)
    norm("output_norm.weight", E)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in SHAPES or T.__members__.get(sys.argv[2]) not in FILE_TYPES:
        sys.exit(f"usage: random_model.py {{{','.join(SHAPES)}}} TYPE OUT.gguf")
    write(SHAPES[sys.argv[1]], T.__members__[sys.argv[2]], Path(sys.argv[3]))
