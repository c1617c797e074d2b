"""kernels/cpu_lib: how the CPU kernels are built and what a user hears when they cannot be:
each failure is one warning naming its cause and what runs instead."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.kernels import cpu_lib

GCC = shutil.which("gcc") or shutil.which("cc")


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache and no library loaded yet (the real one is restored after)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu_lib.lib.cache_clear()
    yield tmp_path
    cpu_lib.lib.cache_clear()


def _fake_cc(folder: Path, body: str) -> str:
    cc = folder / "fake-cc"
    cc.write_text(f"#!/bin/sh\n{body}\n")
    cc.chmod(0o755)
    return str(cc)


def _warnings_of_lib() -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cpu_lib.lib()
    return got, [str(w.message) for w in caught]


def test_no_compiler_is_one_warning_and_the_torch_paths(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_lib, "_compiler", lambda: None)
    got, said = _warnings_of_lib()
    assert got is None and len(said) == 1
    assert "no C compiler" in said[0] and "torch's int4 kernel" in said[0]


def test_a_failed_build_names_the_compilers_error(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = _fake_cc(
        fresh,
        'case "$*" in *--version*|*-dM*) echo fake 1.0;; *) echo "x.c:1: error: no room" >&2; exit 1;; esac',
    )
    monkeypatch.setenv("CC", cc)
    got, said = _warnings_of_lib()
    assert got is None and len(said) == 1
    assert "did not build (x.c:1: error: no room)" in said[0] and "torch's int4 kernel" in said[0]


@pytest.mark.skipif(GCC is None or not cpu_lib.native_flags(), reason="needs gcc and a native flag")
def test_a_compiler_refusing_the_native_flag_gets_a_portable_build(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = cpu_lib.native_flags()[0]
    body = f'for a in "$@"; do [ "$a" = "{flag}" ] && {{ echo "error: unknown {flag}" >&2; exit 1; }}; done\n'
    monkeypatch.setenv("CC", _fake_cc(fresh, body + f'exec {GCC} "$@"'))
    got, said = _warnings_of_lib()
    assert got is not None and len(said) == 1
    assert f"built without {flag} (error: unknown {flag})" in said[0]
    assert got.kvq_simd() == b"portable"


@pytest.mark.skipif(GCC is None, reason="needs a C compiler")
def test_without_proc_the_key_names_the_targets_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Linux the cache key holds the compiler's own macros for the native target (its CPU
    features), so a library built for another CPU is never loaded from a shared home."""
    assert GCC is not None
    monkeypatch.setattr(cpu_lib, "_cpu_flags", lambda: "")
    native, portable = cpu_lib._target(GCC, False), cpu_lib._target(GCC, True)
    assert native is not None and portable is not None and native != portable
    assert b"__x86_64__" in native or b"__aarch64__" in native or not cpu_lib.native_flags()
