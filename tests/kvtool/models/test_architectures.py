"""Every registered architecture is complete: it has a tiny model (tests/data/tiny), loads it and
decodes; every tensor of the file is one it reads, and every tensor it reads is declared with its
shape (kvtool/models/tensors.py), so that a file missing one, holding one of another shape, or
holding one the architecture does not read is refused in one line naming the tensor; and
docs/architecture.md lists it. A new architecture module is registered by being there, so these
tests take it up without being told."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import kvtool
from kvtool.models import ARCHITECTURES
from tests.fuzz.gguf_rewrite import rewrite

ROOT = Path(__file__).parent.parent.parent.parent
MODELS = ROOT / "tests" / "data" / "tiny" / "models"
ARCHS = sorted(ARCHITECTURES)


def test_the_registry_holds_every_architecture_module() -> None:
    assert {"llama", "gemma3", "qwen2", "qwen3", "phi3", "gemma2", "granite", "olmo2", "mamba"} <= set(ARCHS)
    for arch in ARCHS:  # a module that registers an architecture but has no tiny model fails here
        assert (MODELS / f"tiny-{arch}.gguf").exists(), f"no tiny model for {arch} in tests/data/tiny/models"


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_decodes_its_tiny_model(arch: str) -> None:
    model = kvtool.Model(MODELS / f"tiny-{arch}.gguf")
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=1))
    ctx.decode(kvtool.Batch.from_tokens([5, 9, 13, 17, 21], seq_id=0, pos0=0, logits="all"))
    logits = ctx.logits()
    assert tuple(logits.shape) == (5, model.n_vocab) and bool(logits.isfinite().all())


def _layer0(arch: str) -> list[tuple[str, tuple[int, ...]]]:
    """The file's tensors outside the blocks and of block 0, with their numpy shapes."""
    r = GGUFReader(MODELS / f"tiny-{arch}.gguf")
    return [
        (t.name, tuple(int(n) for n in reversed(t.shape.tolist())))
        for t in r.tensors
        if not re.match(r"blk\.[1-9]", t.name)
    ]


def _one_line_error(path: Path) -> str | None:
    try:
        kvtool.Model(path)
    except kvtool.ModelLoadError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_a_missing_tensor_is_named(arch: str, tmp_path: Path) -> None:
    """Dropping any tensor either leaves a file the architecture reads (an optional tensor: a
    bias, the output tied to the embeddings) or is refused naming a missing tensor: it, or the
    first of what stands in for it (attn_q for a fused attn_qkv, the five lerps for a fused one)."""
    src = MODELS / f"tiny-{arch}.gguf"
    required = 0
    for name, _ in _layer0(arch):
        err = _one_line_error(rewrite(src, tmp_path / "m.gguf", {}, drop_tensors=(name,)))
        if err is not None:
            missing = re.search(r"missing tensor (\S+)", err)
            assert missing is not None, err
            assert missing.group(1) == name or name.split(".")[1].split("_")[0] in missing.group(1), err
            required += 1
    assert required >= 3  # the embedding, the final norm, and block 0's weights at least


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tensor_of_another_shape_is_named(arch: str, tmp_path: Path) -> None:
    src = MODELS / f"tiny-{arch}.gguf"
    for name, shape in _layer0(arch):
        if not name.startswith("blk.0."):
            continue
        bad = np.zeros((*shape[:-1], shape[-1] + 1), np.float32)
        err = _one_line_error(rewrite(src, tmp_path / "m.gguf", {}, tensors={name: bad}))
        assert err is not None and f"tensor {name} is" in err, (name, err)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tensor_the_architecture_does_not_read_is_refused(arch: str, tmp_path: Path) -> None:
    """llama.cpp refuses such a file (wrong number of tensors): a weight kvtool would ignore is
    a part of the computation it would leave out."""
    extra = {"blk.0.attn_extra.weight": np.zeros((4, 8), np.float32)}
    err = _one_line_error(rewrite(MODELS / f"tiny-{arch}.gguf", tmp_path / "m.gguf", {}, tensors=extra))
    assert err is not None and "blk.0.attn_extra.weight" in err, err


def test_docs_list_every_architecture() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [a for a in ARCHS if f"`{a}`" not in text]
    assert not missing, f"docs/architecture.md does not list {missing}"
