"""Byte-level BPE (`tokenizer.ggml.model = gpt2`) built on Hugging Face `tokenizers`.

llama.cpp splits text with a list of regexes chosen by `tokenizer.ggml.pre`: each regex
cuts every piece left by the previous one into matches and the gaps between them. A
`Split(behavior="isolated")` per regex does exactly that, then ByteLevel maps bytes to the
GPT-2 alphabet and the BPE model applies the GGUF merges by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from kvtool.errors import TokenizerError

# llama.cpp runs this one through a hand-written splitter that also takes a final `\s+`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_CASED = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_GPT4O_UPPER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = f"{_GPT4O_CASED}{_CONTRACTIONS}?|{_GPT4O_UPPER}{_CONTRACTIONS}?|\\p{{N}}{{1,3}}|{_TAIL}"
_TEKKEN = f"{_GPT4O_CASED}|{_GPT4O_UPPER}|\\p{{N}}|{_TAIL}"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Cased Latin/Greek/Cyrillic/... letters of deepseek-llm's tokenizer.json, as code point ranges.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)


@dataclass(frozen=True)
class BpePre:
    """How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token skips the merges
    clean_spaces: bool = True  # detokenize removes " ?" " ," " 's" ... (clean_up_tokenization_spaces)
    add_bos: bool = False  # default when the GGUF has no add_bos_token


_STARCODER = BpePre((r"\p{N}", _GPT2))
_GPT2_PRE = BpePre((_GPT2,))
_LLAMA3_PRE = BpePre((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = BpePre((_QWEN2,), clean_spaces=False)
_DEFAULT = BpePre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_BLOOM = (r" ?[^(\s|.,!?…。，、।۔،)]+",)

_GROUPS: list[tuple[tuple[str, ...], BpePre]] = [
    (("default",), _DEFAULT),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3_PRE),
    (("dbrx", "smaug-bpe"), BpePre((_LLAMA3,))),
    (("glm4", "chatglm-bpe"), BpePre((_LLAMA3,))),
    (
        ("deepseek-llm",),
        BpePre(
            (
                "[\r\n]",
                f"\\s?[{_DEEPSEEK_LETTERS}]+",
                "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                r"\s+$",
                _CJK,
                r"\p{N}+",
            ),
            clean_spaces=False,
        ),
    ),
    (("deepseek-coder",), BpePre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), clean_spaces=False)),
    (("falcon",), BpePre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (
        (
            "gpt-2",
            "gpt2",
            "mpt",
            "olmo",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
        ),
        _GPT2_PRE,
    ),
    (("trillion", "granite-docling"), BpePre((_GPT2,), clean_spaces=False)),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), _STARCODER),
    (("smollm", "command-r"), BpePre(_STARCODER.regexes, clean_spaces=False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"), _QWEN2_PRE),
    (("stablelm2", "megrez"), BpePre((_QWEN2,))),
    (("qwen35",), BpePre((_QWEN35,), clean_spaces=False)),
    (("seed-coder",), BpePre((_SEED_CODER,), clean_spaces=False)),
    (("grok-2",), BpePre((_QWEN2,), clean_spaces=False)),
    (("gpt-4o", "llama4"), BpePre((_GPT4O,), clean_spaces=False)),
    (("tekken",), BpePre((_TEKKEN,), ignore_merges=True, clean_spaces=False, add_bos=True)),
    (("bloom", "gpt3-finnish"), BpePre(_BLOOM)),
    (("poro-chat",), BpePre(_BLOOM, clean_spaces=False)),
]
PRE_TOKENIZERS: dict[str, BpePre] = {name: pre for names, pre in _GROUPS for name in names}


def bpe_pre(name: str) -> BpePre:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value ("" means llama.cpp's default)."""
    pre = PRE_TOKENIZERS.get(name or "default")
    if pre is None:
        raise TokenizerError(f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre)")
    return pre


def _gpt2_bytes() -> list[str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    return [chars[b] for b in range(256)]


BYTE_CHARS = _gpt2_bytes()
BYTE_DECODER = {ch: b for b, ch in enumerate(BYTE_CHARS)}


class ByteLevelBpe:
    """Maps one raw text fragment to llama.cpp's BPE token ids through a `tokenizers` pipeline.

    llama.cpp keeps symbols that are not tokens (a byte character missing from the vocabulary, a
    merge whose result is missing) and only at the end replaces each by the tokens of its single
    ASCII bytes. `tokenizers` would drop the former and refuse the latter, so both get ids past
    the vocabulary here and are expanded after encoding.
    """

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: BpePre) -> None:
        pairs: dict[tuple[str, str], None] = {}  # ordered set: a repeated merge keeps its first rank
        for merge in merges:
            cut = merge.find(" ", 1)  # as llama.cpp: the first space after position 0 separates the pair
            if cut > 0:
                pairs.setdefault((merge[:cut], merge[cut + 1 :]))
        vocab = dict(token_to_id)
        n_vocab = len(vocab)
        for text in [*BYTE_CHARS, *(a + b for a, b in pairs)]:
            vocab.setdefault(text, len(vocab))
        # a merge with a side that no symbol can ever be never applies
        usable = [(a, b) for a, b in pairs if a in vocab and b in vocab]
        extra = sorted((i, t) for t, i in vocab.items() if i >= n_vocab)
        self._n_vocab = n_vocab
        self._fallback = [
            [token_to_id[ch] for ch in t if ch < "\x80" and ch in token_to_id] for _, t in extra
        ]
        self._tok = Tokenizer(models.BPE(vocab, usable, ignore_merges=pre.ignore_merges))
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        self._tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(False, use_regex=False)]
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of one fragment (no special tokens inside)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        n = self._n_vocab
        if ids and max(ids) >= n:
            ids = [t for i in ids for t in ((i,) if i < n else self._fallback[i - n])]
        return ids
