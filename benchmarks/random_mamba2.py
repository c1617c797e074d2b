"""Writes a Mamba-2 GGUF of a real model's sizes with random weights, for speed measurements of
the recurrent path (kvtool and llama.cpp both load it):

    .venv/bin/python benchmarks/random_mamba2.py Q8_0 /tmp/mamba2-370m-Q8_0.gguf

The sizes are Mamba-2 370M's (d_model 1024, 48 layers, d_inner 2048, d_state 128, one group,
heads of 64); the vocabulary and the rest of the header are the tiny mamba2 model's
(tests/data/tiny/models), so the matrices are the blocks' (about 316M parameters). The tensors
llama-quantize quantizes are of the given type (Q4_0, Q4_1, Q5_0, Q8_0: gguf quantizes them),
the others F32, as `llama-quantize --pure` writes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.quantized import add_tensor, finish, quantizable

T = gguf.GGMLQuantizationType
TINY = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny" / "models" / "tiny-mamba2.gguf"
SIZES = {"embedding_length": 1024, "block_count": 48, "ssm.inner_size": 2048, "ssm.state_size": 128}
SIZES |= {"ssm.group_count": 1, "ssm.time_step_rank": 32, "ssm.conv_kernel": 4}
FILE_TYPES = {T.Q4_0: 2, T.Q4_1: 3, T.Q8_0: 7, T.Q5_0: 8}


def tensors(n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor of the model, float32, in numpy order."""
    s = SIZES
    keys = ("embedding_length", "ssm.inner_size", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank")
    E, di, ds, g, h = (s[k] for k in keys)
    conv = di + 2 * g * ds

    def mat(n_out: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n_out, k)) / math.sqrt(k)).astype(np.float32)

    def vec(n: int, lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, n).astype(np.float32)

    out = {"token_embd.weight": mat(n_vocab, E), "output_norm.weight": vec(E, 0.9, 1.1)}
    out["output.weight"] = mat(n_vocab, E)
    for il in range(s["block_count"]):
        p = f"blk.{il}."
        out |= {
            p + "attn_norm.weight": vec(E, 0.9, 1.1),
            p + "ssm_in.weight": mat(2 * di + 2 * g * ds + h, E),
            p + "ssm_conv1d.weight": mat(conv, s["ssm.conv_kernel"]),
            p + "ssm_conv1d.bias": vec(conv, -0.1, 0.1),
            p + "ssm_dt.bias": np.log(np.expm1(vec(h, 0.001, 0.1))),
            p + "ssm_a": -vec(h, 1.0, 16.0).reshape(h, 1),  # A = -exp(A_log)
            p + "ssm_d": vec(h, 0.5, 1.5).reshape(h, 1),
            p + "ssm_norm.weight": vec(di, 0.9, 1.1).reshape(g, di // g),
            p + "ssm_out.weight": mat(E, di),
        }
    return out


def write(qtype: T, path: Path, seed: int = 0) -> Path:
    reader = gguf.GGUFReader(TINY)
    w = gguf.GGUFWriter(str(path), "mamba2")
    for f in reader.fields.values():
        key = f.name.removeprefix("mamba2.")
        if f.name == "general.architecture" or f.name.startswith(("GGUF.", "tiny_oracle.")):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        value = SIZES.get(key, f.contents())
        value = f"random-mamba2-370m-{qtype.name}" if f.name == "general.name" else value
        value = FILE_TYPES[qtype] if f.name == "general.file_type" else value
        w.add_key_value(f.name, value, f.types[0], sub_type=sub)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)
    for name, x in tensors(n_vocab, rng).items():
        add_tensor(w, name, x, qtype if quantizable(name, x.shape) and x.shape[1] % 32 == 0 else None, rng)
    finish(w)
    return path


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in {t.name for t in FILE_TYPES}:
        print(f"usage: {sys.argv[0]} {{{','.join(t.name for t in FILE_TYPES)}}} OUT.gguf", file=sys.stderr)
        return 2
    path = write(T[sys.argv[1]], Path(sys.argv[2]))
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
