"""Hyper-parameters that do not match the tensors, or are out of range, are refused at load with
one line naming the key and its value (issue 14, defect 5), for every architecture; before the
fix these crashed at load or at the first decode (ZeroDivisionError, a reshape error, NaN logits,
an allocation of billions of list items)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFValueType

import kvtool
from tests.fuzz.gguf_rewrite import DROP, rewrite

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"
I32, F32, STR = GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
ARR = GGUFValueType.ARRAY

# (architecture, overrides, what the error must name)
CASES = [
    ("llama", {"llama.attention.head_count": 0}, "llama.attention.head_count = 0"),
    ("llama", {"llama.attention.head_count_kv": 3}, "llama.attention.head_count_kv = 3"),
    ("llama", {"llama.attention.head_count": ("four", STR)}, "llama.attention.head_count = 'four'"),
    ("llama", {"llama.embedding_length": 63}, "llama.embedding_length 63"),
    ("llama", {"llama.block_count": 2}, "llama.block_count = 2"),
    ("llama", {"llama.block_count": 4}, "llama.block_count 4"),
    ("llama", {"llama.block_count": 0xFFFFFFFF}, "llama.block_count = 4294967295"),
    ("llama", {"llama.rope.dimension_count": 17}, "llama.rope.dimension_count = 17"),
    ("llama", {"llama.rope.dimension_count": 0}, "llama.rope.dimension_count = 0"),
    ("llama", {"llama.rope.dimension_count": 64}, "llama.rope.dimension_count = 64"),
    ("llama", {"llama.context_length": 0}, "llama.context_length = 0"),
    ("llama", {"llama.context_length": (-5, I32)}, "llama.context_length = -5"),
    ("llama", {"llama.vocab_size": 383}, "llama.vocab_size = 383"),
    ("llama", {"llama.attention.layer_norm_rms_epsilon": float("nan")}, "layer_norm_rms_epsilon = nan"),
    ("llama", {"llama.attention.layer_norm_rms_epsilon": -1.0}, "layer_norm_rms_epsilon = -1.0"),
    ("llama", {"llama.rope.freq_base": 0.0}, "llama.rope.freq_base = 0.0"),
    ("llama", {"llama.feed_forward_length": 100}, "llama.feed_forward_length 100"),
    ("llama", {"llama.feed_forward_length": ([128, 128], ARR)}, "llama.feed_forward_length = an array of 2"),
    ("llama", {"llama.attention.key_length": 8}, "within the head size 8"),
    ("gemma3", {"gemma3.attention.sliding_window": (-1, I32)}, "gemma3.attention.sliding_window = -1"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": ([1, 0, 1], ARR)}, "sliding_window_pattern"),
    ("gemma3", {"gemma3.rope.freq_base_swa": (float("inf"), F32)}, "gemma3.rope.freq_base_swa = inf"),
    ("gemma3", {"gemma3.attention.value_length": 16}, "gemma3.attention.value_length 16"),
    ("mamba", {"mamba.ssm.inner_size": 100}, "mamba.ssm.inner_size 100"),
    ("mamba", {"mamba.ssm.state_size": 0}, "mamba.ssm.state_size = 0"),
    ("mamba", {"mamba.ssm.conv_kernel": 3}, "mamba.ssm.conv_kernel 3"),
    ("mamba", {"mamba.ssm.time_step_rank": DROP}, "missing GGUF key mamba.ssm.time_step_rank"),
    ("mamba2", {"mamba2.ssm.time_step_rank": 7}, "mamba2.ssm.time_step_rank = 7"),
    ("mamba2", {"mamba2.ssm.group_count": 4}, "mamba2.ssm.group_count 4"),
    ("rwkv6", {"rwkv6.wkv.head_size": 7}, "rwkv6.wkv.head_size = 7"),
    ("rwkv6", {"rwkv6.wkv.head_size": 32}, "rwkv6.wkv.head_size 32"),
    ("rwkv6", {"rwkv6.time_mix_extra_dim": 9}, "rwkv6.time_mix_extra_dim 9"),
    ("rwkv6", {"rwkv6.attention.layer_norm_epsilon": float("nan")}, "layer_norm_epsilon = nan"),
    ("rwkv7", {"rwkv7.attention.decay_lora_rank": 8}, "rwkv7.attention.decay_lora_rank 8"),
    ("rwkv7", {"rwkv7.feed_forward_length": 0}, "rwkv7.feed_forward_length = 0"),
    (
        "granitehybrid",
        {"granitehybrid.attention.head_count_kv": ([0, 2, 0], ARR)},
        "head_count_kv = an array",
    ),
    ("granitehybrid", {"granitehybrid.attention.head_count_kv": ([0, 3, 0, 3], ARR)}, "head_count_kv = 3"),
    ("granitehybrid", {"granitehybrid.attention.head_count_kv": ([2, 2, 0, 2], ARR)}, "blk.0.attn_q.weight"),
    ("granitehybrid", {"granitehybrid.ssm.inner_size": 96}, "granitehybrid.ssm.inner_size 96"),
    ("granitehybrid", {"granitehybrid.logit_scale": (float("nan"), F32)}, "granitehybrid.logit_scale = nan"),
    ("lfm2", {"lfm2.shortconv.l_cache": 4}, "lfm2.shortconv.l_cache 4"),
    ("lfm2", {"lfm2.shortconv.l_cache": 1}, "lfm2.shortconv.l_cache = 1"),
    ("lfm2", {"lfm2.attention.head_count_kv": ([0, 2, 0, 2, 2], ARR)}, "head_count_kv = an array of 5"),
]


def _id(case: tuple) -> str:  # type: ignore[type-arg]
    arch, overrides, _ = case
    key, value = next(iter(overrides.items()))
    value = value[0] if isinstance(value, tuple) else value
    return f"{arch}-{key.split('.', 1)[1]}={'drop' if value is DROP else value}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_mismatched_hparams_are_one_line_load_errors(case: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    arch, overrides, names = case
    path = rewrite(MODELS / f"tiny-{arch}.gguf", tmp_path / "m.gguf", overrides)
    with pytest.raises(kvtool.ModelLoadError) as e:
        kvtool.Model(path)
    message = str(e.value)
    assert names in message
    assert "\n" not in message


ARCHS = ["llama", "gemma3", "mamba", "mamba2", "rwkv6", "rwkv7", "granitehybrid", "lfm2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_unchanged_rewrite_loads_and_decodes(arch: str, tmp_path: Path) -> None:
    """The rewrite itself changes nothing: the copy loads and gives the original's logits."""
    path = rewrite(MODELS / f"tiny-{arch}.gguf", tmp_path / "m.gguf", {})
    rows = []
    for p in (MODELS / f"tiny-{arch}.gguf", path):
        ctx = kvtool.Context(kvtool.Model(p), kvtool.ContextParams(n_ctx=256))
        ctx.decode(kvtool.Batch.from_tokens([1, 5, 9], seq_id=0, pos0=0, logits="last"))
        rows.append(ctx.logits())
    assert rows[0].equal(rows[1])


def test_unsupported_tensor_type_is_refused_at_load(tmp_path: Path) -> None:
    """A tensor type kvtool cannot dequantize is named at load, not at the first use (the lazy
    token embedding dequantizes rows only when a token is decoded)."""
    from tests.fuzz.gguf_mutations import Part, read_layout

    path = MODELS / "tiny-llama.gguf"
    lay = read_layout(path)
    part = next(p for p in lay.parts if p.role == "ttype" and p.key == "token_embd.weight")
    data = bytearray(path.read_bytes())
    assert isinstance(part, Part)
    data[part.offset : part.offset + 4] = (16).to_bytes(4, "little")  # IQ2_XXS, same block size as Q4_K
    bad = tmp_path / "m.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(kvtool.ModelLoadError, match=r"token_embd\.weight"):
        kvtool.Model(bad)
