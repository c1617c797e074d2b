"""The tokenizer of a GGUF model, reproducing llama.cpp's llama_vocab token for token.

Two tokenizer models are supported: `gpt2` (byte-level BPE, built on Hugging Face
`tokenizers`, see vocab_bpe.py) and `llama` (SentencePiece-style score merging, see
vocab_spm.py). What is llama.cpp's own lives here: splitting out special tokens before
tokenizing, BOS/EOS and the leading space, token pieces and detokenization.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtool.checks import as_int, as_text
from kvtool.errors import KvtoolError, TokenizerError
from kvtool.vocab_bpe import BYTE_DECODER, ByteLevelBpe, bpe_pre
from kvtool.vocab_special import SPECIAL_KEYS, Attr, SpecialSplitter, complete_specials, token_attrs
from kvtool.vocab_spm import SpmMerger

if TYPE_CHECKING:
    from kvtool.gguf_file import GGUFFile

_SPACE = "\u2581"  # SentencePiece's escaped space
_SPECIAL = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)  # split out before tokenizing
_HIDDEN = int(Attr.CONTROL | Attr.UNKNOWN)  # parsed and rendered only on request


_HEX_PREFIX = re.compile(r"\s*([+-]?)(?:0[xX](?=[0-9a-fA-F]))?([0-9a-fA-F]*)")


def _byte_value(text: str) -> int:
    """A BYTE token's byte as llama.cpp's token_to_byte reads it: strtol(text[3:5], 16), cast to
    a char; a text that is not `<0xHH>` gives what strtol gives (0 when no digit), never an
    error."""
    m = _HEX_PREFIX.match(text[3:5])
    v = int(m[2], 16) if m and m[2] else 0
    return (-v if m and m[1] == "-" else v) & 0xFF


class Vocab:
    """Token texts, attributes and special ids of a model, with llama.cpp's tokenize/detokenize."""

    n_vocab: int
    bos: int | None
    eos: int | None
    eot: int | None
    eom: int | None
    unk: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool

    def __init__(
        self,
        model: str,
        tokens: list[str],
        *,
        scores: np.ndarray | None = None,
        token_types: np.ndarray | None = None,
        merges: list[str] | None = None,
        pre: str = "",
        special_ids: dict[str, int] | None = None,
        flags: dict[str, bool] | None = None,
    ) -> None:
        """Build from raw tokenizer metadata (what `from_gguf` reads): `special_ids` maps "bos",
        "eos", "eot", ... to GGUF ids; `flags` holds add_bos_token, add_eos_token, add_space_prefix."""
        flags = flags or {}
        self.tokenizer_model, self.tokenizer_pre = model, pre
        n = self.n_vocab = len(tokens)
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._texts = texts
        self._ids = {t: i for i, t in enumerate(texts)}
        if len(self._ids) != n:
            dup = next(t for i, t in enumerate(texts) if self._ids[t] != i)
            raise TokenizerError(f"duplicate token {dup!r} in the vocabulary")

        # llama.cpp's defaults per tokenizer model, before the GGUF overrides them
        self._spm = model == "llama"
        if self._spm:
            ids: dict[str, int | None] = {"bos": 1, "eos": 2, "unk": 0}
            add_space_prefix, self._clean_spaces, add_bos = True, False, True
        elif model == "gpt2":
            bpe = bpe_pre(pre)
            ids = {"bos": 11, "eos": 11}
            add_space_prefix, self._clean_spaces, add_bos = False, bpe.clean_spaces, bpe.add_bos
        else:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model; want gpt2 or llama)"
            )
        self._add_space_prefix = flags.get("add_space_prefix", add_space_prefix)
        self.add_bos = flags.get("add_bos_token", add_bos)
        self.add_eos = flags.get("add_eos_token", False)
        # a default outside the vocabulary is dropped, a GGUF id outside it ignored
        ids = {k: v for k, v in ids.items() if v is not None and v < n}
        ids.update({k: v for k, v in (special_ids or {}).items() if 0 <= v < n})

        self._attrs = token_attrs(token_types, n)
        self._eog = complete_specials(ids, self._ids, texts, self._attrs)
        self.bos, self.eos, self.eot = ids.get("bos"), ids.get("eos"), ids.get("eot")
        self.eom, self.unk, self.pad = ids.get("eom"), ids.get("unk"), ids.get("pad")
        if (self.add_bos and self.bos is None) or (self.add_eos and self.eos is None):
            raise TokenizerError(
                "tokenizer.ggml.add_bos_token/add_eos_token is true but that token id is not set"
            )

        special = np.nonzero(self._attrs & _SPECIAL)[0].tolist()
        hidden = {tid for tid in special if self._attrs[tid] & _HIDDEN}
        self._splitter = SpecialSplitter(texts, special, hidden)
        self._pieces: dict[int, bytes] = {}

        if self._spm:
            score_list = np.zeros(n) if scores is None else np.asarray(scores[:n], np.float64)
            byte_ids = [
                self._ids.get(f"<0x{b:02X}>", self._ids.get(chr(b)) if b < 0x80 else None) for b in range(256)
            ]
            self._merger = SpmMerger(self._ids, score_list.tolist(), byte_ids, self.unk)
        else:
            self._bpe = ByteLevelBpe(self._ids, merges or [], bpe_pre(pre))

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Vocab:
        """Read `tokenizer.ggml.*` from an open GGUF file."""
        key = "tokenizer.ggml."
        model = f.get(key + "model", None)
        if model is None:
            raise TokenizerError(f"{f.path.name}: no tokenizer in the GGUF (tokenizer.ggml.model)")
        tokens = f.get(key + "tokens", None)
        if tokens is None or (isinstance(tokens, list) and not tokens):
            raise TokenizerError(f"{f.path.name}: no token list in the GGUF (tokenizer.ggml.tokens)")
        # every key is checked for its type (and arrays for their length) before it is used
        _need(f, key + "model", model, isinstance(model, str), "a string")
        _need(f, key + "tokens", tokens, isinstance(tokens, list), "an array of strings")
        n = len(tokens)
        special_ids = {}
        for kind, names in SPECIAL_KEYS.items():
            for name in names:
                value = f.get(key + name, None)
                if value is not None:
                    _need(f, key + name, value, isinstance(value, int | np.integer), "an integer")
                    special_ids[kind] = int(value)
        flags = {}
        for name in ("add_bos_token", "add_eos_token", "add_space_prefix"):
            value = f.get(key + name, None)
            if value is not None:
                _need(f, key + name, value, isinstance(value, bool | int | np.integer), "a boolean")
                flags[name] = bool(value)
        scores, types = f.get(key + "scores", None), f.get(key + "token_type", None)
        for name, arr, kinds in (("scores", scores, "fiu"), ("token_type", types, "iu")):
            ok = arr is None or (isinstance(arr, np.ndarray) and arr.dtype.kind in kinds and len(arr) == n)
            _need(f, key + name, arr, ok, f"an array of {n} numbers (one per token)")
        merges = f.get(key + "merges", None) if model == "gpt2" else None
        ok = merges is None or (isinstance(merges, list) and all(isinstance(m, str) for m in merges))
        _need(f, key + "merges", merges, ok, "an array of strings")
        pre = f.get(key + "pre", "")
        _need(f, key + "pre", pre, isinstance(pre, str), "a string")
        return cls(
            model,
            tokens,
            scores=scores,
            token_types=types,
            merges=merges,
            pre=pre,
            special_ids=special_ids,
            flags=flags,
        )

    # -- tokenize -------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, like llama_tokenize.

        add_special adds BOS/EOS when the model asks for them; parse_special turns control-token
        texts (`<|im_start|>`, `<bos>`) into their ids. User-defined tokens are always parsed."""
        as_text(text, "tokenize's text")
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos)  # type: ignore[arg-type]  # checked at load
        prev_special = True  # SPM: a fragment at the start or after a special token gets a space prefix
        for frag in self._splitter.split(text, parse_special) if text else []:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self._spm:
                if self._add_space_prefix and prev_special:
                    frag = " " + frag
                out += self._merger.encode(frag.replace(" ", _SPACE))
                prev_special = False
            else:
                out += self._bpe.encode(frag)
        if add_special and self.add_eos:
            out.append(self.eos)  # type: ignore[arg-type]
        return out

    # -- pieces ---------------------------------------------------------------------------------
    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """The bytes a token stands for, like llama_token_to_piece (may be partial UTF-8).

        Control and unknown tokens render their text only when `special` is true."""
        if not 0 <= as_int(token, "a token id") < self.n_vocab:
            raise KvtoolError(f"token id {token} out of range [0, {self.n_vocab})")
        if not special and self._attrs[token] & _HIDDEN:
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._make_piece(token)
        return piece

    def _make_piece(self, token: int) -> bytes:
        attr, text = int(self._attrs[token]), self._texts[token]
        if attr & _SPECIAL:
            return text.encode()
        if attr & Attr.NORMAL:
            if self._spm:
                return text.replace(_SPACE, " ").encode()
            out = bytearray()
            for ch in text:
                b = BYTE_DECODER.get(ch)
                if b is None:  # not a GPT-2 byte character: llama.cpp writes a marker instead
                    out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
                else:
                    out.append(b)
            return bytes(out)
        if attr & Attr.BYTE:  # "<0xHH>": llama.cpp reads the hex digits after "<0x" with strtol
            return bytes([_byte_value(text)])
        return b""  # unused / undefined tokens render as nothing

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        """Text of `ids`, like llama_detokenize(remove_special=false, unparse_special=special).

        Pieces are joined and decoded as UTF-8 (errors replaced); with add_space_prefix the first
        piece loses one leading space; BPE vocabularies that ask for it clean " ," " 's" etc."""
        parts = [self.token_to_piece(t, special) for t in ids]
        if parts and self._add_space_prefix and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        if self._clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")

    # -- token properties -------------------------------------------------------------------------
    def is_eog(self, token: int | None) -> bool:
        """End of generation: eos, eot, eom and end-of-turn tokens found by their text."""
        return token in self._eog

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every end-of-generation token id."""
        return frozenset(self._eog)

    def is_control(self, token: int) -> bool:
        """A control token (`<|im_start|>`, `<bos>`, ...)."""
        return bool(self._attrs[token] & Attr.CONTROL)

    def token_text(self, token: int) -> str:
        """The token's text as stored in the GGUF (byte-level or ▁-escaped)."""
        return self._texts[token]

    def token_attr(self, token: int) -> Attr:
        """llama.cpp's attribute bits of a token."""
        return Attr(int(self._attrs[token]))


def _need(f: GGUFFile, key: str, value: object, ok: bool, what: str) -> None:
    """A one-line TokenizerError unless `ok`: the key's value is not `what`."""
    if not ok:
        shown = f"an array of {len(value)}" if isinstance(value, list | np.ndarray) else repr(value)[:40]
        raise TokenizerError(f"{f.path.name}: {key} = {shown}: not {what}")


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces: three passes over the joined pieces."""
    space, quote = 0x20, 0x27
    out = bytearray(data[:1])  # " ?", " !", " .", " ," lose their space
    for i in range(1, len(data)):
        if data[i - 1] == space and data[i] in b"?!.,":
            out.pop()
        out.append(data[i])
    src, out, i, skipped = bytes(out), bytearray(out[:1]), 1, False
    while i < len(src):  # a lone quote between spaces loses both spaces
        x = src[i]
        if x == quote and not skipped and i + 1 < len(src) and src[i - 1] == space and src[i + 1] == space:
            out.pop()
            out.append(x)
            i, skipped = i + 2, True
            continue
        out.append(x)
        i, skipped = i + 1, False
    src, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(src)):  # " 's", " 'm", " 're", " 've" lose their space
        x = src[i]
        if x == quote and src[i - 1] == space and i + 1 < len(src):
            x1 = src[i + 1 : i + 2]
            x12 = src[i + 1 : i + 3] if i + 2 < len(src) else b""
            if x1 in (b"s", b"m") or (x1 not in (b"t", b"d") and x12 in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return bytes(out)
