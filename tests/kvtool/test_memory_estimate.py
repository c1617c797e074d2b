"""A context's memory is estimated before it is allocated (issue 14, defect 4): the estimate
matches the tensors a context really allocates, a context that cannot fit is refused in one
line before any allocation (`run -c 1000000` was killed by the kernel, `-c 2**31` ended in an
allocation traceback), and a context beyond the training context warns, as llama.cpp does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtool
import kvtool.memory_estimate as me

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"
KVTOOL = [sys.executable, "-m", "kvtool.commands"]


def _tensor_bytes(obj: object, seen: set[object] | None = None) -> int:
    """Bytes of every distinct torch storage reachable from `obj`'s attributes: what the memory
    really allocated (the independent measure the estimate is checked against)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):  # views of one storage (the cache's row views) count once
        key = ("storage", obj.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("kvtool.memory"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


ARCHS = ["llama", "gemma3", "mamba", "mamba2", "rwkv6", "rwkv7", "granitehybrid", "lfm2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("unified", [False, True])
def test_estimate_matches_what_the_context_allocates(arch: str, unified: bool) -> None:
    model = kvtool.Model(MODELS / f"tiny-{arch}.gguf")
    p = kvtool.ContextParams(n_ctx=1024, n_seq_max=2, kv_unified=unified, type_k="f16", n_rs_seq=2)
    ctx = kvtool.Context(model, p)
    est = ctx.memory_estimate
    meta = 2 * 2 * ctx.n_ctx_seq * me._CELL_META  # cell bookkeeping: numpy, not tensors
    got = _tensor_bytes(ctx.memory)
    assert got > 0
    assert got <= est.kv + est.recurrent <= got + meta


def test_a_context_that_cannot_fit_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    monkeypatch.setattr(me, "available_memory", lambda device="cpu": 64 << 20)
    kvtool.Context(model, kvtool.ContextParams(n_ctx=4096))  # fits: ~6 MiB of K/V
    with pytest.raises(kvtool.KvtoolError, match=r"context of 262144 tokens needs about .* MiB .* lower -c"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=1 << 18))


def test_recurrent_state_counts_per_sequence_not_per_cell() -> None:
    """A recurrent model's memory does not grow with n_ctx (its states are per sequence)."""
    model = kvtool.Model(MODELS / "tiny-mamba.gguf")
    small = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_ubatch=8)).memory_estimate
    large = kvtool.Context(model, kvtool.ContextParams(n_ctx=1 << 20, n_ubatch=8)).memory_estimate
    assert small.kv == large.kv == 0 and small.recurrent == large.recurrent > 0


def test_beyond_the_training_context_warns() -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")  # context_length 4096
    with pytest.warns(UserWarning, match=r"n_ctx_seq \(8192\) > n_ctx_train \(4096\)"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=8192))


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-c", str(2**31), "-p", "hi", "-n", "1", "--no-chat"],
        ["run", "-c", "1000000000", "-p", "hi", "-n", "1", "--no-chat"],
        ["bench", "-p", str(2**31), "-n", "0", "-r", "1"],
    ],
    ids=["run-c-2**31", "run-c-1e9", "bench-p-2**31"],
)
def test_cli_refuses_a_context_that_cannot_fit_in_one_line(args: list[str]) -> None:
    model = str(MODELS / "tiny-llama.gguf")
    r = subprocess.run([*KVTOOL, *args, "-m", model], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lower -c/--ctx-size" in errors[0], r.stderr
