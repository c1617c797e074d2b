"""llama-bench's reports: its fields, typed, and its md, csv, json and jsonl formats."""

from __future__ import annotations

import json
import time
from typing import TextIO

import kvtool
from kvtool.commands.bench.logic import BenchResult, Instance, cpu_info
from kvtool.common.model_desc import model_desc

FIELDS = (
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "type_k",
    "type_v",
    "kv_unified",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
)
_INT = {"build_number", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "n_prompt"}
_INT |= {"n_gen", "n_depth", "avg_ns", "stddev_ns"}
_FLOAT = {"avg_ts", "stddev_ts"}
_BOOL = {"kv_unified"}
# Markdown column widths (negative: left-aligned) and names, as llama-bench prints them.
_WIDTH = {"model": -30, "size": 10, "params": 10, "backend": -18, "n_threads": 7, "n_batch": 7}
_WIDTH |= {"n_ubatch": 8, "type_k": 6, "type_v": 6, "kv_unified": 10, "test": 15, "t/s": 20}
_SHOWN = {"n_threads": "threads", "kv_unified": "kvu"}


def _version() -> str:
    from importlib import metadata  # here: it takes tens of ms to import, and --help needs none

    try:
        return f"kvtool-{metadata.version('kvtool')}"
    except metadata.PackageNotFoundError:
        return "kvtool-dev"


def record(r: BenchResult, inst: Instance, m: kvtool.Model, kv_unified: bool) -> dict[str, object]:
    """The llama-bench fields kvtool has, typed (ints, bools, floats rounded as llama-bench's %f)."""
    return {
        "build_commit": _version(),
        "build_number": 0,
        "cpu_info": cpu_info(),
        "gpu_info": "",
        "backends": m.backend.name,  # llama-bench's backend, with the CPU kernels' path: "CPU (AVX2)"
        "model_filename": str(m.path),
        "model_type": model_desc(m),
        "model_size": m.size_bytes(),
        "model_n_params": m.n_params(),
        "n_batch": inst.n_batch,
        "n_ubatch": inst.n_ubatch,
        "n_threads": inst.n_threads,
        "type_k": inst.type_k,
        "type_v": inst.type_v,
        "kv_unified": kv_unified,
        "n_prompt": r.test.n_prompt,
        "n_gen": r.test.n_gen,
        "n_depth": r.test.n_depth,
        "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "avg_ns": r.avg_ns,
        "stddev_ns": r.stddev_ns,
        "avg_ts": round(r.avg_ts, 6),
        "stddev_ts": round(r.stddev_ts, 6),
    }


def _csv_value(field: str, v: object) -> str:
    if field in _BOOL:
        s = str(int(bool(v)))
    elif field in _FLOAT:
        s = f"{v:.6f}"
    else:
        s = str(v)
    return '"' + s.replace('"', '""') + '"'


class Printer:
    """Writes tests as they finish, in one of llama-bench's formats."""

    def __init__(self, fmt: str, md_fields: list[str], file: TextIO) -> None:
        self.fmt = fmt
        self.file = file
        self.md_fields = md_fields
        self.first = True

    def _print(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.file, flush=True)

    def header(self) -> None:
        if self.fmt == "csv":
            self._print(",".join(FIELDS))
        elif self.fmt == "json":
            self._print("[")
        elif self.fmt == "md":
            self._print("|" + "".join(f" {_SHOWN.get(f, f):{_align(f)}} |" for f in self.md_fields))
            self._print(
                "|"
                + "".join(f" {'-' * (abs(_w(f)) - 1)}{':' if _w(f) > 0 else '-'} |" for f in self.md_fields)
            )

    def test(self, rec: dict[str, object], name: str, samples_ns: list[int], samples_ts: list[float]) -> None:
        if self.fmt == "csv":
            self._print(",".join(_csv_value(f, rec[f]) for f in FIELDS))
        elif self.fmt in ("json", "jsonl"):
            obj = {**rec, "samples_ns": samples_ns, "samples_ts": samples_ts}
            if self.fmt == "jsonl":
                self._print(json.dumps(obj, ensure_ascii=False))
            else:
                text = json.dumps(obj, indent=2, ensure_ascii=False).replace("\n", "\n  ")
                self._print(("" if self.first else ",\n") + "  " + text, end="")
        else:
            self._print(
                "|" + "".join(f" {_md_value(f, {**rec, 'test': name}):{_align(f)}} |" for f in self.md_fields)
            )
        self.first = False

    def footer(self) -> None:
        if self.fmt == "json":
            self._print("\n]")
        elif self.fmt == "md":
            self._print(f"\nbuild: {_version()}")


def _w(field: str) -> int:
    return _WIDTH.get(field, max(len(field), 10))


def _align(field: str) -> str:
    w = _w(field)
    return f"<{-w}" if w < 0 else f">{w}"


def _md_value(field: str, rec: dict[str, object]) -> str:
    size, n_params = int(rec["model_size"]), int(rec["model_n_params"])  # type: ignore[call-overload]
    if field == "model":
        return str(rec["model_type"])
    if field == "size":
        return f"{size / 2**20:.2f} MiB" if size < 2**30 else f"{size / 2**30:.2f} GiB"
    if field == "params":
        return f"{n_params / 1e6:.2f} M" if n_params < 1e9 else f"{n_params / 1e9:.2f} B"
    if field == "backend":
        return str(rec["backends"])
    if field == "test":
        return str(rec["test"])
    if field == "t/s":
        return f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f}"
    return str(int(rec[field])) if field in _BOOL else str(rec[field])  # type: ignore[call-overload]
