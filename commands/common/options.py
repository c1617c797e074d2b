"""The flags several verbs share, each declared once: groups of typer options as frozen
dataclasses (`LoadFlags`, `ContextFlags`, `DefragFlags`, `SamplingFlags`), spread into a verb's
command line by `@flags`, and mapped to what the engine takes (a loaded model, ContextParams,
SamplerParams) by their own methods."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, get_type_hints

import typer

import kvtool
from kvtool.commands.common import devices, values
from kvtool.common import registry

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
    int | None,
    typer.Option("-t", "--threads", help="CPU threads.", callback=values.bounds(1, values.MAX_THREADS)),
]
ThreadsBatchOpt = Annotated[
    int | None,
    typer.Option(
        "-tb",
        "--threads-batch",
        help="CPU threads for prompts (ubatches of many tokens); default: as -t.",
        callback=values.bounds(1, values.MAX_THREADS),
    ),
]
FlashAttnOpt = Annotated[
    str,
    typer.Option(
        "-fa",
        "--flash-attn",
        help="llama.cpp's flash attention: on or auto (kvtool's attention is always fused); off is refused.",
    ),
]
KV_TYPES_HELP = "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 or iq4_nl"
TypeKOpt = Annotated[str, typer.Option("-ctk", "--cache-type-k", help=f"K cache type: {KV_TYPES_HELP}.")]
TypeVOpt = Annotated[str, typer.Option("-ctv", "--cache-type-v", help=f"V cache type: {KV_TYPES_HELP}.")]
SwaFullOpt = Annotated[
    bool,
    typer.Option("--swa-full", help="Full-size sliding-window caches (no cell reuse outside the window)."),
]
KvUnifiedOpt = Annotated[
    bool,
    typer.Option(
        "--kv-unified/--no-kv-unified",
        "-kvu/-no-kvu",
        help="One KV buffer shared by all sequences (-no-kvu: one stream each).",
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
ListDevicesOpt = Annotated[
    bool,
    typer.Option(
        "--list-devices",
        callback=devices.list_devices,
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
        help="Weights in memory: auto (quantized as in the file on the CPU, bf16 on CUDA), f32, f16 or bf16;"
        " every architecture's matrices, embedding and output follow it, while norms, biases and the"
        " small tensors recurrent scans read (conv, A, D, decays, lerps, RWKV's low-rank) stay f32.",
    ),
]
NoProgressOpt = Annotated[
    bool, typer.Option("--no-progress", help="No progress on stderr (it shows only on a terminal).")
]
JinjaOpt = Annotated[
    bool,
    typer.Option(
        "--jinja/--no-jinja",
        help="Render chats with the GGUF's own template (Jinja), as llama.cpp does; --no-jinja: "
        "llama.cpp's named format of its family (chatml, gemma, llama3).",
    ),
]

# the sampler's flags, with llama.cpp's meanings; a value without one is a usage error
TempOpt = Annotated[
    float,
    typer.Option(
        "--temp",
        "--temperature",
        help="Temperature (<= 0: greedy, as in llama.cpp).",
        callback=values.bounds(),
    ),
]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k (0: off).", callback=values.bounds(0))]
TopPOpt = Annotated[
    float, typer.Option("--top-p", help="Top-p (1.0: off).", callback=values.bounds(0.0, 1.0))
]
MinPOpt = Annotated[
    float, typer.Option("--min-p", help="Min-p (0.0: off).", callback=values.bounds(0.0, 1.0))
]
TypicalOpt = Annotated[
    float,
    typer.Option(
        "--typical", "--typical-p", help="Locally typical sampling (1.0: off).", callback=values.bounds()
    ),
]
PresencePenaltyOpt = Annotated[
    float, typer.Option("--presence-penalty", help="Presence penalty (0.0: off).", callback=values.bounds())
]
FrequencyPenaltyOpt = Annotated[
    float, typer.Option("--frequency-penalty", help="Frequency penalty (0.0: off).", callback=values.bounds())
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
SeedOpt = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1: random).")]
SamplersOpt = Annotated[
    str | None,
    typer.Option(
        "--samplers",
        help="The sampler chain's stages in order, separated by ';' (default: "
        "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature; "
        "dry, top_n_sigma and xtc do nothing at llama.cpp's defaults and are not implemented).",
    ),
]

DefragTholOpt = Annotated[
    float | None,
    typer.Option(
        "--defrag-thold",
        "-dt",
        help="Compact a KV stream when its holes exceed this part of its used span (<= 0: never).",
        callback=values.bounds(hi=1.0, hi_open=True),
    ),
]
DefragOpt = Annotated[
    str | None,
    typer.Option("--defrag", help="KV compaction: none, or on-fail (compact when a batch finds no room)."),
]
ContBatchingOpt = Annotated[
    bool,
    typer.Option(
        "--cont-batching/--no-cont-batching",
        "-cb/-nocb",
        help="New requests join the running batch (-nocb: they wait until every sequence is done).",
    ),
]
RsSeqOpt = Annotated[
    int,
    typer.Option(
        "--rs-seq",
        help="Recurrent models: states kept per sequence, so a reply can be taken back this many tokens.",
        callback=values.bounds(0),
    ),
]

CtxCheckpointsOpt = Annotated[
    int,
    typer.Option(
        "-ctxcp",
        "--ctx-checkpoints",
        "--swa-checkpoints",
        help="Checkpoints a sliding-window or recurrent memory keeps per sequence (0: none).",
        callback=values.bounds(0),
    ),
]


class FlagGroup:
    """A dataclass of typer options that `@flags` spreads into a verb's command line."""

    def changed(self, skip: tuple[str, ...] = ()) -> list[str]:
        """The flags (their first name, e.g. `-c`) given a value other than the default, for a
        verb to refuse flags that do nothing in one of its modes."""
        hints = get_type_hints(type(self), include_extras=True)
        names = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # every FlagGroup is a dataclass
            if f.name not in skip and getattr(self, f.name) != f.default:
                opt = hints[f.name].__metadata__[0]
                # in Annotated, typer keeps an option's first name in `default`
                decls = [
                    d for d in (opt.default, *opt.param_decls) if isinstance(d, str) and d.startswith("-")
                ]
                names.append(decls[0].split("/")[0])
        return names


@dataclasses.dataclass(frozen=True)
class LoadFlags(FlagGroup):
    """-m, the device flags, --weights, -t and -tb: what loads a model."""

    model: ModelOpt = registry.DEFAULT_MODEL
    device: DeviceOpt = None
    list_devices: ListDevicesOpt = False
    n_gpu_layers: NglOpt = None
    weights: WeightsOpt = "auto"
    threads: ThreadsOpt = None
    threads_batch: ThreadsBatchOpt = None

    def device_name(self) -> str:
        """cpu, cuda or cuda:N, from --device and -ngl."""
        return devices.device_setting(self.device, self.n_gpu_layers)


@dataclasses.dataclass(frozen=True)
class ContextFlags(FlagGroup):
    """-c, -b, -ub, -kvu, --swa-full, -ctk, -ctv, -fa: the context's geometry, KV types and
    attention."""

    ctx_size: CtxOpt = 4096
    batch_size: BatchOpt = 2048
    ubatch_size: UBatchOpt = 512
    kv_unified: KvUnifiedOpt = False
    swa_full: SwaFullOpt = False
    type_k: TypeKOpt = "f16"
    type_v: TypeVOpt = "f16"
    flash_attn: FlashAttnOpt = "auto"

    def params(self, n_seq_max: int, defrag: str = "none", n_rs_seq: int = 0) -> kvtool.ContextParams:
        """The context these flags ask for; `n_seq_max` is the verb's (-np conversations, clients
        plus the system prompt, the largest B...), `defrag` a `DefragFlags.setting()`."""
        check_flash_attn(self.flash_attn)
        return kvtool.ContextParams(
            n_ctx=self.ctx_size,
            n_batch=self.batch_size,
            n_ubatch=self.ubatch_size,
            n_seq_max=n_seq_max,
            kv_unified=self.kv_unified,
            swa_full=self.swa_full,
            type_k=self.type_k,
            type_v=self.type_v,
            defrag=defrag,
            n_rs_seq=n_rs_seq,
        )


@dataclasses.dataclass(frozen=True)
class DefragFlags(FlagGroup):
    """--defrag-thold (llama.cpp's) and --defrag: the KV compaction policy."""

    defrag_thold: DefragTholOpt = None
    defrag: DefragOpt = None

    def setting(self) -> str:
        """ContextParams.defrag: none, on-fail or threshold=F."""
        if self.defrag not in (None, "none", "on-fail"):
            raise kvtool.KvtoolError(f"--defrag must be none or on-fail, got '{self.defrag}'")
        on = self.defrag_thold is not None and self.defrag_thold > 0
        if on and self.defrag == "on-fail":
            raise kvtool.KvtoolError("--defrag-thold and --defrag on-fail are two policies: give one")
        if on:
            return f"threshold={self.defrag_thold}"
        return self.defrag or "none"


@dataclasses.dataclass(frozen=True)
class SamplingFlags(FlagGroup):
    """The sampler chain's flags, with llama.cpp's defaults."""

    temp: TempOpt = 0.8
    top_k: TopKOpt = 40
    top_p: TopPOpt = 0.95
    min_p: MinPOpt = 0.05
    typical: TypicalOpt = 1.0
    repeat_penalty: RepeatPenaltyOpt = 1.0
    repeat_last_n: RepeatLastNOpt = 64
    presence_penalty: PresencePenaltyOpt = 0.0
    frequency_penalty: FrequencyPenaltyOpt = 0.0
    seed: SeedOpt = -1
    samplers: SamplersOpt = None

    def params(self) -> kvtool.SamplerParams:
        """The sampler these flags ask for (--samplers' names are checked when a Sampler is made)."""
        p = kvtool.SamplerParams(
            seed=self.seed,
            temp=self.temp,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            typical_p=self.typical,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        if self.samplers is not None:
            p.samplers = tuple(self.samplers.split(";"))
        return p


def check_flash_attn(value: str) -> None:
    """-fa as llama.cpp spells it (on, off, auto; llama-bench's 1 and 0): kvtool's attention is
    always fused (flash attention on the GPU, SDPA and a fused decode kernel on the CPU), so on
    and auto are what it does, and off, which it cannot do, is refused."""
    v = value.strip().lower()
    if v in ("off", "0", "false", "disabled"):
        raise kvtool.KvtoolError(
            "-fa off: kvtool's attention is always fused (flash attention); leave -fa out or give on/auto"
        )
    if v not in ("on", "auto", "1", "true", "enabled"):
        raise kvtool.KvtoolError(f"-fa must be on, off or auto, got '{value}'")


F = TypeVar("F", bound=Callable[..., Any])


def flags(fn: F) -> F:
    """Spreads each parameter of `fn` annotated with a FlagGroup into the group's options (their
    defaults from the parameter's default instance), and hands `fn` the group built from them.
    A parameter `fn` declares itself under a field's name replaces that field's declaration
    (its own help or default) and reaches both `fn` and the group."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    own = {n for n in sig.parameters if not _is_group(hints.get(n))}
    spread: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for name, p in sig.parameters.items():
        ann = hints.get(name, p.annotation)
        if not _is_group(ann):
            spread.append(p.replace(annotation=ann, kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        default = ann() if p.default is inspect.Parameter.empty else p.default
        field_hints = typing.get_type_hints(ann, include_extras=True)
        names = [f.name for f in dataclasses.fields(ann)]
        groups[name] = (ann, names)
        spread += [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=getattr(default, n), annotation=field_hints[n]
            )
            for n in names
            if n not in own
        ]
    clash = [p.name for p in spread]
    if len(set(clash)) != len(clash):
        raise TypeError(f"{fn.__name__}: two flag groups declare the same field")

    @functools.wraps(fn)
    def verb(**kwargs: Any) -> Any:
        for name, (cls, names) in groups.items():
            kwargs[name] = cls(**{n: kwargs[n] if n in own else kwargs.pop(n) for n in names})
        return fn(**kwargs)

    verb.__signature__ = sig.replace(parameters=spread)  # type: ignore[attr-defined]
    verb.__annotations__ = {p.name: p.annotation for p in spread}
    del verb.__wrapped__  # type: ignore[attr-defined]  # typer reads the spread signature
    return typing.cast(F, verb)


def _is_group(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, FlagGroup)
