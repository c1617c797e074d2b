"""The device flags' values: --device and -ngl to one device name, --list-devices."""

from __future__ import annotations

import typer

import kvtool


def list_devices(value: bool) -> None:
    """llama.cpp's --list-devices: the GPUs, then exit (before any other flag is checked)."""
    if not value:
        return
    mib = 1024 * 1024
    print("Available devices:")
    devices = kvtool.available_devices()
    for d in devices:
        print(f"  {d.name}: {d.description} ({d.total // mib} MiB, {d.free // mib} MiB free)")
    if not devices:
        print("  (none)")
    raise typer.Exit()


def device_setting(device: str | None, n_gpu_layers: int | None) -> str:
    """The device --device and -ngl ask for: cpu, cuda or cuda:N (cpu when neither is given).
    llama.cpp's spellings are read too: `-dev none` (no offload) and `-dev CUDA0`."""
    name = None
    if device is not None:
        low = device.strip().lower()
        if low in ("cpu", "none"):
            name = "cpu"
        elif low == "cuda" or (
            low.startswith(("cuda:", "cuda")) and low.removeprefix("cuda").lstrip(":").isdigit()
        ):
            name = "cuda" if low == "cuda" else f"cuda:{low.removeprefix('cuda').lstrip(':')}"
        else:
            raise kvtool.KvtoolError(f"--device must be cpu or cuda (cuda:N), got '{device}'")
    if n_gpu_layers is not None and n_gpu_layers < 0:
        raise kvtool.KvtoolError(f"-ngl must be 0 (CPU) or more (GPU), got {n_gpu_layers}")
    by_ngl = None if n_gpu_layers is None else ("cuda" if n_gpu_layers > 0 else "cpu")
    if name is not None and by_ngl is not None and name.split(":")[0] != by_ngl:
        raise kvtool.KvtoolError(f"--device {device} and -ngl {n_gpu_layers} ask for different devices")
    return name or by_ngl or "cpu"
