"""A normal (non-editable) install must carry every subpackage: commands/ and kernels/ are
mapped into kvtool through package-dir, and an unlisted subpackage would be dropped silently."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_and_runs(tmp_path: Path) -> None:
    # built from a copy of the sources: setuptools builds in place, and the files a stale build/
    # of the checkout holds would go into the wheel and hide a subpackage the list lacks
    src = tmp_path / "src"
    for name in ("kvtool", "commands", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("kvtool-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # dependencies come from the test environment; kvtool itself only from the wheel
    deps = sysconfig.get_paths()["purelib"]
    (site / "deps.pth").write_text(deps + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    r = subprocess.run([py, "-m", "kvtool.commands", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "run" in r.stdout and "models" in r.stdout
    # every module of the source tree, under the name it is installed as (a subpackage missing
    # from pyproject's list is a ModuleNotFoundError here; kvtool.backend once was)
    modules = sorted(_installed_name(p) for p in _sources())
    probe = "import importlib, sys, kvtool\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
    probe += "print(kvtool.__file__)"
    r = subprocess.run([py, "-c", probe, *modules], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(site) in r.stdout


def _sources() -> list[Path]:
    """The installed packages' modules (a verb's __main__ runs the CLI: left out)."""
    return [
        p
        for top in ("kvtool", "commands", "kernels")
        for p in sorted((ROOT / top).rglob("*.py"))
        if p.name != "__main__.py" and "__pycache__" not in p.parts
    ]


def _installed_name(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] in ("commands", "kernels"):
        parts = ["kvtool", *parts]
    return ".".join(parts)
