"""State files of quantized caches: the blocks are saved as they are (U8 tensors of the cache's
type) and come back bitwise; a state loads only into a context of its cache types (a clear
error otherwise, the context untouched); a block whose scale is not finite is refused."""

from __future__ import annotations

import pytest
import torch

import kvtool
from kvtool.common.store import ConversationStore
from kvtool.state import inspect
from kvtool.state.container import read_container
from tests.kvtool.state.test_state_validation import refused, rewrite  # noqa: F401 - a fixture

TYPES = [("q8_0", "q8_0"), ("q4_1", "iq4_nl"), ("f16", "q5_0")]


def ctx_of(model: kvtool.Model, tk: str, tv: str, unified: bool) -> kvtool.Context:
    p = kvtool.ContextParams(n_ctx=512, n_seq_max=4, kv_unified=unified, swa_full=True, type_k=tk, type_v=tv)
    return kvtool.Context(model, p)


def next_logits(ctx: kvtool.Context, seq: int) -> torch.Tensor:
    ctx.decode(kvtool.Batch.from_tokens([5], seq_id=seq, pos0=ctx.memory.seq_pos_max(seq) + 1))
    return ctx.logits_ith(-1).clone()


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize(("tk", "tv"), TYPES)
def test_blocks_round_trip_bitwise(tiny_gemma3, tokens, tk: str, tv: str, unified: bool) -> None:  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_gemma3, tk, tv, unified)
    kvtool.decode_tokens(src, tokens(tiny_gemma3, 12), 0, 0)
    kvtool.decode_tokens(src, tokens(tiny_gemma3, 7, seed=1), 1, 0)
    data, one = src.state_get_data(), src.state_seq_get_data(1)
    layout = inspect(data).memory["parts"]["base"]
    assert (layout["type_k"], layout["type_v"]) == (tk.upper(), tv.upper())
    tensors = read_container(data)[1]
    k0 = next(t for n, t in tensors.items() if n.endswith(".k.1"))
    width = {"q8_0": 34, "q4_1": 20, "f16": 32}[tk]  # one head of 32 values: bytes, or halves
    assert (k0.dtype, k0.shape[1:]) == ("F16" if tk == "f16" else "U8", (2, width))
    want = [next_logits(src, s) for s in (0, 1)]
    dst = ctx_of(tiny_gemma3, tk, tv, unified)
    dst.state_set_data(data)
    assert [torch.equal(next_logits(dst, s), w) for s, w in zip((0, 1), want, strict=True)] == [True, True]
    seq = ctx_of(tiny_gemma3, tk, tv, unified)
    seq.state_seq_set_data(one, 3)
    got = next_logits(seq, 3)
    if not unified:  # its own stream, its cells where they were: the same bits (in one stream the
        assert torch.equal(got, want[1])  # other sequence's cells change the sums' order)


def test_another_cache_type_is_refused(tiny_gemma3, tokens, refused) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_gemma3, "q8_0", "q8_0", True)
    kvtool.decode_tokens(src, tokens(tiny_gemma3, 9), 0, 0)
    dst = ctx_of(tiny_gemma3, "q4_0", "q8_0", True)
    kvtool.decode_tokens(dst, tokens(tiny_gemma3, 4, seed=3), 0, 0)
    msg = refused(dst, lambda: dst.state_set_data(src.state_get_data()), "K type differ")
    assert "state Q8_0, context Q4_0" in msg and "cache types it was saved from" in msg


def test_a_block_scale_that_is_not_finite_is_refused(tiny_gemma3, tokens, refused) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    ctx = ctx_of(tiny_gemma3, "q4_1", "q4_1", False)
    kvtool.decode_tokens(ctx, tokens(tiny_gemma3, 9), 0, 0)
    data = ctx.state_get_data()
    name = next(n for n in read_container(data)[1] if n.endswith(".v.0"))

    def poison(s: dict, t: dict) -> None:  # type: ignore[type-arg]
        t[name].view(-1, 20)[3, 2:4] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # m = NaN

    refused(ctx, lambda: ctx.state_set_data(rewrite(data, poison)), "NaN or infinite")


def test_the_conversation_store_holds_the_smaller_blocks(tiny_gemma3, tokens, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sizes = {}
    with ConversationStore(tmp_path / "c.db") as store:
        for tk in ("f16", "q8_0", "q4_0"):
            ctx = ctx_of(tiny_gemma3, tk, tk, True)
            ids = tokens(tiny_gemma3, 200)
            kvtool.decode_tokens(ctx, ids, 0, 0)
            store.save(tk, ctx.state_seq_get_data(0), ids, [], "tiny", "fp")
            rec = store.get(tk)
            assert rec is not None
            sizes[tk] = rec.n_bytes
    assert sizes["q4_0"] < sizes["q8_0"] < sizes["f16"]


def test_a_version_2_state_of_a_float_cache_still_loads(tiny_gemma3, tokens) -> None:  # type: ignore[no-untyped-def]
    """Version 3 added the quantized types; a version-2 file (float caches) reads as it is."""
    from kvtool.state.header import sampled_content_hash

    src = ctx_of(tiny_gemma3, "f16", "f16", True)
    kvtool.decode_tokens(src, tokens(tiny_gemma3, 9), 0, 0)
    sampled = sampled_content_hash(tiny_gemma3.path)  # version 2's model.content
    old = rewrite(
        src.state_get_data(), lambda s, t: (s.update(version=2), s["model"].update(content=sampled))
    )
    want = next_logits(src, 0)
    dst = ctx_of(tiny_gemma3, "f16", "f16", True)
    dst.state_set_data(old)
    assert torch.equal(next_logits(dst, 0), want)
