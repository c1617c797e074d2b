"""The CPU kernels built for aarch64 (NEON, with and without the dot product instruction) and run
under qemu-user: every kernel's outputs on fixed inputs (tests/kernels/c/kernel_vectors.c)
against the portable C build of the same file on this machine: bit for bit where the NEON code
sums the same integers and does the same float operations in the same order as the portable
code (the block matmuls: activations, row kernels, panels; RoPE and the K/V store of every cache
type; attention over quantized K and V caches, the portable code on every build), within
TOLERANCES where it adds in another order.

The same file built for this machine (`-march=native`: AVX2 or AVX-512 here) gives the portable
bits where its code computes alike: activation quantization (ties, NaNs and infinities
included), the half conversions, RoPE and the K/V store of every cache type.

The cross compiler and qemu are Debian's gcc-aarch64-linux-gnu and qemu-user; a CI machine
(root, apt) that lacks them gets them installed here, any other machine without them fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtool.kernels import cpu_lib

KERNELS = Path(cpu_lib.__file__).parent
HARNESS = Path(__file__).parent / "c" / "kernel_vectors.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
PACKAGES = ["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user"]
# Cases whose NEON code adds floats in another order than the portable code: the largest
# difference over the largest value. Attention: 4 lanes of fused multiply-adds and exp4's
# polynomial for the scores' exponentials (the AVX2 build differs from the portable one alike),
# and soft-capping, whose tanhf the C library computes differently on each architecture;
# SwiGLU: ggml's NEON e^x in the SiLU, whose last-bit differences can move a hidden value across
# a rounding step of its int8 quantization before the down matmul.
TOLERANCES = {"attention_": 1e-5, "ffn_silu": 1e-2}
FLAGS = ["-O3", "-std=c11", "-pthread"]  # cpu_lib.py's

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _ensure_toolchain() -> None:
    if shutil.which(CROSS_CC) and shutil.which(QEMU):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=600)
        install = ["apt-get", "install", "-y", "-qq", *PACKAGES]
        subprocess.run(install, capture_output=True, env=env, timeout=900)
    if not (shutil.which(CROSS_CC) and shutil.which(QEMU)):
        need = " ".join(PACKAGES)
        pytest.fail(f"the aarch64 kernel tests need {CROSS_CC} and {QEMU} (apt-get install {need})")


def _run(cmd: list[str]) -> dict[str, list[str]]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    lines = out.splitlines()
    cases = {}
    for line in lines:
        name, *values = line.split(" ")
        assert name not in cases, f"case {name} twice"
        cases[name] = values
    return cases


def _build(cc: str, flags: list[str], exe: Path) -> None:
    sources = [str(p) for p in sorted(KERNELS.glob("*.c"))]
    cmd = [cc, *FLAGS, *flags, f"-I{KERNELS}", str(HARNESS), *sources, "-o", str(exe), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    exe = tmp_path_factory.mktemp("host") / "kernel_vectors"
    _build("cc", [], exe)  # no -march: the portable C code
    cases = _run([str(exe)])
    assert cases["isa"] == ["portable"]
    return cases


@pytest.mark.parametrize(
    ("march", "isa"),
    [("armv8.2-a+dotprod", ["neon-dotprod"]), ("armv8-a", ["neon"])],
    ids=["neon-dotprod", "neon"],
)
def test_aarch64_kernels_give_the_portable_bits(
    reference: dict[str, list[str]], tmp_path: Path, march: str, isa: list[str]
) -> None:
    _ensure_toolchain()
    exe = tmp_path / "kernel_vectors"
    _build(CROSS_CC, [f"-march={march}", "-static"], exe)
    cases = _run([QEMU, str(exe)])
    assert cases.pop("isa") == isa
    expected = {k: v for k, v in reference.items() if k != "isa"}
    assert not [k for k in cases if k.startswith("bad")], cases.keys()
    assert cases.keys() == expected.keys()
    assert len(expected) > 90  # every kernel: activations, matmuls (rows, panels), FFN, RoPE/store, attention
    differ = [k for k in expected if cases[k] != expected[k] and not k.startswith(tuple(TOLERANCES))]
    assert not differ, f"{len(differ)} cases differ from the portable build: {differ[:8]}"
    for prefix, tol in TOLERANCES.items():
        for name in (k for k in expected if k.startswith(prefix)):
            got, want = _floats(cases[name]), _floats(expected[name])
            err = float(np.abs(got - want).max() / np.abs(want).max())
            assert err < tol, (name, err)


# What the x86 SIMD code computes as the portable code does (the matmuls, feed-forwards and
# attention add floats in ggml's x86 order instead)
NATIVE_EQUAL = ("act_", "half_", "rope_", "store_")


def test_the_native_build_gives_the_portable_bits_where_it_computes_alike(
    reference: dict[str, list[str]], tmp_path: Path
) -> None:
    exe = tmp_path / "kernel_vectors"
    _build("cc", cpu_lib.native_flags(), exe)
    cases = _run([str(exe)])
    assert cases.keys() == reference.keys()
    same = [k for k in reference if k.startswith(NATIVE_EQUAL)]
    assert len(same) > 60 and "act_edges_q8_1" in same and "half_to_float" in same
    differ = [k for k in same if cases[k] != reference[k]]
    assert not differ, f"the native build ({cases['isa'][0]}) differs from the portable one: {differ}"


def _floats(words: list[str]) -> np.ndarray:
    return np.array([int(w, 16) for w in words], dtype=np.uint32).view(np.float32).astype(np.float64)
