"""What wkv6 and wkv7 must both do (kernels/_wkv.py drives both): the chunked and step references
against each kernel's recurrence written out in float64 (test_wkv6/test_wkv7 hold those and the
inputs), and the Triton kernel against the reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvtool.kernels import wkv6 as wkv6_mod
from kvtool.kernels import wkv7 as wkv7_mod
from tests.kernels import test_wkv6, test_wkv7
from tests.kernels.sm90 import compile_in_subprocess, compile_sm90


@dataclass(frozen=True)
class Wkv:
    """One wkv kernel: its module, its test module (its float64 recurrence `naive_<name>`,
    `make_inputs`, the `SHAPES` and `CHUNKS` checked here), how many of the operands are per
    token (those after them, but the state, are per head), the seed of its random shapes and its
    kernel's largest BV."""

    mod: ModuleType
    tests: ModuleType
    n_token_args: int
    seed: int
    block_v: int

    @property
    def name(self) -> str:
        return self.mod.__name__.rsplit(".", 1)[-1]

    def fn(self, form: str = "") -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return getattr(self.mod, self.name + form)

    def naive(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self.tests, f"naive_{self.name}")(*args)

    def make_inputs(self, B: int, T: int, H: int, N: int, seed: int) -> tuple[torch.Tensor, ...]:
        return self.tests.make_inputs(B, T, H, N, seed=seed)

    def with_tokens(self, args: tuple[torch.Tensor, ...], t0: int, t1: int) -> list[torch.Tensor]:
        """`args` with the per-token operands cut to tokens [t0, t1), the state left out."""
        n = self.n_token_args
        return [x[:, t0:t1] for x in args[:n]] + list(args[n:-1])


WKV6 = Wkv(wkv6_mod, test_wkv6, n_token_args=4, seed=100, block_v=64)
WKV7 = Wkv(wkv7_mod, test_wkv7, n_token_args=6, seed=200, block_v=32)
KERNELS = [WKV6, WKV7]


def _cases(values: Callable[[Wkv], Iterable[object]]) -> list[Any]:  # pytest.param sets
    """(kernel, value) for every kernel and each of its values."""
    return [pytest.param(w, v, id=f"{w.name}-{v}") for w in KERNELS for v in values(w)]


@pytest.mark.parametrize(("w", "shape"), _cases(lambda w: w.tests.SHAPES))
def test_reference_matches_recurrence(w: Wkv, shape: tuple[int, int, int, int]) -> None:
    args = w.make_inputs(*shape, seed=sum(shape))
    want_out, want_states = w.naive(*args)
    n_states = min(3, shape[1])
    out, states = w.fn("_ref")(*args, n_states=n_states)
    assert states.shape == (shape[0], n_states, shape[2], shape[3], shape[3])
    scale = max(1.0, want_out.abs().max().item())
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=2e-6, rtol=0)
    torch.testing.assert_close(states.double(), want_states[:, -n_states:], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("w", KERNELS, ids=lambda w: w.name)
def test_step_form_matches_recurrence(w: Wkv) -> None:
    args = w.make_inputs(3, 1, 2, 16, seed=5)
    want_out, want_states = w.naive(*args)
    out, state = w.fn("_step_ref")(*args)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("w", "chunk"), _cases(lambda w: w.tests.CHUNKS))
def test_chunk_size_does_not_change_result(w: Wkv, chunk: int) -> None:
    args = w.make_inputs(2, 45, 2, 16, seed=9)
    want_out, want_states = w.naive(*args)
    out, state = w.fn("_chunked_ref")(*args, chunk=chunk)
    torch.testing.assert_close(out.double(), want_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("w", KERNELS, ids=lambda w: w.name)
def test_prompt_then_steps_equals_one_pass(w: Wkv) -> None:
    args = w.make_inputs(2, 20, 2, 16, seed=3)
    ref = w.fn("_ref")
    full_out, full_state = ref(*args)
    out, s = ref(*w.with_tokens(args, 0, 17), args[-1])
    outs = [out]
    for t in range(17, 20):
        o, s = ref(*w.with_tokens(args, t, t + 1), s[:, -1])
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), full_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(s, full_state, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("w", "seed"), _cases(lambda w: range(6)))
def test_triton_matches_reference_random_shapes(w: Wkv, seed: int) -> None:
    g = torch.Generator().manual_seed(w.seed + seed)
    B, T, H = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (4, 12, 4))
    N = [8, 16, 24, 64][seed % 4]
    n_states = 1 + seed % min(3, T)
    args = w.make_inputs(B, T, H, N, seed=seed)
    want_out, want_states = w.fn("_ref")(*args, n_states=n_states)
    out, states = w.fn("_triton")(*args, n_states=n_states)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, want_states, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("w", KERNELS, ids=lambda w: w.name)
def test_dispatcher_on_cpu_uses_reference(w: Wkv, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(w.mod, f"{w.name}_triton", fail)
    args = w.make_inputs(1, 3, 1, 16, seed=1)
    torch.testing.assert_close(w.fn()(*args), w.fn("_ref")(*args))


@pytest.mark.parametrize("w", KERNELS, ids=lambda w: w.name)
def test_imports_without_triton(w: Wkv) -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        f"from kvtool.kernels import {w.name}\n"
        f"from {w.tests.__name__} import make_inputs\n"
        f"assert {w.name}.triton is None\n"
        f"out, s = {w.name}.{w.name}(*make_inputs(1, 2, 1, 16, seed=0))\n"
        "assert out.shape == (1, 2, 1, 16) and s.shape == (1, 1, 1, 16, 16)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2], timeout=120)


def compile_kernels() -> None:  # runs in `compile_in_subprocess`
    for w in KERNELS:
        fn = getattr(w.mod, f"_{w.name}_kernel")
        # activations in f32 or bf16 (every pointer but the states'); the state is always f32
        for act in ("fp32", "bf16"):
            signature = {n: "*" + act if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            signature |= {"s_ptr": "*fp32", "so_ptr": "*fp32", "BK": "constexpr", "BV": "constexpr"}
            compile_sm90(fn, signature, {"BK": 64, "BV": w.block_v})


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    compile_in_subprocess("tests.kernels.test_wkv", "compile_kernels", tmp_path)
