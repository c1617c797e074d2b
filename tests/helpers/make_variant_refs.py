"""Makes tests/data/variants/<arch>.npz: llama.cpp's logits for the tiny models of
tests/helpers/tiny_archs.py VARIANTS (a prompt of 20 tokens, every row an output, then 6 greedy
tokens; F32 K/V, flash attention off). Run from the project root with a llama.cpp build:

    .venv/bin/python -m tests.helpers.make_variant_refs /work/llamacpp/src

It compiles tests/data/variants/llama_logits.c against that build. The files record the hash of
the model each was made with; the tests write the model again and check the hash first.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.helpers.tiny_archs import VARIANTS, write_tiny_arch

OUT = Path(__file__).parent.parent / "data" / "variants"
N_PROMPT, N_GEN = 20, 6


def prompt(seed: int, n_vocab: int = 271) -> list[int]:
    return [int(t) for t in np.random.default_rng(1000 + seed).integers(3, n_vocab, N_PROMPT)]


def model_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(llama_cpp: Path) -> None:
    build = llama_cpp / "build" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "llama_logits"
        inc = [f"-I{llama_cpp / 'include'}", f"-I{llama_cpp / 'ggml' / 'include'}"]
        cmd = ["cc", "-O2", *inc, str(OUT / "llama_logits.c"), f"-L{build}", "-lllama", f"-Wl,-rpath,{build}"]
        subprocess.run([*cmd, "-o", str(exe)], check=True)
        for arch, cfg in VARIANTS.items():
            model = write_tiny_arch(Path(tmp) / f"{arch}.gguf", cfg)
            raw = Path(tmp) / f"{arch}.bin"
            toks = prompt(cfg.seed)
            subprocess.run(
                [str(exe), str(model), str(raw), str(N_GEN), *map(str, toks)], check=True, capture_output=True
            )
            data = raw.read_bytes()
            n_rows, n_vocab = np.frombuffer(data, np.int32, 2)
            tokens = np.frombuffer(data, np.int32, n_rows, 8)
            logits = np.frombuffer(data, np.float32, n_rows * n_vocab, 8 + 4 * n_rows).reshape(
                n_rows, n_vocab
            )
            np.savez_compressed(
                OUT / f"{arch}.npz",
                tokens=tokens,
                logits=logits,
                n_prompt=N_PROMPT,
                model_sha256=model_hash(model),
            )
            print(arch, n_rows, n_vocab, float(np.abs(logits).max()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
