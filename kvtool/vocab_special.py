"""Special token ids, token attributes and the end-of-generation set, as llama.cpp's vocab load builds them.

GGUF files carry only a token type per token and a few special ids; llama.cpp completes them by
looking for well-known token texts (`<|im_end|>`, `<end_of_turn>`, ...). Those lists are mirrored here.
"""

from __future__ import annotations

import re
from enum import IntFlag

import numpy as np

from kvtool.vocab_order import iteration_rank, std_sort


class Attr(IntFlag):
    """llama_token_attr bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# GGUF token_type 0..6 -> attribute (0 = undefined, anything else too)
_TYPE_TO_ATTR = np.array(
    [Attr.UNDEFINED, Attr.NORMAL, Attr.UNKNOWN, Attr.CONTROL, Attr.USER_DEFINED, Attr.UNUSED, Attr.BYTE],
    np.int32,
)

# Special ids llama.cpp reads from GGUF, in its order; the deprecated FIM keys come last and win.
SPECIAL_KEYS = {
    "bos": ("bos_token_id",),
    "eos": ("eos_token_id",),
    "eot": ("eot_token_id",),
    "eom": ("eom_token_id",),
    "unk": ("unknown_token_id",),
    "sep": ("seperator_token_id",),
    "pad": ("padding_token_id",),
    "mask": ("mask_token_id",),
    "fim_pre": ("fim_pre_token_id", "prefix_token_id"),
    "fim_suf": ("fim_suf_token_id", "suffix_token_id"),
    "fim_mid": ("fim_mid_token_id", "middle_token_id"),
    "fim_pad": ("fim_pad_token_id",),
    "fim_rep": ("fim_rep_token_id",),
    "fim_sep": ("fim_sep_token_id",),
}

# Texts that fill a special id the GGUF left unset (and mark the token as control).
_BY_TEXT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip

# Tokens that end generation whatever the GGUF says.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>",
    "[e~[",
)  # fmt: skip

# gpt-oss: rendered even when special tokens are not
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def token_attrs(token_types: np.ndarray | None, n_tokens: int) -> np.ndarray:
    """Attribute bits per token from GGUF `token_type` (all NORMAL when absent)."""
    if token_types is None:
        return np.full(n_tokens, int(Attr.NORMAL), np.int32)
    types = np.asarray(token_types[:n_tokens], np.int64)
    return np.where((types >= 0) & (types < len(_TYPE_TO_ATTR)), _TYPE_TO_ATTR[np.clip(types, 0, 6)], 0)


def complete_specials(
    ids: dict[str, int | None], token_to_id: dict[str, int], texts: list[str], attrs: np.ndarray
) -> set[int]:
    """Fill unset special ids by token text, update `attrs` in place and return the EOG set.

    llama.cpp scans its hash map, so when several texts match, the first one it meets wins:
    vocab_order replays that order (SmolLM2: `<|endoftext|>`=0 before `<|im_end|>`=2).
    """
    control, unused = int(Attr.CONTROL), int(Attr.UNUSED)
    found = {
        kind: [token_to_id[t] for t in texts_ if t in token_to_id]
        for kind, texts_ in _BY_TEXT.items()
        if ids.get(kind) is None
    }
    tied = {tid for cands in found.values() if len(cands) > 1 for tid in cands}
    rank = iteration_rank([t.encode() for t in texts], tied) if tied else {}
    for kind, cands in found.items():
        if cands:
            ids[kind] = min(cands, key=lambda tid: rank.get(tid, 0))
            attrs[ids[kind]] |= control
    for tid in np.nonzero(attrs & control)[0].tolist():
        if "unused" in texts[tid]:
            attrs[tid] |= unused

    def known(*kinds: str) -> set[int]:
        return {tid for k in kinds if (tid := ids.get(k)) is not None}

    eog = known("fim_pad", "fim_rep", "fim_sep")
    for text in _EOG_TEXTS:
        if (eog_tid := token_to_id.get(text)) is not None:
            eog.add(eog_tid)
            attrs[eog_tid] |= control
    for text in _ALWAYS_RENDERED:
        if text in token_to_id:
            attrs[token_to_id[text]] = int(Attr.USER_DEFINED)
    eog |= known("eos", "eot", "eom")

    def eog_id(text: str) -> int | None:
        tid = token_to_id.get(text)
        return tid if tid in eog else None

    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
    end = eog_id("<|end|>")
    has = {t for t in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>") if eog_id(t) is not None}
    calls = bool(has & {"<|call|>", "<|calls|>"})
    if end is not None and calls and ("<|return|>" in has or "<|flush|>" in has):
        eog.discard(end)
        attrs[end] = int(Attr.USER_DEFINED)
    # gemma4 / paddleocr: "</s>" is an ordinary token when "<|tool_response>" exists
    s_id = eog_id("</s>")
    if s_id is not None and eog_id("<|tool_response>") is not None:
        eog.discard(s_id)
        attrs[s_id] = int(Attr.NORMAL)
    return eog


class SpecialSplitter:
    """llama.cpp's tokenizer_st_partition: cut special-token texts out of raw text.

    Tokens are taken longest (in bytes) first over the whole text, each one splitting every
    remaining text fragment at all its (non-overlapping, leftmost) occurrences. Which specials
    occur at all is found first by walking a prefix set from the positions where one could start.
    """

    def __init__(self, texts: list[str], special_ids: list[int], hidden: set[int]) -> None:
        self._ids = sorted(special_ids)  # llama.cpp's cache before sorting: ascending ids
        self._size = {tid: len(texts[tid].encode()) for tid in self._ids}
        self._by_text = {texts[tid]: tid for tid in self._ids}
        self._prefixes = {t[:k] for t in self._by_text for k in range(1, len(t) + 1)}
        starts = sorted({t[0] for t in self._by_text})
        self._starts = re.compile("[" + "".join(map(re.escape, starts)) + "]") if starts else None
        self._texts = texts
        self._hidden = hidden  # control/unknown tokens: split out only when parse_special
        self._rank: dict[int, int] | None = None

    def _order(self, found: set[int]) -> list[int]:
        """`found` in llama.cpp's processing order: by length, and among equal lengths as its
        (unstable) std::sort left them, which matters when such tokens overlap in the text."""
        sizes = [self._size[tid] for tid in found]
        if len(set(sizes)) == len(sizes):
            return sorted(found, key=lambda tid: -self._size[tid])
        if self._rank is None:
            order = std_sort([-self._size[tid] for tid in self._ids])
            self._rank = {self._ids[i]: r for r, i in enumerate(order)}
        return sorted(found, key=self._rank.__getitem__)

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        """Fragments of `text`: strings to tokenize and ids of the special tokens between them."""
        found: set[int] = set()
        if self._starts is not None:
            prefixes, by_text = self._prefixes, self._by_text
            for m in self._starts.finditer(text):
                i = j = m.start()
                while j < len(text) and text[i : j + 1] in prefixes:
                    j += 1
                    tid = by_text.get(text[i:j])
                    if tid is not None and (parse_special or tid not in self._hidden):
                        found.add(tid)
        frags: list[str | int] = [text]
        for tid in self._order(found):
            tok, split = self._texts[tid], []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    split.append(frag)
                    continue
                for k, part in enumerate(frag.split(tok)):
                    if k:
                        split.append(tid)
                    if part:
                        split.append(part)
            frags = split
        return frags
