"""Validation before mutation: every bad input is a one-line StateError and the live context
(cells, K/V, logits) is exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtool
from kvtool.errors import StateError
from kvtool.state.container import read_container, write_container
from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama


@pytest.fixture(params=[True, False], ids=["kvu1", "kvu0"])
def live(request, model, ctx_of, tokens) -> kvtool.Context:  # type: ignore[no-untyped-def]
    """A context with three sequences and logits: what a failed load must leave untouched."""
    ctx = ctx_of(model, request.param)
    kvtool.decode_tokens(ctx, tokens(model, 9), 0, 0)
    kvtool.decode_tokens(ctx, tokens(model, 5, seed=1), 1, 0)
    kvtool.decode_tokens(ctx, tokens(model, 7, seed=2), 2, 0)
    return ctx


@pytest.fixture
def refused(snap, unchanged) -> Callable[..., str]:  # type: ignore[no-untyped-def]
    """Runs a load that must fail; returns its message after checking nothing changed."""

    def check(ctx: kvtool.Context, load: Callable[[], object], match: str) -> str:
        before = snap(ctx)
        with pytest.raises(StateError, match=match) as e:
            load()
        assert "\n" not in str(e.value)
        assert unchanged(before, snap(ctx)), "a refused load changed the context"
        return str(e.value)

    return check


def rewrite(data: bytes, edit: Callable[[dict, dict], None]) -> bytes:  # type: ignore[type-arg]
    """A valid container (checksum and all) whose content was edited."""
    state, raw = read_container(data)
    tensors = {n: t.torch() if t.dtype in ("F32", "F16", "BF16", "U8") else t.numpy() for n, t in raw.items()}
    edit(state, tensors)
    return write_container(state, tensors)


def test_other_architecture(live, refused, tiny_llama, tiny_gemma3, ctx_of, tokens) -> None:  # type: ignore[no-untyped-def]
    other = tiny_gemma3 if live.model.arch == "llama" else tiny_llama
    ctx = ctx_of(other, True)
    kvtool.decode_tokens(ctx, tokens(other, 4), 0, 0)
    refused(live, lambda: live.state_seq_set_data(ctx.state_seq_get_data(0), 3), "another model")
    refused(live, lambda: live.state_set_data(ctx.state_get_data()), "another model")


def test_same_shapes_other_weights(tiny_llama, ctx_of, tokens, refused, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    twin = kvtool.Model(write_tiny_llama(tmp_path / "twin.gguf", TinyLlama(seed=1)))
    assert twin.fingerprint == tiny_llama.fingerprint  # names, shapes, types agree
    src = ctx_of(twin, True)
    kvtool.decode_tokens(src, tokens(twin, 6), 0, 0)
    live = ctx_of(tiny_llama, True)
    kvtool.decode_tokens(live, tokens(tiny_llama, 6), 0, 0)
    refused(live, lambda: live.state_set_data(src.state_get_data()), "another model")


def test_weights_that_differ_in_the_middle(tiny_llama, ctx_of, tokens, refused, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The content hash saw the file's size, first and last 64 KiB: a model changed in between
    loaded another model's state (issue 28, item 7). One weight of one middle tensor differs."""
    data = bytearray(tiny_llama.path.read_bytes())
    middle = next(
        info
        for name in tiny_llama.file.tensor_names()
        if (info := tiny_llama.file.tensor_info(name)).offset > 64 << 10
        and info.offset + info.n_bytes < len(data) - (64 << 10)
    )
    data[middle.offset] ^= 0x40
    (tmp_path / "edited.gguf").write_bytes(data)
    edited = kvtool.Model(tmp_path / "edited.gguf")
    assert edited.fingerprint == tiny_llama.fingerprint and len(data) == tiny_llama.path.stat().st_size
    src = ctx_of(edited, True)
    kvtool.decode_tokens(src, tokens(edited, 6), 0, 0)
    live = ctx_of(tiny_llama, True)
    kvtool.decode_tokens(live, tokens(tiny_llama, 6), 0, 0)
    refused(live, lambda: live.state_set_data(src.state_get_data()), "another model")
    refused(live, lambda: live.state_seq_set_data(src.state_seq_get_data(0), 1), "another model")


def test_a_version_2_state_loads_checked_by_its_sampled_hash(tiny_llama, ctx_of, tokens, refused) -> None:  # type: ignore[no-untyped-def]
    """Version 2 named its model by the file's size, first and last 64 KiB: such a file still
    loads into the model it names (and continues as the original), and not into another."""
    from kvtool.state.header import sampled_content_hash

    src = ctx_of(tiny_llama, True)
    kvtool.decode_tokens(src, tokens(tiny_llama, 6), 0, 0)
    whole = src.state_get_data()

    def as_v2(content: str) -> bytes:
        return rewrite(whole, lambda s, t: (s.update(version=2), s["model"].update(content=content)))

    dst = ctx_of(tiny_llama, True)
    dst.state_set_data(as_v2(sampled_content_hash(tiny_llama.path)))
    assert torch.equal(dst.logits_ith(-1), src.logits_ith(-1))
    assert dst.memory.seq_pos_max(0) == src.memory.seq_pos_max(0)
    live = ctx_of(tiny_llama, True)
    for content in ("0" * 32, tiny_llama.file.content_hash()):  # another's, or version 3's
        refused(live, lambda c=content: live.state_set_data(as_v2(c)), "another model")


def test_other_format_version(live, refused) -> None:  # type: ignore[no-untyped-def]
    data = rewrite(live.state_get_data(), lambda s, t: s.update(version=1))
    refused(live, lambda: live.state_set_data(data), "version 1 is not supported")


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.999])
def test_truncated(live, refused, keep: float) -> None:  # type: ignore[no-untyped-def]
    data = live.state_seq_get_data(0)
    refused(live, lambda: live.state_seq_set_data(data[: int(len(data) * keep)], 1), "truncated|not a kvtool")


def test_flipped_bytes(live, refused) -> None:  # type: ignore[no-untyped-def]
    data = live.state_get_data()
    for i in np.linspace(0, len(data) - 1, 41).astype(int):
        bad = bytearray(data)
        bad[i] ^= 0x10
        refused(live, lambda b=bytes(bad): live.state_set_data(b), "corrupted|not a kvtool|truncated")


def test_more_cells_than_fit(model, ctx_of, tokens, refused) -> None:  # type: ignore[no-untyped-def]
    big = ctx_of(model, True, n_ctx=1024)
    kvtool.decode_tokens(big, tokens(model, 300), 0, 0)
    seq_state, ctx_state = big.state_seq_get_data(0), big.state_get_data()
    small = ctx_of(model, False, n_ctx=1024, n_seq_max=4)  # 256 cells per sequence
    kvtool.decode_tokens(small, tokens(model, 5), 1, 0)
    refused(small, lambda: small.state_seq_set_data(seq_state, 2), "no room")
    refused(small, lambda: small.state_set_data(ctx_state), "needs 300 cells")


def test_stream_full_of_other_sequences(tiny_llama, ctx_of, tokens, refused) -> None:  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_llama, True)
    kvtool.decode_tokens(src, tokens(tiny_llama, 12), 0, 0)
    full = ctx_of(tiny_llama, True, n_ctx=256, n_seq_max=3)
    kvtool.decode_tokens(full, tokens(tiny_llama, 250, seed=3), 1, 0)
    refused(full, lambda: full.state_seq_set_data(src.state_seq_get_data(0), 2), "no room")


def test_sequence_ids_out_of_range(live, ctx_of, refused, tokens) -> None:  # type: ignore[no-untyped-def]
    refused(live, lambda: live.state_seq_set_data(live.state_seq_get_data(0), 4), "out of range")
    narrow = ctx_of(live.model, True, n_seq_max=2)
    kvtool.decode_tokens(narrow, tokens(live.model, 3), 1, 0)
    refused(narrow, lambda: narrow.state_set_data(live.state_get_data()), "holds sequence 2")


def test_wrong_kind(live, refused) -> None:  # type: ignore[no-untyped-def]
    refused(live, lambda: live.state_set_data(live.state_seq_get_data(1)), "sequence state")
    refused(live, lambda: live.state_seq_set_data(live.state_get_data(), 3), "whole-context state")


def test_other_kv_type(live, refused) -> None:  # type: ignore[no-untyped-def]
    f16 = kvtool.Context(live.model, kvtool.ContextParams(n_ctx=512, n_seq_max=4, type_k="f16", type_v="f16"))
    kvtool.decode_tokens(f16, [5, 6, 7], 0, 0)
    refused(f16, lambda: f16.state_seq_set_data(live.state_seq_get_data(0), 0), "K type")


def test_consistent_checksum_but_bad_content(live, refused) -> None:  # type: ignore[no-untyped-def]
    data = live.state_get_data()
    k0 = next(n for n in read_container(data)[1] if ".k." in n)

    def negative(s: dict, t: dict) -> None:  # type: ignore[type-arg]
        t[f"{k0.split('k.')[0]}pos"][1] = -3

    cases = [
        (lambda s, t: t.pop(k0), "missing"),
        (negative, "bad cell positions"),  # two cells at one position are legal (seq_div)
        (lambda s, t: s["memory"].update(kind="recurrent"), "'recurrent' memory"),
        (lambda s, t: s.update(n_outputs=5), "bad logits"),
        (lambda s, t: t.update(extra=np.zeros(2, dtype=np.int32)), "unexpected tensors"),
    ]
    for edit, match in cases:
        refused(live, lambda e=edit: live.state_set_data(rewrite(data, e)), match)


def test_missing_file(live, refused, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    refused(live, lambda: live.state_load_file(tmp_path / "nope.kvs"), "no state file")
    refused(live, lambda: live.state_load_file(tmp_path), "directory")
