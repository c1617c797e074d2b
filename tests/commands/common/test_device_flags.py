"""--device / -dev, -ngl and --weights on the verbs that load a model: the CPU spelled any way
computes the same tokens, and a GPU that is not there is one `error:` line (exit 2) before
anything is loaded. (With a GPU, tests/kvtool/test_device_cuda.py runs the engine on it.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtool
from kvtool.commands import common

KVTOOL = [sys.executable, "-m", "kvtool.commands"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTOOL, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("device", "ngl", "want"),
    [
        (None, None, "cpu"),
        ("cpu", None, "cpu"),
        ("none", None, "cpu"),  # llama.cpp's -dev none: no offload
        ("CPU", 0, "cpu"),
        (None, 0, "cpu"),
        (None, 1, "cuda"),
        (None, 99, "cuda"),
        ("cuda", 99, "cuda"),
        ("cuda:1", None, "cuda:1"),
        ("CUDA0", None, "cuda:0"),  # llama.cpp's device name
    ],
)
def test_device_setting(device: str | None, ngl: int | None, want: str) -> None:
    assert common.devices.device_setting(device, ngl) == want


@pytest.mark.parametrize(
    ("device", "ngl", "msg"),
    [
        ("tpu", None, "--device must be cpu or cuda"),
        ("cuda:x", None, "--device must be cpu or cuda"),
        ("cuda", 0, "ask for different devices"),
        ("cpu", 99, "ask for different devices"),
        (None, -1, "-ngl must be 0"),
    ],
)
def test_device_setting_refuses(device: str | None, ngl: int | None, msg: str) -> None:
    with pytest.raises(kvtool.KvtoolError, match=msg):
        common.devices.device_setting(device, ngl)


def test_cpu_spellings_give_the_same_tokens(tiny_llama_path: Path) -> None:
    base = ["run", "-m", str(tiny_llama_path), "-p", "the cat", "-n", "6", "--temp", "0", "--no-chat"]
    want = cli(*base)
    assert want.returncode == 0, want.stderr
    for extra in (["--device", "cpu"], ["-dev", "none"], ["-ngl", "0"], ["--weights", "f32"]):
        got = cli(*base, *extra)
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout, extra


def test_half_weights_run(tiny_llama_path: Path) -> None:
    r = cli("run", "-m", str(tiny_llama_path), "-p", "the cat", "-n", "4", "--no-chat", "--weights", "bf16")
    assert r.returncode == 0, r.stderr


@no_cuda
@pytest.mark.parametrize(
    "args",
    [
        ["run", "--device", "cuda", "-p", "hi"],
        ["batched-bench", "-dev", "cuda"],
        ["bench", "--device", "cuda"],
        ["state", "save", "--device", "cuda", "-p", "hi", "-o", "/tmp/never-written.kvstate"],
    ],
)
def test_a_missing_gpu_is_one_error_before_loading(args: list[str]) -> None:
    # the model does not exist: the refusal must come first, naming the device
    r = cli(*args, "-m", "/nonexistent/model.gguf")
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert line.startswith("error: device 'cuda") and "sees no CUDA GPU" in line, line
    assert "\n" not in line
    assert r.stdout == ""  # bench: not its table's header first


@no_cuda
@pytest.mark.parametrize(
    "args", [["run", "-ngl", "99", "-p", "hi"], ["bench", "-ngl", "99"], ["parallel", "--n-gpu-layers", "1"]]
)
def test_gpu_layers_without_a_gpu_warn_and_go_on_on_the_cpu(args: list[str]) -> None:
    """A llama.cpp command line copied from a GPU machine runs (llama.cpp: "no usable GPU
    found, --gpu-layers option will be ignored"): here it goes on to the missing model."""
    r = cli(*args, "-m", "/nonexistent/model.gguf")
    assert r.returncode == 2, r.stderr
    warning, error = r.stderr.strip().splitlines()
    assert warning.startswith("warning: no usable GPU found, -ngl") and "computing on the CPU" in warning
    assert error.startswith("error: ") and "model.gguf" in error


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["run", "--device", "tpu"], "--device must be cpu or cuda (cuda:N), got 'tpu'"),
        (["run", "--device", "cuda", "-ngl", "0"], "--device cuda and -ngl 0 ask for different devices"),
        (["bench", "--weights", "q8"], "--weights must be one of auto, f32, f16, bf16, got 'q8'"),
    ],
)
def test_bad_device_flags_are_one_error(args: list[str], msg: str) -> None:
    r = cli(*args, "-m", "/nonexistent/model.gguf")
    assert r.returncode == 2
    line = r.stderr.strip()
    assert line.startswith("error: ") and msg in line and "\n" not in line, line


@no_cuda
@pytest.mark.parametrize(
    "verb", [["run"], ["parallel"], ["bench"], ["batched-bench"], ["state", "save"], ["state", "load"]]
)
def test_list_devices_without_a_gpu(verb: list[str]) -> None:
    # llama.cpp's --list-devices: the GPUs, "(none)" on a machine without one, then exit 0
    # before anything else is checked or loaded (here a model that does not exist)
    r = cli(*verb, "--list-devices", "-m", "no-such-model.gguf")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Available devices:\n  (none)\n"


Captured = pytest.CaptureFixture[str]


def test_list_devices_names_each_gpu(monkeypatch: pytest.MonkeyPatch, capsys: Captured) -> None:
    # two GPUs as torch would report them: named as --device reads them (CUDA0, CUDA1)
    import typer

    from kvtool import device

    gib = 1 << 30
    monkeypatch.setattr(device, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H100 80GB HBM3 #{i}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: ((70 + i) * gib, 80 * gib))
    with pytest.raises(typer.Exit):
        common.devices.list_devices(True)
    assert capsys.readouterr().out == (
        "Available devices:\n"
        "  CUDA0: NVIDIA H100 80GB HBM3 #0 (81920 MiB, 71680 MiB free)\n"
        "  CUDA1: NVIDIA H100 80GB HBM3 #1 (81920 MiB, 72704 MiB free)\n"
    )
    assert [d.name for d in kvtool.available_devices()] == ["CUDA0", "CUDA1"]
