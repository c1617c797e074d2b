"""What every model file must satisfy before an architecture reads it.

llama.cpp's loader asks for each tensor with the shape its hyper-parameters imply
(create_tensor) and refuses a file where they differ; kvtool's architectures do the same as they
load (kvtool/models/tensors.py, each tensor named and shaped once, in its architecture's module).
This module checks what holds for any architecture, before any weight is read: no tensor of a
block past block_count, every tensor of a type kvtool reads, a vocab_size that is the tokenizer's.
A mismatch is one ModelLoadError naming the tensor or key and its value.
"""

from __future__ import annotations

import re

from kvtool.backend.linear import check_types
from kvtool.gguf_file import GGUFFile
from kvtool.models.hparams import HParams, bad_key


def _blocks(f: GGUFFile, hp: HParams) -> None:
    """Tensors of a block past block_count mean the count is wrong (llama.cpp: wrong number of
    tensors)."""
    for name in f.tensor_names():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= hp.n_layer:
            raise bad_key(f, f"{f.arch}.block_count", hp.n_layer, f"but the file has tensor {name}")


def check_model(f: GGUFFile, hp: HParams, n_vocab: int) -> None:
    """Raises ModelLoadError unless the file's tensors are all readable and belong to its blocks,
    and `{arch}.vocab_size` (where present) is `n_vocab`, the tokenizer's token count."""
    _blocks(f, hp)
    check_types(f)
    if f.has(f"{f.arch}.vocab_size") and hp.n_vocab != n_vocab:
        raise bad_key(f, f"{f.arch}.vocab_size", hp.n_vocab, f"but the tokenizer has {n_vocab} tokens")
