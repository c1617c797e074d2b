"""`kvtool defrag-sim` through the CLI: same seed same table, formats, the figure, one-line
errors; and a trace recorded by `kvtool parallel --trace` replayed on the tiny model."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.parallel  # registers the verb (the suite may run this file alone)
from kvtool.commands import app, main
from kvtool.commands.defrag_sim.trace import TraceError, read_trace
from kvtool.commands.defrag_sim.workload import Copy, Decode, Free, Run
from kvtool.common.cells import read_kv_dims
from tests.helpers.tiny_gguf import TinyLlama

runner = CliRunner()
SMALL = [
    "--clients",
    "8",
    "--requests",
    "60",
    "--prompt-len",
    "uniform:60",
    "--gen-len",
    "exp:40",
    "-c",
    "1200",
]


def cli(*args: str) -> str:
    r = runner.invoke(app, ["defrag-sim", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def table(*args: str) -> dict[str, dict[str, str]]:
    return {row["policy"]: row for row in csv.DictReader(io.StringIO(cli(*args, "-o", "csv")))}


def test_same_seed_same_table() -> None:
    a, b = cli(*SMALL, "-kvu", "-s", "3"), cli(*SMALL, "-kvu", "-s", "3")
    assert a == b and "| non-contiguous |" in a and "| paged |" in a
    assert cli(*SMALL, "-kvu", "-s", "4") != a


def test_formats_agree_and_policies_differ_as_expected() -> None:
    t = table(*SMALL, "-kvu")
    doc = json.loads(cli(*SMALL, "-kvu", "-o", "json"))
    assert [p["policy"] for p in doc["policies"]] == list(t)
    assert all(str(p["holes_pct"]) == t[p["policy"]]["holes_pct"] for p in doc["policies"])
    assert doc["kv"].startswith("unified: 1 stream of 1200 cells")
    # peak demand 1195 cells: only the contiguous search without compaction fails
    assert int(t["contiguous"]["failed_allocs"]) > 0 and int(t["contiguous"]["dropped_requests"]) > 0
    assert int(t["non-contiguous"]["failed_allocs"]) == 0 and int(t["on-fail"]["failed_allocs"]) == 0
    assert int(t["on-fail"]["compactions"]) > 0 and int(t["on-fail"]["cells_moved"]) > 0
    assert float(t["threshold"]["holes_pct"]) < float(t["non-contiguous"]["holes_pct"])


def test_model_bytes_and_given_bandwidth(tiny_llama_path: Path) -> None:
    t = table(*SMALL, "-kvu", "--policy", "on-fail", "-m", str(tiny_llama_path), "--copy-bw", "1")
    moved = int(t["on-fail"]["cells_moved"])
    c = TinyLlama()
    cell = c.n_layer * 2 * c.n_head_kv * (c.n_embd // c.n_head) * 2  # layers, K+V, heads, head dim, f16
    assert read_kv_dims(tiny_llama_path).cell_bytes() == cell
    assert float(t["on-fail"]["mib_moved"]) == round(moved * cell / 2**20, 1)
    assert float(t["on-fail"]["move_ms"]) == round(1e3 * moved * cell / 1e9, 1)


def test_model_bytes_in_the_cache_types() -> None:
    """-ctk/-ctv count a cell in their types: q8_0 is 34 bytes per 32 values, q4_0 18, f16 64."""
    gemma3 = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-gemma3.gguf"
    dims = read_kv_dims(gemma3)
    values = sum(dims.n_head_kv) * dims.head_dim_k  # per cell, for each of K and V
    assert dims.cell_bytes() == 2 * values * 2
    assert dims.cell_bytes("q8_0", "q4_0") == values // 32 * (34 + 18)
    args = (*SMALL, "-kvu", "--policy", "on-fail", "-m", str(gemma3), "--copy-bw", "1")
    t = table(*args, "-ctk", "q8_0", "-ctv", "q4_0")
    moved = int(t["on-fail"]["cells_moved"])
    assert float(t["on-fail"]["mib_moved"]) == round(moved * dims.cell_bytes("q8_0", "q4_0") / 2**20, 1)
    doc = json.loads(cli(*args, "-ctk", "q8_0", "-ctv", "q4_0", "-o", "json"))
    assert "K q8_0 + V q4_0" in doc["bytes"]
    with pytest.raises(
        kvtool.KvtoolError, match="K cache type q8_0 with block size 32 does not divide n_embd_head_k=16"
    ):
        read_kv_dims(Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-llama.gguf").cell_bytes(
            "q8_0"
        )


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "f.png"
    cli(*SMALL, "--policy", "contiguous", "--policy", "paged", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["-o", "xml"], "expected md, csv or json"),
        (["--policy", "best"], "unknown policy best"),
        (["--prompt-len", "zipf:3"], "KIND is one of"),
        (["--clients", "65"], "must be in [1, 64]"),
        (["--defrag-thold", "1.5"], "must be in [0, 1)"),
        (["--page-size", "0"], "must be >= 1"),
        (["--trace", "/nonexistent/t.jsonl"], "cannot read"),
        (["--clients", "abc"], "--clients"),
        (["--replay"], "needs -m MODEL"),
    ],
)
def test_bad_flags_are_one_line_errors(
    args: list[str], msg: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kvtool", "defrag-sim", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and msg in err, err


def test_bad_flag_in_a_process() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvtool.commands", "defrag-sim", "--max-moves", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def test_trace_reader(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    lines = [
        {"kvtool_trace": 1, "n_ctx": 64, "n_seq": 3, "n_ubatch": 16, "kv_unified": True},
        {"step": 0, "event": "alloc", "seq": 0, "pos": 0, "n_tokens": 5},
        {"step": 1, "event": "copy", "seq": 1, "src": 0},
        {"step": 1, "event": "alloc", "seq": 1, "pos": 5, "n_tokens": 1},
        {"step": 1, "event": "alloc", "seq": 2, "pos": 0, "n_tokens": 1},
        {"step": 2, "event": "alloc", "seq": 1, "pos": 6, "n_tokens": 1},
        {"step": 2, "event": "alloc", "seq": 2, "pos": 1, "n_tokens": 1},
        {"step": 3, "event": "free", "seq": 1},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w, header = read_trace(p)
    assert header["n_ubatch"] == 16 and (w.n_seq, w.n_steps, w.n_requests) == (3, 3, 3)
    assert w.ops == (Decode(0, ((0, 5),)), Copy(1, 0, 1), Run(1, (1, 2), 2), Free(3, 1))
    p.write_text(json.dumps(lines[0]) + '\n{"step": 0, "event": "alloc", "seq": 7, "n_tokens": 1}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: bad event"):
        read_trace(p)


@pytest.mark.parametrize("unified", [True, False])
def test_parallel_trace_replays(tiny_llama_path: Path, tmp_path: Path, unified: bool) -> None:
    tr = tmp_path / "t.jsonl"
    kvu = ["-kvu"] if unified else []
    args = [
        "parallel",
        "--no-progress",
        "-m",
        str(tiny_llama_path),
        "-np",
        "2",
        "-ns",
        "4",
        "-n",
        "6",
        "-s",
        "1",
    ]
    r = runner.invoke(app, [*args, "-c", "12288", "-pps", *kvu, "--trace", str(tr)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    w, header = read_trace(tr)
    assert header["kv_unified"] is unified and header["n_seq"] == 3
    # every client request: its own prompt after the shared system prompt, then its answer
    decoded = sum(n for op in w.ops if isinstance(op, Decode) for _, n in op.parts)
    decoded += sum(op.k * len(op.seqs) for op in w.ops if isinstance(op, Run))
    n_sys = next(op.parts[0][1] for op in w.ops if isinstance(op, Decode))
    done = json.loads(cli("--trace", str(tr), *kvu, "-o", "json"))
    assert done["kv"].startswith("unified" if unified else "split: 3 streams")
    assert all(p["failed_allocs"] == 0 for p in done["policies"])
    # the system prompt is copied once to each client, which keeps it between its requests
    assert n_sys > 0 and decoded > n_sys and sum(isinstance(op, Copy) for op in w.ops) == 2


@pytest.mark.parametrize(
    ("extra", "msg"),
    [
        (["--trace", "/nonexistent/dir/t.jsonl"], "cannot write the trace"),
        (["--trace", "t.jsonl", "--server", "http://127.0.0.1:9"], "records a local run"),
    ],
)
def test_parallel_trace_errors_are_one_line(
    tiny_llama_path: Path,
    extra: list[str],
    msg: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["kvtool", "parallel", "--no-progress", "-m", str(tiny_llama_path), "-ns", "1", "-n", "2", *extra]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: ") and msg in err[-1], err


def test_replay_runs_the_first_compaction_on_a_real_cache(tiny_llama_path: Path) -> None:
    """on-fail compacts in this workload: the engine moves the rows of a tiny model's cache and
    the next logits equal those of a cache built directly in the compacted layout."""
    args = ["--clients", "8", "--requests", "60", "-c", "2048", "-kvu", "--prompt-len", "uniform:100"]
    args += ["--gen-len", "exp:60", "--policy", "on-fail", "--copy-bw", "10", "-m", str(tiny_llama_path)]
    r = runner.invoke(app, ["defrag-sim", *args, "--replay"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    line = [x for x in r.stdout.splitlines() if x.startswith("replay (on-fail")]
    assert (
        len(line) == 1 and "moves in" in line[0] and "equal a cache built in the compacted layout" in line[0]
    )
    diff = float(line[0].rsplit(" ", 1)[1])
    assert diff < 1e-4  # against the logits before compaction: float noise only


def test_replay_without_a_compaction_is_one_line(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*SMALL, "--policy", "non-contiguous", "--copy-bw", "10", "-m", str(tiny_llama_path), "--replay"]
    monkeypatch.setattr(sys, "argv", ["kvtool", "defrag-sim", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the timing line: known only once simulated
    assert e.value.code == 2 and last.startswith("error: --replay: no policy compacted")
    assert err.count("error") == 1


def test_an_interrupted_trace_leaves_the_old_file(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trace goes through the atomic writer: a run stopped halfway (Ctrl-C here) leaves the
    previous trace whole and no temporary file beside it."""
    from kvtool.commands.parallel.sim import ParallelSim

    tr = tmp_path / "t.jsonl"
    old = b'{"kvtool_trace":1,"n_ctx":64,"n_seq":2,"n_ubatch":16,"kv_unified":true}\n'
    tr.write_bytes(old)
    real = ParallelSim.run

    def interrupted(self: ParallelSim, *a: object, **k: object) -> None:
        self.ctx.decode(kvtool.Batch.from_tokens([5, 6, 7], seq_id=1))  # recorded, then stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(ParallelSim, "run", interrupted)
    args = [
        "parallel",
        "--no-progress",
        "-m",
        str(tiny_llama_path),
        "-ns",
        "2",
        "-n",
        "4",
        "--trace",
        str(tr),
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 130  # typer turns the interrupt into Abort
    assert tr.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    monkeypatch.setattr(ParallelSim, "run", real)
    r = runner.invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0 and tr.read_bytes() != old and read_trace(tr)[1]["n_seq"] == 2


def test_the_figure_replaces_its_file_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A figure that fails halfway through being written leaves the previous one whole."""
    from matplotlib.figure import Figure

    png = tmp_path / "f.png"
    png.write_bytes(b"\x89PNG old")

    def broken(self: Figure, fname: object, **k: object) -> None:
        with open(fname, "wb") if isinstance(fname, (str, Path)) else contextlib.nullcontext(fname) as f:
            f.write(b"\x89PNG\r\n\x1a\n half")  # type: ignore[union-attr]
        raise MemoryError

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(MemoryError):
        runner.invoke(app, ["defrag-sim", *SMALL, "--plot", str(png)], catch_exceptions=False)
    assert png.read_bytes() == b"\x89PNG old" and [p.name for p in tmp_path.iterdir()] == ["f.png"]


def test_the_defaults_show_what_the_policies_differ_in() -> None:
    """Without flags the clients share one buffer, where their requests leave holes: the
    policies' rows differ (in one stream per client they all tie)."""
    out = json.loads(cli("--requests", "200", "-o", "json"))
    rows = out["policies"]
    assert len({json.dumps({k: v for k, v in r.items() if k != "policy"}, sort_keys=True) for r in rows}) == 5
    split = json.loads(cli("--requests", "200", "-o", "json", "-no-kvu"))
    assert split["kv"].startswith("split") and out["kv"].startswith("unified")
