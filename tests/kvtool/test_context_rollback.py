"""ContextParams(n_rs_seq=K): a recurrent context takes back up to K tokens (llama.cpp's name);
the logits after a rollback equal a fresh decode of the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvtool

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "rwkv6", "rwkv7"])
def test_rollback_within_n_rs_seq_equals_a_fresh_decode(arch: str) -> None:
    model = kvtool.Model(MODELS / f"tiny-{arch}.gguf")
    prompt = [5 + 3 * i for i in range(12)]

    def ctx(k: int) -> kvtool.Context:
        return kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=1, n_rs_seq=k))

    c = ctx(2)
    kvtool.decode_tokens(c, prompt, 0, 0)
    assert c.memory.seq_rm(0, 9, -1) is False  # three back: beyond K = 2
    assert c.memory.seq_rm(0, 10, -1) is True
    assert (c.memory.seq_pos_min(0), c.memory.seq_pos_max(0)) == (9, 9)
    got = kvtool.decode_tokens(c, [40, 41], 0, 10).clone()
    fresh = ctx(0)
    want = kvtool.decode_tokens(fresh, [*prompt[:10], 40, 41], 0, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = ctx(0)
    kvtool.decode_tokens(plain, prompt, 0, 0)
    assert plain.memory.seq_rm(0, 10, -1) is False  # llama.cpp's default: no rollback


def test_negative_n_rs_seq_is_refused() -> None:
    model = kvtool.Model(MODELS / "tiny-mamba.gguf")
    with pytest.raises(kvtool.KvtoolError, match="n_rs_seq"):
        kvtool.Context(model, kvtool.ContextParams(n_rs_seq=-1))
