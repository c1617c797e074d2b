"""A sequence state's blobs (`app.<name>` U8 tensors): the application's bytes travel with the
state under its checksum, come back in StateInfo.blobs, and are never read as memory."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import kvtool
from kvtool.state.container import read_container, write_container


def test_blobs_round_trip_and_leave_the_memory_alone(tiny_llama: kvtool.Model) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, n_seq_max=2))
    kvtool.decode_tokens(ctx, [1, 5, 6, 7], 0, 0)
    plain = ctx.state_seq_get_data(0)
    data = ctx.state_seq_get_data(0, blobs={"cp.2": b"\x00abc", "x": bytes(range(256))})
    info = ctx.state_seq_set_data(data, 1)
    assert info.blobs == {"cp.2": b"\x00abc", "x": bytes(range(256))}
    assert info.tensor_bytes["app"] == 4 + 256
    assert kvtool.inspect_state(data).blobs == info.blobs and kvtool.inspect_state(plain).blobs == {}
    twin = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, n_seq_max=2))
    kvtool.decode_tokens(twin, [1, 5, 6, 7], 0, 0)
    twin.state_seq_set_data(plain, 1)
    assert ctx.state_seq_get_data(1) == twin.state_seq_get_data(1)  # the same memory as without blobs
    with pytest.raises(kvtool.StateError, match="blob"):
        ctx.state_seq_get_data(0, blobs={"empty": b""})


def test_a_blob_is_under_the_checksum_and_must_be_bytes(tiny_llama: kvtool.Model) -> None:
    f32 = kvtool.ContextParams(n_ctx=256, type_k="f32", type_v="f32")  # tensors numpy reads
    ctx = kvtool.Context(tiny_llama, f32)
    kvtool.decode_tokens(ctx, [1, 5, 6], 0, 0)
    data = bytearray(ctx.state_seq_get_data(0, blobs={"b": b"zzzz"}))
    at = bytes(data).rindex(b"zzzz")
    data[at] ^= 1
    with pytest.raises(kvtool.StateError, match="checksum"):
        ctx.state_seq_set_data(bytes(data), 0)
    state, tensors = read_container(ctx.state_seq_get_data(0))
    arrays = {n: t.numpy() for n, t in tensors.items()} | {"app.f": np.zeros(2, dtype=np.float32)}
    with pytest.raises(kvtool.StateError, match="blob"):
        ctx.state_seq_set_data(write_container(state, arrays), 0)
    assert struct.unpack("<Q", data[:8])[0] % 8 == 0
