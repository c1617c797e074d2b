"""`state load` takes what the file knows (issue 27): the model it was saved with, its KV types
and layout, unless the command line gives them; a flag that contradicts the file is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import kvtool_cli
from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama


@pytest.fixture
def saved(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Path:
    out = tmp_path / "a.kvs"
    args = ["-m", str(tiny_llama_path), "-c", "512", "-ctk", "f16", "-kvu", "-o", str(out)]
    r = kvtool_cli(monkeypatch, capsys, "state", "save", *args, "-p", "the cat sat")
    assert r.code == 0, r.err
    return out


def test_load_needs_neither_the_model_nor_the_kv_flags(
    saved: Path, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    r = kvtool_cli(monkeypatch, capsys, "state", "load", "-i", str(saved), "-c", "512", "-n", "4")
    assert r.code == 0, r.err
    want = kvtool_cli(
        monkeypatch, capsys, "state", "load", "-i", str(saved), "-n", "4", "-c", "512",
        "-m", str(tiny_llama_path), "-ctk", "f16", "-kvu",
    )  # fmt: skip
    assert want.code == 0 and r.out == want.out  # the same continuation as with every flag given


def test_a_flag_that_contradicts_the_file_is_refused(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    r = kvtool_cli(monkeypatch, capsys, "state", "load", "-i", str(saved), "-c", "512", "-ctk", "f32")
    assert "K type" in r.one_error_line()
    other = write_tiny_llama(tmp_path / "other.gguf", TinyLlama(seed=1))
    r = kvtool_cli(monkeypatch, capsys, "state", "load", "-i", str(saved), "-c", "512", "-m", str(other))
    assert "another model" in r.one_error_line()


def test_a_model_that_moved_is_named(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "moved.gguf"
    model.write_bytes(tiny_llama_path.read_bytes())
    out = tmp_path / "b.kvs"
    r = kvtool_cli(
        monkeypatch, capsys, "state", "save", "-m", str(model), "-c", "512", "-o", str(out), "-p", "x"
    )
    assert r.code == 0, r.err
    model.unlink()
    line = kvtool_cli(monkeypatch, capsys, "state", "load", "-i", str(out), "-c", "512").one_error_line()
    assert str(model) in line and "give -m" in line


@pytest.mark.parametrize("arch", ["gemma3", "granitehybrid"])
def test_a_composite_memory_gives_its_kv_types_and_layout(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sliding-window model's base and window caches, a hybrid's attention part: the file's
    K/V types and layout are read from its KV parts (state load said "K type differ")."""
    model = Path(__file__).parents[2] / "data" / "tiny" / "models" / f"tiny-{arch}.gguf"
    out = tmp_path / "c.kvs"
    flags = ["-c", "512", "-ctk", "bf16", "-ctv", "bf16", "-kvu"]
    r = kvtool_cli(
        monkeypatch, capsys, "state", "save", "-m", str(model), *flags, "-o", str(out), "-p", "a b c"
    )
    assert r.code == 0, r.err
    r = kvtool_cli(monkeypatch, capsys, "state", "load", "-i", str(out), "-c", "512", "-n", "3")
    assert r.code == 0, r.err
    want = kvtool_cli(
        monkeypatch, capsys, "state", "load", "-i", str(out), "-n", "3", "-m", str(model), *flags
    )
    assert want.code == 0 and r.out == want.out
