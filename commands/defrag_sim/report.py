"""The comparison table: one row per policy, as markdown, CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.commands.defrag_sim.simulator import SimResult


def measure_copy_bw(n_bytes: int = 64 << 20, repeat: int = 3) -> float:
    """Bytes per second of a large numpy memcpy on this machine (the best of `repeat`)."""
    a = np.ones(n_bytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


@dataclass(frozen=True)
class Cost:
    """What a moved cell costs: its K/V bytes over all layers, and the copy bandwidth."""

    cell_bytes: int
    copy_bw: float  # bytes per second
    model: str
    bw_source: str  # "measured" | "given"


def rows(results: list[SimResult], cost: Cost | None) -> list[dict[str, Any]]:
    out = []
    for r in results:
        st = r.stats
        row: dict[str, Any] = {
            "policy": r.policy.name,
            "failed_allocs": st.failed_allocs,
            "dropped_requests": st.dropped,
            "peak_used": int(r.used.max()) if len(r.used) else 0,
            "mean_used": round(float(r.used.mean()), 1) if len(r.used) else 0.0,
            "peak_n_kv": int(r.nkv.max()) if len(r.nkv) else 0,
            "mean_n_kv": round(float(r.nkv.mean()), 1) if len(r.nkv) else 0.0,
            "holes_pct": round(r.holes_pct, 2),
            "compactions": st.compactions,
            "passes": st.passes,
            "moves": st.moves,
            "cells_moved": st.cells_moved,
        }
        if cost is not None:
            moved = st.cells_moved * cost.cell_bytes
            row["mib_moved"] = round(moved / 2**20, 1)
            row["move_ms"] = round(1e3 * moved / cost.copy_bw, 1)
        out.append(row)
    return out


_HEADS = {
    "policy": "policy",
    "failed_allocs": "failed allocs",
    "dropped_requests": "dropped reqs",
    "peak_used": "peak used",
    "mean_used": "mean used",
    "peak_n_kv": "peak n_kv",
    "mean_n_kv": "mean n_kv",
    "holes_pct": "holes %",
    "compactions": "compactions",
    "passes": "passes",
    "moves": "moves",
    "cells_moved": "cells moved",
    "mib_moved": "MiB moved",
    "move_ms": "move ms",
}


def render(fmt: str, table: list[dict[str, Any]], info: dict[str, Any]) -> str:
    """`md`: the settings as a few lines, then the table; `csv`: the table; `json`: both."""
    if fmt == "json":
        return json.dumps({**info, "policies": table}, indent=2) + "\n"
    keys = list(table[0]) if table else []
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        w.writeheader()
        w.writerows(table)
        return buf.getvalue()
    lines = [f"{k}: {v}" for k, v in info.items()] + [""]
    lines.append("| " + " | ".join(_HEADS[k] for k in keys) + " |")
    lines.append("|" + "|".join("---" if k == "policy" else "---:" for k in keys) + "|")
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in table]
    return "\n".join(lines) + "\n"
