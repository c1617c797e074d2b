"""What the verbs share: -t sets the threads once, context warnings become one line, the
fetch progress of the registry is shown on the console."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import kvtool
import kvtool.commands.batched_bench
import kvtool.commands.bench  # registers the verbs: with one verb typer drops its name
from kvtool.commands import app, common


def test_threads_flag_sets_the_threads_the_run_reports(tiny_llama_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        args = ["batched-bench", "-m", str(tiny_llama_path), "-npp", "4", "-ntg", "1", "-t", "1"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "n_threads = 1" in result.stdout and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_context_flags_map_to_context_params(tiny_llama: kvtool.Model) -> None:
    flags = common.ContextFlags(300, 64, 16, kv_unified=True, swa_full=True, type_k="f16", type_v="bf16")
    assert flags.params(3) == kvtool.ContextParams(
        n_ctx=300,
        n_batch=64,
        n_ubatch=16,
        n_seq_max=3,
        kv_unified=True,
        swa_full=True,
        type_k="f16",
        type_v="bf16",
    )


def test_an_uneven_split_is_one_line_on_the_console(tiny_llama: kvtool.Model) -> None:
    out = io.StringIO()
    params = common.ContextFlags(ctx_size=1000, batch_size=512).params(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may escape as a Python warning
        ctx = common.make_context(tiny_llama, params, Console(file=out, width=200))
        common.make_context(tiny_llama, params, None)
    assert ctx.n_ctx_seq == 512  # pad256(1000 // 3)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "1000" in lines[0]


def test_fetch_bar_ends_with_the_verified_size() -> None:
    out = io.StringIO()
    bar = common.FetchBar(Console(file=out, width=200), "tiny")
    bar("download", 0, 0)
    for done in (100, 2_000_000):
        bar("extract", done, 2_000_000)
    bar("verified", 2_000_000, 2_000_000)
    bar.close()  # idempotent: the verb closes it whatever happened
    assert out.getvalue().splitlines()[-1].startswith("tiny: 2.0 MB, sha256 ok, ")


@pytest.mark.parametrize(
    ("thold", "mode", "want"),
    [(None, None, "none"), (0.0, None, "none"), (-1.0, "on-fail", "on-fail"), (0.25, None, "threshold=0.25")],
)
def test_defrag_flags_map_to_one_policy(thold: float | None, mode: str | None, want: str) -> None:
    assert common.DefragFlags(thold, mode).setting() == want
    assert common.ContextFlags().params(1, defrag=want).defrag == want


@pytest.mark.parametrize(
    "verb", [["bench", "-p", "4", "-n", "2", "-r", "1"], ["batched-bench", "-npp", "4", "-ntg", "2"]]
)
def test_benchmarks_run_no_refresh_thread_off_a_terminal(
    tiny_llama_path: Path, verb: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spinner's refresh thread costs a few percent of a benchmark: none is started where
    nothing is drawn (CliRunner's output is not a terminal)."""
    import threading

    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(type(self).__name__)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    result = CliRunner().invoke(app, [*verb, "-m", str(tiny_llama_path)])
    assert result.exit_code == 0, result.output
    assert not [n for n in started if "Refresh" in n or "Live" in n], started


def test_timed_displays_redraw_slowly_on_a_terminal() -> None:
    tty = Console(file=io.StringIO(), force_terminal=True)
    assert common.timed_refresh(tty) == {"auto_refresh": True, "refresh_per_second": 2}
    assert common.timed_refresh(Console(file=io.StringIO()))["auto_refresh"] is False
    with common.timed_status(tty, "PP = 1") as shown:
        assert shown is not None
    with common.timed_status(Console(file=io.StringIO()), "PP = 1") as shown:
        assert shown is None


def test_a_lazy_console_is_a_console_to_rich() -> None:
    """Module-level consoles are made on first use (no rich for --help); rich's Live locks its
    console with `with console:` and Progress takes the real one (a long prompt's bar)."""
    from rich.console import Console
    from rich.progress import Progress

    from kvtool.commands.common.text import lazy_console, real_console

    lazy = lazy_console(stderr=True)
    with lazy:
        pass
    assert isinstance(real_console(lazy), Console) and real_console(lazy) is real_console(lazy)
    with Progress(console=real_console(lazy)) as p:
        p.add_task("x", total=1)
