"""Fixtures the compiled-kernel tests share."""

from __future__ import annotations

import ctypes

import pytest

from kvtool.kernels import cpu_lib


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The kernels built for this CPU (AVX2 where it has it), then the portable C build."""
    if request.param == "native":
        built = cpu_lib.lib()
    else:
        cc = cpu_lib._compiler()
        path = cpu_lib.build(cc, portable=True) if cc else None
        built = cpu_lib.load(path) if path is not None else None
    if built is None:
        pytest.skip("this build is not available")
    return built
