"""A normal (non-editable) install must carry every subpackage: commands/ and kernels/ are
mapped into kvtool through package-dir, and an unlisted subpackage would be dropped silently."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_and_runs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, ROOT],
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
    probe = (
        "import kvtool, kvtool.commands.run.chat, kvtool.commands.bench.logic, kvtool.commands.common, "
        "kvtool.commands.parallel.http, kvtool.commands.batched_bench.logic, kvtool.commands.state, "
        "kvtool.kernels.attention, kvtool.memory.kv_cache, kvtool.models.llama; print(kvtool.__file__)"
    )
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(site) in r.stdout
