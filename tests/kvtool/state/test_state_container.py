"""The container (docs/state-format.md): safetensors-compatible, canonical, every byte checked."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from kvtool.errors import StateError
from kvtool.state.container import VERSION, read_container, write_container

STATE = {"format": "kvtool.state", "version": VERSION, "note": "é ✓"}


def spec_json(obj: object) -> str:
    """Canonical JSON as docs/state-format.md defines it (independent of the implementation)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def tensors() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(3, 2, 4, generator=g),
        "a.f16": torch.randn(5, 2, generator=g).half(),
        "a.bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "b.pos": np.arange(7, dtype=np.int32),
        "b.seq": np.array([1, 2**63, 5], dtype=np.uint64),
        "b.i64": np.array([-1, 2**40], dtype=np.int64),
        "c.empty": torch.zeros(0, 2, 4),
        "d.u8": torch.arange(9, dtype=torch.uint8),
    }


def test_round_trip_keeps_every_tensor_and_the_header() -> None:
    data = write_container(STATE, tensors())
    state, got = read_container(data)
    assert state == STATE
    for name, t in tensors().items():
        back = got[name].torch() if isinstance(t, torch.Tensor) else got[name].numpy()
        assert (torch.equal if isinstance(t, torch.Tensor) else np.array_equal)(back, t), name


def test_layout_is_safetensors_with_aligned_canonical_header() -> None:
    data = write_container(STATE, tensors())
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    raw = data[8 : 8 + n].rstrip(b" ")
    head = json.loads(raw)
    assert spec_json(head).encode() == raw
    meta = head.pop("__metadata__")
    assert spec_json(json.loads(meta["kvtool.state"])) == meta["kvtool.state"]
    assert json.loads(meta["kvtool.state"]) == STATE
    # data order: wider elements first, then by name; back to back from 0 to the end of the file
    size = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U64": 8, "U8": 1}
    order = sorted(head, key=lambda k: (-size[head[k]["dtype"]], k))
    assert [k for k, _ in sorted(head.items(), key=lambda kv: kv[1]["data_offsets"])] == order
    end = 0
    for k in order:
        e = head[k]
        assert e["data_offsets"] == [end, end + size[e["dtype"]] * int(np.prod(e["shape"]))], k
        end = e["data_offsets"][1]
    assert 8 + n + end == len(data)
    # checksum: SHA-256 of the unpadded canonical header with an empty checksum, then the data
    blank = spec_json({**head, "__metadata__": {**meta, "kvtool.checksum": ""}}).encode()
    assert meta["kvtool.checksum"] == hashlib.sha256(blank + data[8 + n :]).hexdigest()
    loaded = safetensors.torch.load(data)  # the reference reader accepts it
    for name, t in tensors().items():
        want = t if isinstance(t, torch.Tensor) else torch.from_numpy(t)
        assert torch.equal(loaded[name], want), name


def test_the_same_input_gives_the_same_bytes() -> None:
    assert write_container(STATE, tensors()) == write_container(dict(reversed(STATE.items())), tensors())


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1, -100])
def test_truncated_is_refused(cut: int) -> None:
    data = write_container(STATE, tensors())
    with pytest.raises(StateError, match=r"truncated|not a kvtool state"):
        read_container(data[:cut])


def test_every_flipped_byte_is_refused() -> None:
    data = bytearray(write_container(STATE, {"x": np.arange(6, dtype=np.int32), "y": torch.ones(2, 3)}))
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(StateError) as e:
                read_container(bytes(bad))
            assert "\n" not in str(e.value)


def test_extra_bytes_are_refused() -> None:
    with pytest.raises(StateError, match="after the data"):
        read_container(write_container(STATE, tensors()) + b"\0")


def test_other_version_and_foreign_files_are_named() -> None:
    with pytest.raises(StateError, match=r"version 4 is not supported \(this kvtool reads 2 and 3\)"):
        read_container(write_container({**STATE, "version": 4}, {}))
    read_container(write_container({**STATE, "version": 2}, {}))  # float caches: read as they are
    with pytest.raises(StateError, match="not a kvtool state"):
        read_container(safetensors.torch.save({"w": torch.ones(2)}))
    with pytest.raises(StateError, match="not a kvtool state"):
        read_container(b"GGUF" + b"\0" * 60)
