"""A command's output file is checked before the work, not after it (issue 14, defect 8):
`parallel --json/--trace` and `defrag-sim --plot` into a missing folder, onto a directory or
over a file of another kind are one line before any request or simulation; a summary
replaces the previous one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.defrag_sim
import kvtool.commands.defrag_sim.simulator
import kvtool.commands.parallel  # registers the verbs
from kvtool.commands import app
from kvtool.common import registry

runner = CliRunner()


def forbidden(*_: object, **__: object) -> None:
    raise AssertionError("the work started before the output path was checked")


def places(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "dir").mkdir()
    (tmp_path / "notes.txt").write_text("my notes\n")
    return {
        "missing": (tmp_path / "missing" / "out", "no directory"),
        "dir": (tmp_path / "dir", "is a directory"),
        "other": (tmp_path / "notes.txt", "exists and is not a kvtool"),
    }


@pytest.mark.parametrize("flag", ["--json", "--trace"])
@pytest.mark.parametrize("place", ["missing", "dir", "other"])
def test_parallel_checks_its_outputs_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, place: str
) -> None:
    path, msg = places(tmp_path)[place]
    monkeypatch.setattr(registry, "resolve_model", forbidden)
    r = runner.invoke(app, ["parallel", "-np", "1", "-ns", "1", flag, str(path)])
    assert isinstance(r.exception, kvtool.KvtoolError) and msg in str(r.exception), r.exception
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


@pytest.mark.parametrize(
    ("name", "msg"),
    [("missing/fig.png", "no directory"), ("dir.png", "is a directory"), ("notes.png", "is not a PNG image")],
)
def test_defrag_sim_checks_its_figure_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, msg: str
) -> None:
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "notes.png").write_text("not a figure\n")
    monkeypatch.setattr(kvtool.commands.defrag_sim.simulator, "simulate", forbidden)
    r = runner.invoke(app, ["defrag-sim", "--requests", "4", "--plot", str(tmp_path / name)])
    assert isinstance(r.exception, kvtool.KvtoolError) and msg in str(r.exception), r.exception
    assert (tmp_path / "notes.png").read_text() == "not a figure\n"


def test_parallel_json_replaces_its_own_summary(tiny_llama_path: Path, tmp_path: Path) -> None:
    (tmp_path / "system.txt").write_text("be brief")
    js = tmp_path / "run.json"
    args = ["parallel", "-m", str(tiny_llama_path), "-c", "512", "-np", "1", "-ns", "1", "-n", "2"]
    args += ["--system-file", str(tmp_path / "system.txt"), "--no-progress", "--json", str(js)]
    for seed in ("1", "2"):
        r = runner.invoke(app, [*args, "-s", seed], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert json.loads(js.read_text())["mode"] == "local"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "system.txt"]
