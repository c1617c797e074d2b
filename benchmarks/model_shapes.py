"""Random-weight GGUF models of real shapes, for measuring speed without downloading a model.

    .venv/bin/python benchmarks/model_shapes.py llama-3.2-1b Q4_K_M /tmp/llama-1b-q4_k_m.gguf \\
        --llama-quantize /path/to/llama.cpp/build/bin/llama-quantize

Speed depends on the shapes and the weight types, not on the values: the weights are random
(N(0, 1/n_in); norms 1 + N(0, 0.05^2)), the vocabulary is copied from a real GGUF (`--vocab`,
default the model kvtool knows for the architecture: SmolLM2's 49152 tokens for llama shapes,
Gemma 3's 262144 for gemma3), so prompts tokenize as text does and `bench` runs as on a real
model. With `--llama-quantize` a float16 file is written first (streamed, one tensor in memory
at a time) and llama.cpp's llama-quantize makes TYPE from it with its own rules (Q4_K_M puts
some tensors in Q6_K, as for a downloaded Q4_K_M); without it the blocks are written directly,
every matrix in TYPE (one of Q4_0 Q4_1 Q5_0 Q8_0, through gguf.quants, or Q4_K Q5_K Q6_K as
random blocks with small scales; where a row is not a multiple of 256, llama-quantize's fallback
type, as Gemma-3-1B's 1152 needs). The output is tied to the token embedding where the real
model ties it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" or "gemma3" (the architectures both tools run)
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_base: float
    tied: bool
    eps: float
    n_swa: int = 0  # gemma3: the sliding window (its layers by llama.cpp's default pattern of 6)


# Hyper-parameters from each model's config.json.
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 500000.0, True, 1e-5),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 500000.0, True, 1e-5),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 500000.0, False, 1e-5),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 256, 6912, 1000000.0, True, 1e-6, n_swa=512),
}
VOCAB_OF = {"llama": "smollm2", "gemma3": "gemma3-270m"}  # kvtool's names of a GGUF to copy
DIRECT = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    yield "token_embd.weight", (-1, s.n_embd)  # rows: the vocabulary's size
    for il in range(s.n_layer):
        p = f"blk.{il}."
        yield p + "attn_norm.weight", (s.n_embd,)
        yield p + "attn_q.weight", (q, s.n_embd)
        yield p + "attn_k.weight", (kv, s.n_embd)
        yield p + "attn_v.weight", (kv, s.n_embd)
        yield p + "attn_output.weight", (s.n_embd, q)
        if s.arch == "gemma3":
            yield p + "attn_q_norm.weight", (s.head_dim,)
            yield p + "attn_k_norm.weight", (s.head_dim,)
            yield p + "post_attention_norm.weight", (s.n_embd,)
        yield p + "ffn_norm.weight", (s.n_embd,)
        yield p + "ffn_gate.weight", (s.n_ff, s.n_embd)
        yield p + "ffn_up.weight", (s.n_ff, s.n_embd)
        yield p + "ffn_down.weight", (s.n_embd, s.n_ff)
        if s.arch == "gemma3":
            yield p + "post_ffw_norm.weight", (s.n_embd,)
    yield "output_norm.weight", (s.n_embd,)
    if not s.tied:
        yield "output.weight", (-1, s.n_embd)


def copy_vocab(w: gguf.GGUFWriter, src: Path) -> int:
    """The tokenizer keys of `src` into w; returns the vocabulary's size."""
    r = gguf.GGUFReader(src)
    n_vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(field.data)
        else:
            w.add_key_value(key, field.contents(), vtype)
    if not n_vocab:
        sys.exit(f"error: {src} has no tokenizer.ggml.tokens")
    return n_vocab


def add_hparams(w: gguf.GGUFWriter, s: Shape, name: str) -> None:
    """The shape's keys, as llama.cpp's converter writes them."""
    w.add_name(name)
    counts = {
        "block_count": s.n_layer,
        "context_length": 8192,
        "embedding_length": s.n_embd,
        "feed_forward_length": s.n_ff,
        "attention.head_count": s.n_head,
        "attention.head_count_kv": s.n_head_kv,
        "attention.key_length": s.head_dim,
        "attention.value_length": s.head_dim,
    }
    if s.arch == "llama":
        counts["rope.dimension_count"] = s.head_dim
    else:
        counts["attention.sliding_window"] = s.n_swa
    for key, value in counts.items():
        w.add_uint32(f"{s.arch}.{key}", value)
    w.add_float32(f"{s.arch}.rope.freq_base", s.rope_base)
    w.add_float32(f"{s.arch}.attention.layer_norm_rms_epsilon", s.eps)


QType = gguf.GGMLQuantizationType
K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}  # llama-quant.cpp's


def random_blocks(rng: np.random.Generator, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Random K-quant blocks: random bits, small scales (d, dmin) so the values stay in range."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scale = 0.5 / np.sqrt(shape[1]) / (8 if qtype == gguf.GGMLQuantizationType.Q6_K else 16)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # d last; int8 scales of both signs
        b[:, size - 2 :] = np.full((n, 1), scale / 32, dtype=np.float16).view(np.uint8)
    else:  # d, dmin first
        b[:, 0:4] = np.full((n, 2), scale / 63, dtype=np.float16).view(np.uint8)
    return b.reshape(shape[0], -1)


def write(s: Shape, name: str, vocab: Path, out: Path, direct: str | None, seed: int) -> None:
    """The model to `out`: float16 matrices, or every matrix in `direct` (a type name)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), s.arch)
    add_hparams(w, s, name)
    n_vocab = copy_vocab(w, vocab)
    qtype = QType.__members__[direct] if direct else QType.F16
    plan = [(n, tuple(n_vocab if d == -1 else d for d in shape)) for n, shape in tensors(s)]

    def type_of(shape: tuple[int, ...]) -> QType:
        if len(shape) == 1:
            return QType.F32
        if shape[1] % gguf.GGML_QUANT_SIZES[qtype][0]:  # llama-quantize's fallback where rows do not fit
            return FALLBACK[qtype]
        return qtype

    def make(shape: tuple[int, ...]) -> np.ndarray:
        t = type_of(shape)
        if t == QType.F32:
            return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        if t in K_QUANTS:
            return random_blocks(rng, t, shape)
        x = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float32)
        return x.astype(np.float16) if t == QType.F16 else quantize(x, t)

    for tname, shape in plan:  # tensor infos first: the data is then written one tensor at a time
        t = type_of(shape)
        if t in (QType.F16, QType.F32):
            dtype = np.dtype(np.float16 if t == QType.F16 else np.float32)
            w.add_tensor_info(tname, shape, dtype, dtype.itemsize * int(np.prod(shape)))
        else:  # the shape in bytes, as gguf takes a raw tensor's
            row = gguf.quant_shape_to_byte_shape(shape, t)[-1]
            w.add_tensor_info(tname, (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape in plan:
        w.write_tensor_data(make(shape))
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    types = f"llama-quantize's type name (Q4_K_M, Q4_0, Q8_0, ...), or without it one of {DIRECT}"
    ap.add_argument("type", help=types)
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize program")
    ap.add_argument("--vocab", type=Path, help="a GGUF whose tokenizer the model takes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    vocab = a.vocab
    if vocab is None:
        cmd = [sys.executable, "-m", "kvtool.commands", "models", "path", VOCAB_OF[s.arch]]
        vocab = Path(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())
    if a.llama_quantize is None:
        if a.type not in DIRECT:
            sys.exit(f"error: {a.type} needs --llama-quantize (written directly: {', '.join(DIRECT)})")
        write(s, a.shape, vocab, a.out, a.type, a.seed)
        return
    f16 = a.out.with_name(a.out.name + ".f16.tmp")
    try:
        write(s, a.shape, vocab, f16, None, a.seed)
        cmd = [str(a.llama_quantize), str(f16), str(a.out), a.type, str(a.threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            sys.exit(f"error: llama-quantize failed: {tail}")
    finally:
        f16.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
