"""wkv7: the chunked and step references against the delta-rule recurrence written out in
float64, and the Triton kernel against the reference on random shapes (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtool.kernels import wkv7 as wkv7_mod
from kvtool.kernels.wkv7 import wkv7, wkv7_chunked_ref, wkv7_ref, wkv7_step_ref, wkv7_triton


def naive_wkv7(r, w_log, k, v, a, b, state):  # type: ignore[no-untyped-def]
    """ggml's rwkv_wkv7 loop, token by token, in float64: state S[value i, key j]. Returns the
    outputs and the state after every token [B, T, H, N, N]."""
    B, T, H, N = r.shape
    s = state.double().clone()
    out = torch.zeros(B, T, H, N, dtype=torch.float64)
    r, w_log, k, v, a, b = (x.double() for x in (r, w_log, k, v, a, b))
    states = []
    for t in range(T):
        for i in range(N):
            sa = (a[:, t] * s[:, :, i]).sum(-1, keepdim=True)  # [B, H, 1]
            s[:, :, i] = s[:, :, i] * torch.exp(w_log[:, t]) + v[:, t, :, i, None] * k[:, t] + sa * b[:, t]
            out[:, t, :, i] = (s[:, :, i] * r[:, t]).sum(-1)
        states.append(s.clone())
    return out, torch.stack(states, dim=1)


def make_inputs(B: int, T: int, H: int, N: int, seed: int):  # type: ignore[no-untyped-def]
    """RWKV-7's operands: a = -kk and b = kk * iclr with kk of unit norm per head."""
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    w_log = -0.606531 * torch.sigmoid(2 * torch.randn(B, T, H, N, generator=g))
    kk = F.normalize(torch.randn(B, T, H, N, generator=g), dim=-1)
    iclr = torch.sigmoid(torch.randn(B, T, H, N, generator=g))
    state = torch.randn(B, H, N, N, generator=g)
    return r, w_log, k, v, -kk, kk * iclr, state


SHAPES = [(1, 1, 1, 16), (2, 5, 3, 16), (1, 33, 2, 8), (3, 40, 2, 16), (1, 37, 1, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_recurrence(shape: tuple[int, int, int, int]) -> None:
    args = make_inputs(*shape, seed=sum(shape))
    want_out, want_states = naive_wkv7(*args)
    n_states = min(3, shape[1])
    out, states = wkv7_ref(*args, n_states=n_states)
    assert states.shape == (shape[0], n_states, shape[2], shape[3], shape[3])
    scale = max(1.0, want_out.abs().max().item())
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=2e-6, rtol=0)
    torch.testing.assert_close(states.double(), want_states[:, -n_states:], atol=1e-4, rtol=1e-5)


def test_step_form_matches_recurrence() -> None:
    args = make_inputs(3, 1, 2, 16, seed=5)
    want_out, want_states = naive_wkv7(*args)
    out, state = wkv7_step_ref(*args)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 16, 32])
def test_chunk_size_does_not_change_result(chunk: int) -> None:
    args = make_inputs(2, 45, 2, 16, seed=9)
    want_out, want_states = naive_wkv7(*args)
    out, state = wkv7_chunked_ref(*args, chunk=chunk)
    torch.testing.assert_close(out.double(), want_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-4, rtol=1e-5)


def test_prompt_then_steps_equals_one_pass() -> None:
    *xs, s0 = make_inputs(2, 20, 2, 16, seed=3)
    full_out, full_state = wkv7_ref(*xs, s0)
    out, s = wkv7_ref(*(x[:, :17] for x in xs), s0)
    outs = [out]
    for t in range(17, 20):
        o, s = wkv7_ref(*(x[:, t : t + 1] for x in xs), s[:, -1])
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), full_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(s, full_state, atol=1e-4, rtol=1e-5)


def test_long_prompt_stays_bounded() -> None:
    # The delta rule keeps the state bounded; the chunked triangular solves must not amplify
    # rounding over many chunks.
    args = make_inputs(1, 300, 1, 16, seed=8)
    want_out, _ = naive_wkv7(*args)
    out, state = wkv7_ref(*args)
    assert torch.isfinite(state).all()
    scale = max(1.0, want_out.abs().max().item())
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(200 + seed)
    B, T, H = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (4, 12, 4))
    N = [8, 16, 24, 64][seed % 4]
    n_states = 1 + seed % min(3, T)
    args = make_inputs(B, T, H, N, seed=seed)
    want_out, want_states = wkv7_ref(*args, n_states=n_states)
    out, states = wkv7_triton(*args, n_states=n_states)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, want_states, atol=1e-4, rtol=1e-4)


def test_dispatcher_on_cpu_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(wkv7_mod, "wkv7_triton", fail)
    args = make_inputs(1, 3, 1, 16, seed=1)
    torch.testing.assert_close(wkv7(*args), wkv7_ref(*args))


def test_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvtool.kernels import wkv7\n"
        "assert wkv7.triton is None\n"
        "x = torch.randn(1, 2, 1, 16)\n"
        "out, s = wkv7.wkv7(x, -x.abs(), x, x, x, x, torch.zeros(1, 1, 16, 16))\n"
        "assert out.shape == (1, 2, 1, 16) and s.shape == (1, 1, 1, 16, 16)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def compile_kernels() -> None:  # runs in a subprocess with TRITON_INTERPRET unset
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = wkv7_mod._wkv7_kernel
    for act in ("fp32", "bf16"):  # activations in f32 or bf16; the state is always f32
        pointers = dict(r_ptr=act, w_ptr=act, k_ptr=act, v_ptr=act, a_ptr=act, b_ptr=act, o_ptr=act)
        signature = {name: "i32" for name in fn.arg_names} | {n: "*" + t for n, t in pointers.items()}
        signature |= {"s_ptr": "*fp32", "so_ptr": "*fp32", "BK": "constexpr", "BV": "constexpr"}
        source = ASTSource(fn, signature, {"BK": 64, "BV": 32})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"]


def test_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    """The interpreter accepts code the compiler rejects: compile ahead of time for an H100."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = "from tests.kernels.test_wkv7 import compile_kernels; compile_kernels()"
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(
        cmd, env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
