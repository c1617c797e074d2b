"""kvtool's GGUF parser against gguf.GGUFReader (the reference), and its errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile

DATA = Path(__file__).parent.parent / "data" / "tiny" / "models"


def reference_value(field):  # type: ignore[no-untyped-def]
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode() for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data])
    return field.contents()


@pytest.mark.parametrize("name", ["tiny-llama.gguf", "tiny-gemma3.gguf"])
def test_matches_gguf_reader(name: str) -> None:
    path = DATA / name
    ours, ref = GGUFFile(path), GGUFReader(path)
    assert set(ours.keys()) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key in ours.keys():  # noqa: SIM118  (GGUFFile is not a mapping)
        want = reference_value(ref.fields[key])
        got = ours.get(key)
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert got == want, key
    assert ours.tensor_names() == [t.name for t in ref.tensors]
    for t in ref.tensors:
        assert ours.tensor_shape(t.name) == tuple(reversed(t.shape.tolist()))
        assert ours.tensor_type(t.name) == t.tensor_type.name
        raw = ours.tensor_bytes(t.name).numpy()
        np.testing.assert_array_equal(raw, np.asarray(t.data).view(np.uint8).reshape(-1))


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    blob = (DATA / "tiny-llama.gguf").read_bytes()
    for n in (10, 200, len(blob) // 2):
        p = tmp_path / f"cut{n}.gguf"
        p.write_bytes(blob[:n])
        with pytest.raises(ModelLoadError, match=r"truncated|corrupt"):
            GGUFFile(p)
    p = tmp_path / "text.gguf"
    p.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        GGUFFile(p)
    with pytest.raises(ModelLoadError, match="not found"):
        GGUFFile(tmp_path / "missing.gguf")


def test_a_model_path_that_cannot_be_read_names_itself() -> None:
    """/proc/self/mem opens but its first read fails (EIO): one ModelLoadError naming the path
    (it was an OSError saying only 'Input/output error')."""
    with pytest.raises(ModelLoadError, match=r"cannot read /proc/self/mem: Input/output error"):
        GGUFFile("/proc/self/mem")
