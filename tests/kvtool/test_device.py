"""The engine's device on a machine without a GPU: the CPU spelled out computes as before, a
missing GPU is one KvtoolError, weights load through the device path, and the CUDA attention
path (visibility from cell metadata, Triton kernels run by the interpreter) replays llama.cpp's
tiny-model scenarios as the CPU path does. tests/kvtool/test_device_cuda.py runs on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtool
from kvtool import graphs
from kvtool import model as model_mod
from kvtool.backend.device_file import DeviceFile
from kvtool.kernels import attention as attention_mod
from kvtool.kernels import store_kv as store_kv_mod
from kvtool.memory import kv_cache_context
from tests.kvtool import device_engine_checks
from tests.kvtool.test_oracle_tiny import DATA, SCENARIOS, rel_err, replay, tiny_model

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")


def _tiny(arch: str) -> str:
    return str(DATA / "models" / f"tiny-{arch}.gguf")


def test_explicit_cpu_is_the_default() -> None:
    z = np.load(DATA / "llama" / "multi_kvu0_faoff.npz")
    a = kvtool.load_model(_tiny("llama"))
    b = kvtool.load_model(_tiny("llama"), device="cpu")
    assert a.device == b.device == torch.device("cpu")
    got = replay(b, z, False)
    assert np.array_equal(got, replay(a, z, False))
    params = kvtool.ContextParams(device="cpu")
    assert kvtool.Context(b, params).device == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_one_error(tiny_llama_path, device: str) -> None:
    for load in (kvtool.Model, kvtool.load_model):
        with pytest.raises(kvtool.KvtoolError, match="sees no CUDA GPU") as e:
            load(tiny_llama_path, device=device)
        assert "\n" not in str(e.value)
    cpu = kvtool.Model(tiny_llama_path)
    with pytest.raises(kvtool.KvtoolError, match="sees no CUDA GPU"):
        kvtool.Context(cpu, kvtool.ContextParams(device=device))


@pytest.mark.parametrize("device", ["mps", "vulkan", "gpu", ""])
def test_unknown_devices_are_refused(tiny_llama_path, device: str) -> None:
    with pytest.raises(kvtool.KvtoolError, match=f"unknown device '{device}'"):
        kvtool.Model(tiny_llama_path, device=device)


def test_weights_modes_are_checked(tiny_llama_path) -> None:
    with pytest.raises(kvtool.ModelLoadError, match="unknown weights mode 'q8'"):
        kvtool.Model(tiny_llama_path, weights="q8")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "lfm2", "granitehybrid", "mamba2", "rwkv7"])
def test_models_load_through_the_device_file(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU path of loading, on the CPU: every tensor is dequantized from bytes copied to
    # the device, and the models read nothing else of the file that DeviceFile does not forward.
    monkeypatch.setattr(model_mod, "on_device", lambda f, device: DeviceFile(f, device))
    z = np.load(
        DATA
        / arch
        / (
            "single_kvu1_faoff.npz"
            if arch in ("llama", "gemma3", "lfm2", "granitehybrid")
            else "single_kvu1.npz"
        )
    )
    got = replay(kvtool.Model(_tiny(arch), weights="f32"), z, True)
    assert rel_err(got, z["logits"]) <= 1e-3


@pytest.mark.parametrize("weights", ["f16", "bf16"])
def test_half_weights_stay_close_to_f32(weights: str) -> None:
    # Matrices and the embedding rounded to 16 bits, activations in float32: the logits move
    # by about the rounding of the weights (bf16: 2^-8 relative), not more.
    z = np.load(DATA / "llama" / "multi_kvu1_faoff.npz")
    got = replay(kvtool.Model(_tiny("llama"), weights=weights), z, True)
    bound = 2e-2 if weights == "bf16" else 3e-3
    assert 1e-6 < rel_err(got, z["logits"]) <= bound


@pytest.fixture
def cells_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention takes the CUDA path on CPU tensors: the cache hands layers cell metadata, not a
    mask, and attention and store_kv run their Triton kernels (in the interpreter)."""
    monkeypatch.setattr(kv_cache_context, "visibility_from_cells", lambda device: True)
    monkeypatch.setattr(attention_mod, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(store_kv_mod, "use_triton", lambda *tensors: True)


@pytest.mark.parametrize(
    ("scenario", "unified"),
    [("fork", 1), ("multi", 0)],  # shared cells in one stream (seq_cp); one stream per sequence
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding windows
def test_cuda_attention_path_replays_the_oracle(
    arch: str, scenario: str, unified: int, cells_path: None
) -> None:
    z = np.load(DATA / arch / f"{scenario}_kvu{unified}_faoff.npz")
    got = replay(tiny_model(arch), z, bool(unified))
    assert rel_err(got, z["logits"]) <= 1e-3
    assert scenario in SCENARIOS


@pytest.mark.parametrize(
    "check", [device_engine_checks.check_tiny_scenarios, device_engine_checks.check_seeded_sampling]
)
def test_engine_checks_run_on_cpu(check) -> None:  # type: ignore[no-untyped-def]
    # what test_device_cuda.py runs on a GPU, here CPU against CPU: the checks themselves work
    check("cpu", quick=True)


def test_the_graph_check_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # check_decode_graphs with graphs re-run on the CPU (tests/kvtool/test_graphs.py's stand-in)
    from tests.kvtool.test_graphs import Lax

    monkeypatch.setattr(graphs, "enabled", lambda device, wanted: wanted)
    monkeypatch.setattr(graphs, "CudaGraph", Lax)
    monkeypatch.setattr(kv_cache_context, "visibility_from_cells", lambda device: True)
    device_engine_checks.check_decode_graphs("cpu", quick=True)
