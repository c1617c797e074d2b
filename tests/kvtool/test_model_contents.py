"""A model's own contents (issue 28, item 6): a chat template of another type is a one-line
ModelLoadError (it broke every command with a traceback), a BYTE token whose text is not
`<0xHH>` renders as llama.cpp renders it (generation died on it), and a NaN in the Q or K
weights reaches the logits (the compiled attention wrote a row of NaN scores as zeros, so the
'NaN logits' error never came and the text was silently different)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

import kvtool
from tests.fuzz.gguf_rewrite import rewrite

TINY = Path(__file__).parent.parent / "data" / "tiny" / "models" / "tiny-llama.gguf"


@pytest.mark.parametrize(
    "value",
    [
        (5, GGUFValueType.INT32),
        (1.5, GGUFValueType.FLOAT32),
        (["a", "b"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ],
)
def test_a_chat_template_that_is_no_string_is_one_line(tmp_path: Path, value: tuple) -> None:  # type: ignore[type-arg]
    path = rewrite(TINY, tmp_path / "m.gguf", {"tokenizer.chat_template": value})
    with pytest.raises(kvtool.ModelLoadError, match=r"tokenizer.chat_template = .*: not a string"):
        kvtool.Model(path)


@pytest.mark.parametrize(
    ("text", "byte"),
    [("<0x41 >", 0x41), ("<0xZZ>", 0), ("zz", 0), ("<0x4", 4), ("<0x+F>", 15), ("<0x-1>", 0xFF), ("", 0)],
)
def test_a_byte_token_renders_as_llama_cpp_reads_it(tmp_path: Path, text: str, byte: int) -> None:
    """llama.cpp's token_to_byte: strtol of the two characters after '<0x', base 16, as a char."""
    r = GGUFReader(str(TINY))
    tokens = list(r.fields["tokenizer.ggml.tokens"].contents())
    types = list(r.fields["tokenizer.ggml.token_type"].contents())
    i = types.index(6)  # the first BYTE token
    tokens[i] = text
    path = rewrite(
        TINY,
        tmp_path / "m.gguf",
        {"tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)},
    )
    m = kvtool.Model(path)
    assert m.token_to_piece(i) == bytes([byte])
    assert m.detokenize(list(range(m.n_vocab)))  # every piece renders


@pytest.mark.parametrize("tensor", ["blk.0.attn_q.weight", "blk.0.attn_k.weight"])
def test_a_nan_in_q_or_k_weights_is_the_nan_logits_error(tmp_path: Path, tensor: str) -> None:
    r = GGUFReader(str(TINY))
    data = np.array(next(t for t in r.tensors if t.name == tensor).data).copy()
    data.reshape(-1)[3] = np.nan
    m = kvtool.Model(rewrite(TINY, tmp_path / "m.gguf", {}, tensor_data={tensor: data}))
    ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=256))
    ctx.decode(kvtool.Batch.from_tokens([1, 5, 9, 12], 0, 0))  # a few rows: the compiled kernel
    with pytest.raises(kvtool.KvtoolError, match="NaN logits"):
        kvtool.Sampler(kvtool.SamplerParams(temp=0)).sample(ctx.logits_ith(-1))
