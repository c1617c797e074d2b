"""wkv6: the chunked and step references against the recurrence written out in float64, and the
Triton kernel against the reference on random shapes (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.kernels import wkv6 as wkv6_mod
from kvtool.kernels.wkv6 import wkv6, wkv6_chunked_ref, wkv6_ref, wkv6_step_ref, wkv6_triton


def naive_wkv6(r, k, v, w_log, u, state):  # type: ignore[no-untyped-def]
    """ggml's rwkv_wkv6 loop, token by token, in float64: state S[key i, value j]. Returns the
    outputs and the state after every token [B, T, H, N, N]."""
    B, T, H, N = r.shape
    s = state.double().clone()
    out = torch.zeros(B, T, H, N, dtype=torch.float64)
    states = []
    for t in range(T):
        for i in range(N):
            kv = k[:, t, :, i, None].double() * v[:, t].double()  # [B, H, N(value)]
            out[:, t] += r[:, t, :, i, None].double() * (u[None, :, i, None].double() * kv + s[:, :, i])
            s[:, :, i] = torch.exp(w_log[:, t, :, i, None].double()) * s[:, :, i] + kv
        states.append(s.clone())
    return out, torch.stack(states, dim=1)


def make_inputs(B: int, T: int, H: int, N: int, seed: int, decay_scale: float = 1.0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    # RWKV-6's decay: w = exp(-exp(x)), x around the init ramp [-6, -1] plus data.
    w_log = -torch.exp(
        decay_scale * (torch.rand(B, T, H, N, generator=g) * 5 - 6 + torch.randn(B, T, H, N, generator=g))
    )
    u = torch.randn(H, N, generator=g)
    state = torch.randn(B, H, N, N, generator=g)
    return r, k, v, w_log, u, state


SHAPES = [(1, 1, 1, 16), (2, 5, 3, 16), (1, 33, 2, 8), (3, 70, 2, 16), (1, 40, 1, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_recurrence(shape: tuple[int, int, int, int]) -> None:
    args = make_inputs(*shape, seed=sum(shape))
    want_out, want_states = naive_wkv6(*args)
    n_states = min(3, shape[1])
    out, states = wkv6_ref(*args, n_states=n_states)
    assert states.shape == (shape[0], n_states, shape[2], shape[3], shape[3])
    scale = max(1.0, want_out.abs().max().item())
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=2e-6, rtol=0)
    torch.testing.assert_close(states.double(), want_states[:, -n_states:], atol=1e-4, rtol=1e-5)


def test_step_form_matches_recurrence() -> None:
    args = make_inputs(3, 1, 2, 16, seed=5)
    want_out, want_states = naive_wkv6(*args)
    out, state = wkv6_step_ref(*args)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunk_size_does_not_change_result(chunk: int) -> None:
    args = make_inputs(2, 45, 2, 16, seed=9)
    want_out, want_states = naive_wkv6(*args)
    out, state = wkv6_chunked_ref(*args, chunk=chunk)
    torch.testing.assert_close(out.double(), want_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-4, rtol=1e-5)


def test_prompt_then_steps_equals_one_pass() -> None:
    r, k, v, w_log, u, s0 = make_inputs(2, 20, 2, 16, seed=3)
    full_out, full_state = wkv6_ref(r, k, v, w_log, u, s0)
    out, s = wkv6_ref(r[:, :17], k[:, :17], v[:, :17], w_log[:, :17], u, s0)
    outs = [out]
    for t in range(17, 20):
        o, s = wkv6_ref(r[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], w_log[:, t : t + 1], u, s[:, -1])
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), full_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(s, full_state, atol=1e-4, rtol=1e-5)


def test_extreme_decay_stays_finite() -> None:
    # w_log = -1e4 (w underflows to 0) next to w_log = -1e-9 (w rounds to 1): the chunked form
    # only ever exponentiates sums of log-decays, so nothing overflows.
    r, k, v, w_log, u, s0 = make_inputs(1, 40, 2, 16, seed=4)
    w_log = torch.where(
        torch.rand(w_log.shape) < 0.5, torch.full_like(w_log, -1e4), torch.full_like(w_log, -1e-9)
    )
    out, state = wkv6_ref(r, k, v, w_log, u, s0)
    want_out, _ = naive_wkv6(r, k, v, w_log, u, s0)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    torch.testing.assert_close(out.double(), want_out, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    B, T, H = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (4, 12, 4))
    N = [8, 16, 24, 64][seed % 4]
    n_states = 1 + seed % min(3, T)
    args = make_inputs(B, T, H, N, seed=seed)
    want_out, want_states = wkv6_ref(*args, n_states=n_states)
    out, states = wkv6_triton(*args, n_states=n_states)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, want_states, atol=1e-4, rtol=1e-4)


def test_dispatcher_on_cpu_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(wkv6_mod, "wkv6_triton", fail)
    args = make_inputs(1, 3, 1, 16, seed=1)
    torch.testing.assert_close(wkv6(*args), wkv6_ref(*args))


def test_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvtool.kernels import wkv6\n"
        "assert wkv6.triton is None\n"
        "x = torch.randn(1, 2, 1, 16)\n"
        "out, s = wkv6.wkv6(x, x, x, -x.abs(), torch.ones(1, 16), torch.zeros(1, 1, 16, 16))\n"
        "assert out.shape == (1, 2, 1, 16) and s.shape == (1, 1, 1, 16, 16)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def compile_kernels() -> None:  # runs in a subprocess with TRITON_INTERPRET unset
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = wkv6_mod._wkv6_kernel
    for act in ("fp32", "bf16"):  # activations in f32 or bf16; the state is always f32
        pointers = dict(r_ptr=act, k_ptr=act, v_ptr=act, w_ptr=act, u_ptr=act, o_ptr=act)
        signature = {name: "i32" for name in fn.arg_names} | {n: "*" + t for n, t in pointers.items()}
        signature |= {"s_ptr": "*fp32", "so_ptr": "*fp32", "BK": "constexpr", "BV": "constexpr"}
        source = ASTSource(fn, signature, {"BK": 64, "BV": 64})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"]


def test_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    """The interpreter accepts code the compiler rejects: compile ahead of time for an H100."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = "from tests.kernels.test_wkv6 import compile_kernels; compile_kernels()"
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(
        cmd, env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]


def test_strong_decay_then_weak_keeps_precision() -> None:
    # One token decays every channel to ~0 (w_log -1e4), the following ones barely decay: the
    # weak decays between later tokens must not drown in the cumulative sum of the strong one.
    r, k, v, _, u, s0 = make_inputs(1, 64, 2, 16, seed=4)
    w_log = torch.full(r.shape, -1e-3)
    w_log[:, 0], w_log[:, 32] = -1e4, -3e4
    out, state = wkv6_chunked_ref(r, k, v, w_log, u, s0)
    want_out, want_states = naive_wkv6(r, k, v, w_log, u, s0)
    scale = want_out.abs().max().item()
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-4, rtol=1e-5)
