"""Replays llama.cpp's tiny-model scenarios (tests/data/tiny, copied from the oracle) and
compares every logits row: the pure-F32 (`_faoff`) references, within 1e-3 relative."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvtool

DATA = Path(__file__).parent.parent / "data" / "tiny"
SCENARIOS = ["single", "multi", "fork", "rm_tail", "state_seq"]


def replay(model: kvtool.Model, z: np.lib.npyio.NpzFile, unified: bool) -> np.ndarray:
    meta = json.loads(str(z["meta_json"]))
    ctx = kvtool.Context(
        model, kvtool.ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=4, kv_unified=unified)
    )
    offs = z["step_offsets"]
    rows = []
    blob = b""
    for k in range(len(offs) - 1):
        for op in (o for o in meta["ops"] if o["before_step"] == k):
            if op["op"] == "seq_cp":
                ctx.memory.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
            elif op["op"] == "seq_rm":
                assert ctx.memory.seq_rm(op["seq"], op["p0"], op["p1"]) == bool(op["ret"])
            elif op["op"] == "memory_clear":
                ctx.memory.clear(op["data"])
            elif op["op"] == "state_seq_get_data":
                blob = ctx.state_seq_get_data(op["seq"])
            elif op["op"] == "state_seq_set_data":
                ctx.state_seq_set_data(blob, op["dest_seq"])
        b = kvtool.Batch()
        for i in range(offs[k], offs[k + 1]):
            b.add(
                int(z["tokens"][i]),
                int(z["positions"][i]),
                [int(z["seq_ids"][i])],
                bool(z["output_flags"][i]),
            )
        if z["step_rc"][k] != 0:
            with pytest.raises(kvtool.DecodeError):
                ctx.decode(b)
            continue
        ctx.decode(b)
        rows.append(ctx.logits().numpy().copy())
        want = z["seq_pos_minmax"][k]
        got = [[ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)] for s in range(4)]
        assert got == want.tolist(), f"seq positions after step {k}"
    return np.concatenate(rows)


@pytest.mark.parametrize("unified", [1, 0])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_scenario(arch: str, scenario: str, unified: int) -> None:
    model = kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf")
    z = np.load(DATA / arch / f"{scenario}_kvu{unified}_faoff.npz")
    got = replay(model, z, bool(unified))
    ref = z["logits"]
    assert got.shape == ref.shape
    rel = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
    assert rel <= 1e-3
