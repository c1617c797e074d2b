"""Mutations of a model's contents, not its layout (issue 28): valid GGUF files (written with
gguf.GGUFWriter) whose metadata holds values of other types or out of range, whose vocabulary
has odd token texts, types, scores, merges and special ids, whose chat template is hostile or
not text, and whose weights hold NaN, infinities or huge values (in a quantized tensor: a
block's scale).

`exercise` then uses such a model the way the verbs do: load, render the chat template,
tokenize, render every token's piece, decode a prompt and generate with the sampler. Each must
end normally or with a KvtoolError; any other exception is a defect, and so is a NaN put in a
weight that every token's attention uses when it does not reach the logits (a NaN hidden)."""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType

from tests.fuzz.gguf_rewrite import DROP, rewrite

V = GGUFValueType
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = [
    (5, V.INT32),
    (1.5, V.FLOAT32),
    (True, V.BOOL),
    (["a", "b"], V.ARRAY, V.STRING),
    ("", V.STRING),
    ("{% for %}", V.STRING),
    ("{{ raise_exception('no') }}", V.STRING),
    ("{{ lipsum(n=2000000) }}", V.STRING),
    ("{{ range(10)|slice(2000000000)|list }}", V.STRING),
    ("{{ messages[0]['content'] * 100000000 }}", V.STRING),
    ("{{ ''.__class__.__mro__ }}", V.STRING),
    ("{% for m in messages %}{{ m.role|center(10**9) }}{% endfor %}", V.STRING),
    ("\x1b]0;title\x07{{ messages|length }}", V.STRING),
]
WEIGHTS_EVERY_TOKEN_USES = (
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_v.weight",
    "blk.0.attn_qkv.weight",  # phi3's fused projection
    "blk.0.attn_norm.weight",
)
# where a quantized block keeps its fp16 scale d (ggml-common.h's block layouts): a NaN or an
# infinity there is what a NaN weight is to a float tensor
SCALE_OFFSET = {
    "Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q8_0": 0, "Q4_K": 0, "Q5_K": 0,
    "Q2_K": 80, "Q3_K": 108, "Q6_K": 208, "IQ4_NL": 0, "IQ4_XS": 0,
}  # fmt: skip


@dataclass(frozen=True)
class ContentCase:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    tensor_data: dict[str, np.ndarray] = field(default_factory=dict)
    hides_nan: bool = False  # a NaN every token's attention reads: the logits must be NaN

    def write(self, base: Path, dst: Path) -> Path:
        return rewrite(base, dst, self.overrides, tensor_data=self.tensor_data)


def bpe_base(spm_model: Path, dst: Path) -> Path:
    """The tiny llama with a byte-level BPE vocabulary of the same size, merges, ChatML special
    tokens and a ChatML template (the tiny models' own are SentencePiece and have none)."""
    from kvtool.vocab_bpe import BYTE_CHARS

    n_vocab = len(GGUFReader(str(spm_model)).fields["tokenizer.ggml.tokens"].contents())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pairs = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("Ġw", "o"), ("o", "r")]
    pairs += [("Ġ", "t"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at")]
    words = [a + b for a, b in pairs]
    tokens = [*specials, *BYTE_CHARS, *words][:n_vocab]
    tokens += [f"<|extra_{i}|>" for i in range(n_vocab - len(tokens))]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return rewrite(
        spm_model,
        dst,
        {
            "tokenizer.ggml.model": ("gpt2", V.STRING),
            "tokenizer.ggml.pre": ("smollm", V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
            "tokenizer.ggml.scores": DROP,
            "tokenizer.ggml.merges": ([f"{a} {b}" for a, b in pairs], V.ARRAY, V.STRING),
            "tokenizer.ggml.bos_token_id": (1, V.UINT32),
            "tokenizer.ggml.eos_token_id": (2, V.UINT32),
            "tokenizer.ggml.unknown_token_id": DROP,
            "tokenizer.ggml.add_bos_token": (False, V.BOOL),
            "tokenizer.chat_template": (CHATML, V.STRING),
        },
    )


def _other_values(value: Any) -> list[tuple[Any, ...]]:
    """Values of other types, and edge values of the same type, for one key."""
    out: list[tuple[Any, ...]] = [
        (-1, V.INT32),
        (2**31 - 1, V.INT32),
        (2**40, V.UINT64),
        (0, V.UINT32),
        (float("nan"), V.FLOAT32),
        (float("inf"), V.FLOAT32),
        (-1e30, V.FLOAT32),
        ("x", V.STRING),
        ("", V.STRING),
        (True, V.BOOL),
        ([1, 2, 3], V.ARRAY, V.INT32),
        (["a"], V.ARRAY, V.STRING),
    ]
    if isinstance(value, list) and value:  # the same list cut in half (fewer items than tokens...)
        first = value[0]
        kind = V.STRING if isinstance(first, str) else V.FLOAT32 if isinstance(first, float) else V.INT32
        out.append((value[: len(value) // 2], V.ARRAY, kind))
    return out


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) < 40 else text[:37] + "..."


def content_cases(base: Path, rng: random.Random) -> Iterator[ContentCase]:
    """Every content mutation of `base` once."""
    r = GGUFReader(str(base))
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"}
    for key, f in fields.items():
        try:
            value = f.contents()
        except Exception:
            continue
        for other in _other_values(value):
            yield ContentCase(f"{key} = {_show(other[0])} ({other[1].name})", {key: other})
    for tmpl in TEMPLATES:
        yield ContentCase(f"chat template {_show(tmpl[0])}", {"tokenizer.chat_template": tmpl})
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    for i in sorted(
        {
            0,
            1,
            2,
            len(tokens) - 1,
            *rng.sample(range(len(tokens)), 6),
            *[t for t in range(len(types)) if types[t] == 6][:2],
        }
    ):
        for text in [
            "",
            "<0xZZ>",
            "zz",
            "\x00",
            "a" * 5000,
            "<|im_start|>",
            tokens[(i + 1) % len(tokens)],
            "\x1b[2J",
        ]:
            new = list(tokens)
            new[i] = text
            yield ContentCase(
                f"token {i} text {_show(text)}", {"tokenizer.ggml.tokens": (new, V.ARRAY, V.STRING)}
            )
        for ttype in [0, 2, 3, 4, 5, 6, 7, 99, -1]:
            new_types = list(types)
            new_types[i] = ttype
            yield ContentCase(
                f"token {i} type {ttype}", {"tokenizer.ggml.token_type": (new_types, V.ARRAY, V.INT32)}
            )
    if "tokenizer.ggml.scores" in fields:
        scores = [float(x) for x in fields["tokenizer.ggml.scores"].contents()]
        for bad in (math.nan, math.inf, -math.inf, 1e38):
            new_scores = list(scores)
            new_scores[rng.randrange(len(scores))] = bad
            yield ContentCase(f"a score {bad}", {"tokenizer.ggml.scores": (new_scores, V.ARRAY, V.FLOAT32)})
    if "tokenizer.ggml.merges" in fields:
        merges = list(fields["tokenizer.ggml.merges"].contents())
        for bad in ["", "a", "a b c", "zz yy", " ", "Ġ Ġ", "\x00 \x00"]:
            yield ContentCase(
                f"a merge {_show(bad)}", {"tokenizer.ggml.merges": ([*merges, bad], V.ARRAY, V.STRING)}
            )
    for key in (
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
    ):
        for bad in (len(tokens), 2**31 - 1, 2**32 - 1):
            yield ContentCase(f"{key} = {bad}", {key: (bad, V.UINT32)})
    for t in r.tensors:
        kind = t.tensor_type.name
        if kind not in ("F32", "F16", *SCALE_OFFSET):
            continue
        for bad in (np.nan, np.inf, -np.inf, 3e38):
            data = np.array(t.data).copy()
            if kind in ("F32", "F16"):
                data.reshape(-1)[rng.randrange(data.size)] = bad
                what = f"{t.name} holds {bad}"
            else:  # a block's scale; 3e38 is past fp16: its largest, 65504
                block = GGML_QUANT_SIZES[t.tensor_type][1]
                at = rng.randrange(data.size // block) * block + SCALE_OFFSET[kind]
                data.reshape(-1)[at : at + 2] = np.frombuffer(
                    np.float16(min(bad, 65504.0)).tobytes(), np.uint8
                )
                what = f"{t.name} ({kind}) has a block scale {bad}"
            hides = bool(np.isnan(bad)) and t.name in WEIGHTS_EVERY_TOKEN_USES
            yield ContentCase(what, tensor_data={t.name: data}, hides_nan=hides)


def exercise(path: Path, attention: bool) -> str:
    """Uses the model as the verbs do: "ok", or "error: <message>" for a KvtoolError. Any other
    exception propagates (the defect looked for); a NaN in a weight every token's attention
    reads (`attention`: the model has attention layers) that does not reach the logits is an
    AssertionError."""
    import kvtool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = kvtool.Model(path)
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
            text = model.apply_chat_template(msgs)
            ids = model.tokenize(text, add_special=True, parse_special=True)[:48]
            for t in range(model.n_vocab):
                model.token_to_piece(t, special=True)
                model.is_eog(t)
            model.detokenize(ids)
            ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_batch=64, n_ubatch=64))
            logits = kvtool.decode_tokens(ctx, ids or [0], 0, 0)
            nan = bool(logits.isnan().any())
            sampler = kvtool.Sampler(kvtool.SamplerParams(temp=0.8, seed=1, repeat_penalty=1.1))
            pos = len(ids or [0])
            for _ in range(4):
                tok = sampler.sample(logits)
                sampler.accept(tok)
                model.detokenize([tok])
                logits = kvtool.decode_tokens(ctx, [tok], 0, pos)
                pos += 1
        except kvtool.KvtoolError as e:
            return f"error: {e}"
    if nan:
        raise AssertionError("NaN logits reached the sampler without an error")
    return "ok"


def check(case: ContentCase, outcome: str, attention: bool) -> str | None:
    """The defect in an outcome, or None."""
    if case.hides_nan and attention and outcome == "ok":
        return "a NaN in a weight every token's attention reads did not reach the logits"
    if "\n" in outcome:
        return f"a message of several lines: {outcome[:200]!r}"
    return None


__all__: list[Callable[..., Any] | str] = ["ContentCase", "bpe_base", "check", "content_cases", "exercise"]
