"""The Triton dispatch, once for every kernel: CPU tensors take the torch reference, tensors that
`use_triton` accepts take the Triton kernel (run here by the interpreter), and the kernels import
and run without triton installed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from kvtool.kernels import _triton, attention_cpu, cpu_lib
from kvtool.kernels import attention as attention_mod
from kvtool.kernels import store_kv as store_kv_mod
from kvtool.kernels.visibility import Cells


@dataclass(frozen=True)
class Dispatch:
    module: ModuleType
    name: str  # the public function that dispatches
    # Calls a function of the public signature on fixed inputs and returns what it computed.
    call: Callable[[Callable[..., torch.Tensor | None]], torch.Tensor]
    triton_fn: str  # the kernel it hands CUDA tensors to
    ref_fn: str  # the torch reference it computes with elsewhere


def _call_attention(fn: Callable[..., torch.Tensor | None]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=g)  # [S, n_q, H, D]
    k = torch.randn(2, 5, 2, 16, generator=g)  # [S, n_kv, Hkv, D]
    v = torch.randn(2, 5, 2, 16, generator=g)
    mask = torch.zeros(2, 3, 5).masked_fill(torch.rand(2, 3, 5, generator=g) < 0.3, float("-inf"))
    out = fn(q, k, v, mask, 0.25)
    assert out is not None
    return out


def _call_attention_cells(fn: Callable[..., torch.Tensor | None]) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 4, 16, generator=g)  # [S, n_q, H, D]
    k = torch.randn(1, 6, 2, 16, generator=g)  # [S, n_kv, Hkv, D]
    v = torch.randn(1, 6, 2, 16, generator=g)
    cells = Cells(
        pos=torch.tensor([[0, 1, -1, 2, 3, 4]]),
        seq=torch.tensor([[1, 3, 0, 2, 1, 2]]),  # two sequences in one stream, a shared cell
        q_pos=torch.tensor([[2, 3, 4]]),
        q_seq=torch.tensor([[1, 0, 1]]),
    )
    out = fn(q, k, v, cells, 0.25)
    assert out is not None
    return out


def _call_store_kv(fn: Callable[..., torch.Tensor | None]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    dst = torch.randn(20, 24, generator=g).half()  # [n_rows, width]
    src = torch.randn(5, 24, generator=g)  # [n_tokens, width], converted on store
    fn(dst, src, torch.tensor([7, 0, 19, 3, 12]))
    return dst


DISPATCHES = [
    Dispatch(attention_mod, "attention", _call_attention, "attention_triton", "attention_ref"),
    # given cells, the one dispatch hands them to the one Triton entry point
    Dispatch(attention_mod, "attention", _call_attention_cells, "attention_triton", "attention_cells_ref"),
    Dispatch(store_kv_mod, "store_kv", _call_store_kv, "store_kv_triton", "store_kv_ref"),
]


def _refuse(*args, **kwargs):
    raise AssertionError("Triton path taken")


@pytest.mark.parametrize("d", DISPATCHES, ids=lambda d: d.ref_fn.removesuffix("_ref"))
def test_cpu_tensors_take_the_reference(d: Dispatch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(d.module, d.triton_fn, _refuse)
    monkeypatch.setattr(attention_cpu, "applies", lambda *tensors: False)  # tested below
    got = d.call(getattr(d.module, d.name))
    assert torch.equal(got, d.call(getattr(d.module, d.ref_fn)))


@pytest.mark.skipif(cpu_lib.lib() is None, reason="no C compiler: the CPU kernels are not built")
def test_cpu_decode_rows_take_the_compiled_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kernel = attention_cpu.attention_cpu

    def spy(*args, **kwargs):
        calls.append(args)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "attention_triton", _refuse)
    monkeypatch.setattr(attention_cpu, "attention_cpu", spy)
    got = _call_attention(attention_mod.attention)  # 3 query rows per stream: decode-sized
    assert len(calls) == 1
    torch.testing.assert_close(got, _call_attention(attention_mod.attention_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", DISPATCHES, ids=lambda d: d.ref_fn.removesuffix("_ref"))
def test_accepted_tensors_take_the_kernel(d: Dispatch, monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the tensors were on CUDA: the dispatcher must hand its arguments to the kernel.
    calls = []
    kernel = getattr(d.module, d.triton_fn)

    def spy(*args, **kwargs):
        calls.append(args)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(d.module, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(d.module, d.triton_fn, spy)
    monkeypatch.setattr(d.module, d.ref_fn, _refuse)
    got = d.call(getattr(d.module, d.name))
    assert len(calls) == 1
    torch.testing.assert_close(got, d.call(kernel), atol=0, rtol=0)


def test_use_triton_needs_triton_and_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert not _triton.use_triton(cpu)
    assert not _triton.use_triton(meta)
    if torch.cuda.is_available():
        gpu = torch.zeros(2, device="cuda")
        assert _triton.use_triton(gpu)
        assert not _triton.use_triton(gpu, cpu)  # every operand must be on the GPU
        monkeypatch.setattr(_triton, "triton", None)
        assert not _triton.use_triton(gpu)


def test_kernels_import_and_run_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvtool.kernels import _triton, attention, store_kv\n"
        "assert _triton.triton is None\n"
        "q = torch.randn(1, 2, 2, 16); m = torch.zeros(1, 2, 3)\n"
        "kv = torch.randn(1, 3, 1, 16)\n"
        "assert attention.attention(q, kv, kv, m, 0.25).shape == (1, 2, 2, 16)\n"
        "d = torch.zeros(4, 8); store_kv.store_kv(d, torch.ones(1, 8), torch.tensor([2]))\n"
        "assert d.sum() == 8\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
