"""Fixtures the compiled-kernel tests share."""

from __future__ import annotations

import ctypes

import pytest

from kvtool.kernels import cpu_lib


def portable_build() -> ctypes.CDLL | None:
    """The kernels built without the native flag (the plain C code), or None."""
    cc = cpu_lib._compiler()
    path = cpu_lib.build(cc, portable=True) if cc else None
    return cpu_lib.load(path) if path is not None else None


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The kernels built for this CPU (AVX2 where it has it), then the portable C build."""
    built = cpu_lib.lib() if request.param == "native" else portable_build()
    if built is None:
        pytest.skip("this build is not available")
    return built
