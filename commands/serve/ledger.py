"""The KV ledger: /slots (llama-server's slot objects, plus what each slot's sequence holds) and
/metrics (llama-server's `llamacpp:` metrics, plus `kvtool:` ones for what no anchor reports:
cells used and free per stream, bytes per memory kind and of K and V in their cache types,
prompt tokens reused by where they came from, and requests that re-processed a prefix a slot
held, by reason). Snapshots are taken on
the engine's thread between two steps, so the numbers of one answer agree with each other."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtool.common.disk_cache import DiskCache
from kvtool.common.ram_cache import RamCache
from kvtool.common.scheduler import Scheduler
from kvtool.common.slots import Slot
from kvtool.common.stats import REPROCESS_REASONS, SchedulerStats
from kvtool.common.task import Task


@dataclass
class Snapshot:
    stats: SchedulerStats
    slots: list[dict[str, Any]]
    memory: list[dict[str, Any]]
    checkpoints: tuple[int, int]  # how many the slots keep, and their bytes
    tiers: list[dict[str, Any]]  # the prompt cache's tiers: entries, bytes, budget, events
    n_processing: int
    n_deferred: int


def _task_fields(task: Task, slot: Slot, model: Any) -> dict[str, Any]:
    req = task.req
    n_remain = -1 if req.n_predict < 0 else max(0, req.n_predict - task.n_decoded)
    return {
        "id_task": id(task) & 0x7FFFFFFF,
        "n_prompt_tokens": task.n_prompt,
        "n_prompt_tokens_processed": task.n_prompt - task.timings.cache_n if task.t_start else 0,
        "n_prompt_tokens_cache": task.timings.cache_n,
        "params": {
            "n_predict": req.n_predict,
            "temperature": req.sampler.temp,
            "cache_prompt": req.cache_prompt,
        },
        "next_token": [
            {
                "has_next_token": slot.task is task,
                "has_new_line": "\n" in task.text,
                "n_remain": n_remain,
                "n_decoded": task.n_decoded,
            }
        ],
        "prompt": model.detokenize(req.tokens, special=True),
        "generated": task.text,
    }


def snapshot(sched: Scheduler) -> Snapshot:
    """What the ledger reports (run it on the engine's thread)."""
    ctx = sched.ctx
    mem = ctx.memory
    parts = ctx.memory_breakdown().parts
    unified = ctx.params.kv_unified
    slots = []
    for s in sched.slots:
        cells = [
            {
                "part": b.part or mem.kind,
                "kind": b.kind,
                "used": b.used[0 if len(b.used) == 1 or unified else s.seq],
            }
            | ({"type_k": b.type_k, "type_v": b.type_v} if b.type_k else {})
            for b in parts
        ]
        d: dict[str, Any] = {
            "id": s.id,
            "n_ctx": ctx.n_ctx_seq,
            "speculative": False,
            "is_processing": s.busy,
            "kv": {
                "seq": s.seq,
                "tokens_cached": len(s.held),
                "pos_min": mem.seq_pos_min(s.seq),
                "pos_max": mem.seq_pos_max(s.seq),
                "cells": cells,
                "checkpoints": [{"n_tokens": c.n_tokens, "bytes": c.nbytes} for c in s.checkpoints.items],
            },
        }
        task = s.task or s.last
        if task is not None:
            d |= _task_fields(task, s, ctx.model)
        slots.append(d)
    memory = [
        {
            "part": b.part or mem.kind,
            "kind": b.kind,
            "bytes": b.nbytes,
            "cells": b.n_cells,
            "used": list(b.used),
        }
        | ({"type_k": b.type_k, "type_v": b.type_v, "k": b.k, "v": b.v} if b.type_k else {})
        for b in parts
    ]
    busy = sum(s.busy for s in sched.slots)
    cps = [c for s in sched.slots for c in s.checkpoints.items]
    held = (len(cps), sum(c.nbytes for c in cps))
    tiers = [
        {
            "tier": src.name,
            "entries": len(src.entries),
            "bytes": src.nbytes,
            "max_bytes": src.max_bytes,
            "stats": dataclasses.asdict(src.stats),
            "refused": dict(src.refused) if isinstance(src, DiskCache) else {},
        }
        for src in sched.p.sources
        if isinstance(src, RamCache | DiskCache)
    ]
    return Snapshot(copy.deepcopy(sched.stats), slots, memory, held, tiers, busy, sched.n_waiting())


class _Collector:
    def __init__(self, snap: Snapshot) -> None:
        self.s = snap

    def collect(self) -> Iterator[Metric]:
        st = self.s.stats
        for name, doc, value in (
            (
                "prompt_tokens_total",
                "Number of prompt tokens processed, excluding cached tokens",
                st.n_prompt_processed,
            ),
            (
                "prompt_tokens_cached_total",
                "Number of prompt tokens reused from the cache",
                st.n_prompt_cached,
            ),
            ("prompt_seconds_total", "Total time spent processing prompts", st.t_prompt),
            ("tokens_predicted_total", "Number of generation tokens processed", st.n_predicted),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", st.t_predicted),
            ("n_decode_total", "Total number of llama_decode() calls", st.n_decode),
        ):
            yield CounterMetricFamily(f"llamacpp:{name}", doc, value=value)
        for name, doc, value in (
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", st.n_tokens_max),
            (
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s",
                _rate(st.n_prompt_processed, st.t_prompt),
            ),
            (
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s",
                _rate(st.n_predicted, st.t_predicted),
            ),
            ("requests_processing", "Number of requests processing", self.s.n_processing),
            ("requests_deferred", "Number of requests deferred", self.s.n_deferred),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                st.n_busy_slots / max(st.n_steps, 1),
            ),
        ):
            yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)
        yield from self._ledger()

    def _ledger(self) -> Iterator[Metric]:
        st = self.s.stats
        cells = GaugeMetricFamily(
            "kvtool:kv_cells", "KV cells (state slots) per stream", labels=["part", "kind", "stream", "state"]
        )
        nbytes = GaugeMetricFamily(
            "kvtool:kv_bytes", "Bytes the memory holds, per part", labels=["part", "kind"]
        )
        kv = GaugeMetricFamily(
            "kvtool:kv_tensor_bytes",
            "Bytes of a KV cache's K or V tensors in their type (-ctk/-ctv)",
            labels=["part", "kind", "tensor", "type"],
        )
        for m in self.s.memory:
            nbytes.add_metric([m["part"], m["kind"]], m["bytes"])
            if "type_k" in m:
                kv.add_metric([m["part"], m["kind"], "k", m["type_k"]], m["k"])
                kv.add_metric([m["part"], m["kind"], "v", m["type_v"]], m["v"])
            for i, used in enumerate(m["used"]):
                cells.add_metric([m["part"], m["kind"], str(i), "used"], used)
                cells.add_metric([m["part"], m["kind"], str(i), "free"], m["cells"] - used)
        yield cells
        yield nbytes
        yield kv
        entries = GaugeMetricFamily("kvtool:cache_entries", "Prompts a cache tier keeps", labels=["tier"])
        tier_bytes = GaugeMetricFamily("kvtool:cache_bytes", "Bytes a cache tier keeps", labels=["tier"])
        events = CounterMetricFamily(
            "kvtool:cache_events",
            "What a cache tier did: saved, hits, evicted, refused (over budget), failed (not loadable)",
            labels=["tier", "event"],
        )
        for t in self.s.tiers:
            entries.add_metric([t["tier"]], t["entries"])
            tier_bytes.add_metric([t["tier"]], t["bytes"])
            for name, n in t["stats"].items():
                events.add_metric([t["tier"], name.removeprefix("n_")], n)
        refused = CounterMetricFamily(
            "kvtool:cache_refused",
            "Cache files refused: truncated, corrupt, foreign, missing",
            labels=["tier", "reason"],
        )
        for t in self.s.tiers:
            for reason, n in t["refused"].items():
                refused.add_metric([t["tier"], reason], n)
        yield entries
        yield tier_bytes
        yield events
        yield refused
        yield GaugeMetricFamily(
            "kvtool:checkpoints", "Context checkpoints the slots keep", value=self.s.checkpoints[0]
        )
        yield GaugeMetricFamily(
            "kvtool:checkpoint_bytes", "Bytes of the slots' context checkpoints", value=self.s.checkpoints[1]
        )
        reused = CounterMetricFamily(
            "kvtool:prompt_tokens_reused", "Prompt tokens reused, by where they came from", labels=["source"]
        )
        for src, n in sorted(st.reused.items()):
            reused.add_metric([src], n)
        yield reused
        requests = CounterMetricFamily(
            "kvtool:requests_reprocessed",
            "Requests that re-processed a prefix a slot held, by reason",
            labels=["reason"],
        )
        tokens = CounterMetricFamily(
            "kvtool:prompt_tokens_reprocessed",
            "Prompt tokens those requests could have reused",
            labels=["reason"],
        )
        for reason in REPROCESS_REASONS:
            requests.add_metric([reason], st.reprocessed[reason])
            tokens.add_metric([reason], st.reprocessed_tokens[reason])
        yield requests
        yield tokens
        for name, doc, value in (
            ("requests", "Requests finished", st.n_requests),
            ("cache_misses", "Batches that found no room and were retried at half the size", st.n_cache_miss),
            ("slots_evicted", "Idle slots whose cached prompt gave its cells back to a batch", st.n_evicted),
        ):
            yield CounterMetricFamily(f"kvtool:{name}", doc, value=value)


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def metrics_text(snap: Snapshot) -> bytes:
    """Prometheus' text format of a snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snap))  # type: ignore[arg-type]
    return generate_latest(registry)
