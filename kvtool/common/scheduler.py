"""Continuous batching over slots on one context: the loop llama-server and llama-parallel share,
and so do `kvtool serve` and `kvtool parallel`.

Each slot is one sequence of the context. A request waits in a queue until a slot takes it (the
one it names, the idle slot whose held tokens share the largest part of its prompt above
`slot_prompt_similarity`, else the least recently used one); the slot keeps the longest common
prefix of what it holds (when the memory can be cut back there), else its nearest checkpoint
(sliding-window and recurrent memories: kvtool.common.checkpoints), or takes one from a
`PrefixSource`, and decodes the rest. Every `step` builds one batch: each generating slot's
last token, then prompt tokens (all of them, or up to `n_step_tokens`), and decodes it in views
of n_batch tokens; a view with no room is retried at half the size (a cache miss), after idle
slots that keep a cached prompt give their cells back in a unified cache. A slot samples as
soon as the view holding its output is done, so a finished answer frees its cells before the
next view. Nothing here blocks: `step` returns whether there was work, the caller waits."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import kvtool
from kvtool.common.checkpoints import CheckpointParams, SlotCheckpoints, needs_checkpoints
from kvtool.common.prefix import PrefixSource, common_prefix
from kvtool.common.slots import Slot, choose_slot, reprocess_reason
from kvtool.common.stats import SchedulerStats
from kvtool.common.task import Request, Task, TaskEvents


@dataclass
class SchedulerParams:
    """The slots and the batching policy (llama-server's -np, -sps, -cb)."""

    n_slots: int
    seqs: Sequence[int] = ()  # the sequence of each slot (default 0..n_slots-1)
    slot_prompt_similarity: float = 0.1
    cont_batching: bool = True  # else a new request starts only when every slot is idle
    n_step_tokens: int = 0  # the most tokens one step decodes (0: everything pending)
    sources: Sequence[PrefixSource] = field(default_factory=tuple)
    # context checkpoints of memories that cannot be cut back (none by default: llama-parallel's)
    checkpoints: CheckpointParams = field(default_factory=lambda: CheckpointParams(n_max=0))


# one token of a step: (token, position, slot index, wants logits)
_Entry = tuple[int, int, int, bool]


class Scheduler:
    """Serves requests on `ctx`. `submit` and `Task.cancel` may be called from any thread;
    `step` from one thread only (the one that owns the context)."""

    def __init__(
        self, ctx: kvtool.Context, params: SchedulerParams, on_miss: Callable[[int], None] | None = None
    ) -> None:
        seqs = list(params.seqs) or list(range(params.n_slots))
        if len(seqs) != params.n_slots or max(seqs) >= ctx.params.n_seq_max:
            raise ValueError(f"{params.n_slots} slots need as many sequences below n_seq_max")
        self.ctx = ctx
        self.p = params
        cps = params.checkpoints if needs_checkpoints(ctx) else CheckpointParams(n_max=0)
        self.slots = [Slot(i, s, checkpoints=SlotCheckpoints(cps)) for i, s in enumerate(seqs)]
        self.stats = SchedulerStats()
        self.on_miss = on_miss
        self.waiting: deque[Task] = deque()
        self._inbox: deque[Task] = deque()
        self._lock = threading.Lock()
        self.wake = threading.Event()  # set when a task arrives or is cancelled

    # -- any thread ----------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raises kvtool.ContextFullError (or ValueError) for a request no slot can serve."""
        if not req.tokens:
            raise ValueError("the prompt is empty")
        if len(req.tokens) >= self.ctx.n_ctx_seq:
            raise kvtool.ContextFullError(
                f"the prompt has {len(req.tokens)} tokens; a slot holds {self.ctx.n_ctx_seq}"
            )
        if req.id_slot >= self.p.n_slots:
            raise ValueError(f"id_slot {req.id_slot} is out of range ({self.p.n_slots} slots)")

    def submit(self, req: Request, events: TaskEvents | None = None, tag: object = None) -> Task:
        self.check(req)
        task = Task(req, events, tag)
        with self._lock:
            self._inbox.append(task)
        self.wake.set()
        return task

    def n_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def n_queued(self, extra: int = 0) -> int:
        """Tasks that will wait for a slot (with `extra` more submitted): those beyond the idle slots."""
        return max(0, self.n_waiting() + extra - sum(not s.busy for s in self.slots))

    def fail_all(self, message: str, stop: str = "error") -> None:
        """Ends every task, running or waiting (the owner's thread; after a failed step, or at
        shutdown with stop "cancelled")."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        while self.waiting:
            task = self.waiting.popleft()
            task.error = message if stop == "error" else ""
            self._end(task, stop)
        for slot in self.slots:
            if slot.task is not None:
                if stop == "error":
                    self._fail(slot, message)
                else:
                    self._release(slot, stop)

    # -- the owner's thread ----------------------------------------------------------------------
    def step(self) -> bool:
        """Ends cancelled tasks, starts waiting ones, decodes one batch; False when idle."""
        self.wake.clear()
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for task in [t for t in self.waiting if t.cancelled]:
            self.waiting.remove(task)
            self._end(task, "cancelled")
        for slot in self.slots:
            if slot.task is not None and slot.task.cancelled:
                self._release(slot, "cancelled")
        self._admit()
        entries = self._build()
        if not entries:
            return False
        self.stats.n_steps += 1
        self.stats.n_busy_slots += sum(s.busy for s in self.slots)
        self._decode(entries)
        return True

    def _admit(self) -> None:
        if not self.p.cont_batching and any(s.busy for s in self.slots):
            return  # waves: the next requests start together once every slot is idle
        for task in list(self.waiting):
            slot = choose_slot(self.slots, task.req, self.p.slot_prompt_similarity)
            if slot is None:
                if task.req.id_slot < 0:
                    return  # no idle slot: later tasks would not find one either
                continue
            self.waiting.remove(task)
            self._launch(slot, task)

    def _launch(self, slot: Slot, task: Task) -> None:
        """The slot takes the task: keeps what it can of its prefix (cut back, else from its
        nearest checkpoint), or takes a longer one from a prefix source, and queues the rest."""
        ctx, req, tokens = self.ctx, task.req, task.req.tokens
        task.slot, task.t_start = slot.id, time.perf_counter()
        slot.task, slot.keeps = task, False
        n_mem = ctx.memory.seq_pos_max(slot.seq) + 1
        lcp = common_prefix(slot.held, tokens)
        # without cache_prompt only what a shared prefix source put there is reused
        keep = min(lcp if req.cache_prompt else min(lcp, slot.n_source), n_mem, len(tokens) - 1)
        truncatable = keep == 0 or ctx.can_resume(slot.seq, keep)
        if not truncatable:
            keep = 0
        tier = (
            "" if keep == 0 else "slot" if slot.source is None or keep > slot.n_source else slot.source.name
        )
        if 2 * lcp < len(slot.held):  # another conversation (not a regenerate or an edit near the end)
            for src in self.p.sources:
                src.offer(ctx, slot)
        from_cp = False
        if req.cache_prompt and (n := self._from_checkpoint(slot, tokens, len(tokens) - 1, keep)) > keep:
            keep, tier, from_cp, slot.source, slot.n_source = n, "checkpoint", True, None, 0
        # a cache's entry is an older state of some slot: one that shares no more with the
        # prompt than this slot holds would end at the same checkpoint, after a load for nothing
        n_slot = min(lcp, n_mem, len(tokens) - 1) if keep > 0 else 0
        for src in self.p.sources:
            if not (src.shared or req.cache_prompt):
                continue
            floor = keep if src.shared else max(keep, n_slot)
            n = src.restore(ctx, slot, tokens, floor)
            if n > floor:
                keep, tier = min(n, len(tokens) - 1), src.name
                slot.source, slot.n_source = (src, n) if src.shared else (None, 0)
                if not ctx.can_resume(slot.seq, keep):  # a cache's state goes on past the prompt
                    keep = self._from_checkpoint(slot, tokens, keep, 0)
                    from_cp = keep > 0
                break
        if tier in ("", "slot", "checkpoint"):
            slot.source, slot.n_source = None, 0
        slot.n_source = min(slot.n_source, keep)
        ctx.memory.seq_rm(slot.seq, keep, -1)
        slot.checkpoints.start(tokens)
        self._count_reuse(slot, task, keep, lcp, n_mem, truncatable, tier if keep else "", from_cp)
        slot.held = list(tokens[:keep])
        slot.pending = list(tokens[keep:])
        slot.n_past = keep
        for t in tokens:  # the prompt counts toward the penalties, as llama-server does it
            task.sampler.accept(t)
        if task.events is not None:
            task.events.on_start(task)

    def _from_checkpoint(self, slot: Slot, tokens: Sequence[int], n_max: int, n_min: int) -> int:
        return slot.checkpoints.load(self.ctx, slot.seq, tokens, n_max, n_min)

    def _count_reuse(
        self,
        slot: Slot,
        task: Task,
        keep: int,
        lcp: int,
        n_mem: int,
        truncatable: bool,
        tier: str,
        from_cp: bool,
    ) -> None:
        """Timings and the ledger: what was reused and from where and, when some slot held
        more, why not."""
        req, st, t = task.req, self.stats, task.timings
        t.cache_n, t.cache_source = keep, tier
        if keep:
            st.reused[t.cache_source] += keep
        missed = reprocess_reason(self.slots, slot, req, keep, lcp, n_mem, truncatable, from_cp)
        slot.lost = []
        if missed is not None:
            reason, n = missed
            t.cache_reprocessed = reason
            st.reprocessed[reason] += 1
            st.reprocessed_tokens[reason] += n

    def _build(self) -> list[_Entry]:
        entries: list[_Entry] = []
        for slot in self.slots:
            if slot.busy and not slot.pending:
                entries.append((slot.sampled, slot.n_past, slot.id, True))
                slot.held.append(slot.sampled)
                slot.n_past += 1
        budget = self.p.n_step_tokens - len(entries) if self.p.n_step_tokens > 0 else -1
        for slot in self.slots:
            if not slot.pending or budget == 0:
                continue
            take = slot.pending if budget < 0 else slot.pending[:budget]
            if slot.task is not None and slot.task.req.cache_prompt:
                take = self._checkpoint(slot, take)
            last = len(take) == len(slot.pending)
            for i, t in enumerate(take):
                entries.append((t, slot.n_past + i, slot.id, last and i == len(take) - 1))
            slot.held += take
            slot.n_past += len(take)
            slot.pending = slot.pending[len(take) :]
            budget = budget - len(take) if budget > 0 else budget
        return entries

    def _checkpoint(self, slot: Slot, take: list[int]) -> list[int]:
        """Keeps a checkpoint when one is due where the slot stands (its sequence holds just
        its decoded prompt tokens), and ends the step's share at the next one due."""
        cps = slot.checkpoints
        if cps.due(slot.n_past):
            cps.add(self.ctx, slot.seq, slot.n_past)
        stop = cps.next_stop(slot.n_past)
        return take[: stop - slot.n_past] if stop > 0 else take

    def _decode(self, entries: list[_Entry]) -> None:
        """Decodes the step in views of n_batch tokens, halving on no room (a cache miss)."""
        ctx, n_batch, i = self.ctx, self.ctx.n_batch, 0
        while i < len(entries):
            view = [e for e in entries[i : i + n_batch] if self.slots[e[2]].busy]
            if not view:
                i += n_batch
                continue
            batch = kvtool.Batch()
            for tok, pos, sid, out in view:
                batch.add(tok, pos, (self.slots[sid].seq,), out)
            try:
                ctx.decode(batch)
            except kvtool.DecodeError as e:
                if e.status == 1 and self._evict_idle():
                    continue
                if e.status == 1 and n_batch > 1:
                    self.stats.n_cache_miss += 1
                    n_batch //= 2
                    if self.on_miss is not None:
                        self.on_miss(n_batch)
                    continue
                for sid in {e[2] for e in view}:
                    self._fail(self.slots[sid], f"{e} (n_batch = {n_batch}; raise -c/--ctx-size)")
                i += n_batch
                continue
            self.stats.n_decode += 1
            self.stats.n_tokens_decoded += len(view)
            for row, (_, _, sid, out) in enumerate(view):
                if out and self.slots[sid].busy:
                    self._sample(self.slots[sid], ctx.logits_ith(row))
            i += n_batch
            n_batch = ctx.n_batch

    def _evict_idle(self) -> bool:
        """In a unified cache, the least recently used idle slot keeping a cached prompt gives
        its cells back (offered to the prefix sources first). False when none does."""
        if not self.ctx.params.kv_unified:
            return False
        idle = [s for s in self.slots if not s.busy and s.keeps and s.held]
        if not idle:
            return False
        slot = min(idle, key=lambda s: s.t_last_used)
        for src in self.p.sources:
            src.offer(self.ctx, slot)
        self.ctx.memory.seq_rm(slot.seq, -1, -1)
        slot.held, slot.lost, slot.keeps = [], slot.held, False
        self.stats.n_evicted += 1
        return True

    def _sample(self, slot: Slot, logits: object) -> None:
        import torch

        task = slot.task
        assert task is not None and isinstance(logits, torch.Tensor)
        if task.req.ignore_eos:
            eog = torch.tensor(sorted(self.ctx.model.vocab.eog_ids), dtype=torch.long)
            logits = logits.index_fill(0, eog, float("-inf"))
        tok = task.sampler.sample(logits)
        task.sampler.accept(tok)
        if task.n_decoded == 0:
            task.t_first = time.perf_counter()
        out = task.push(self.ctx.model, tok, logits, at_limit=slot.n_past >= self.ctx.n_ctx_seq)
        if task.events is not None:
            task.events.on_token(task, out)
        if task.stop:
            self._release(slot, task.stop)
        else:
            slot.sampled = tok

    def _fail(self, slot: Slot, message: str) -> None:
        assert slot.task is not None
        slot.task.error = message
        self.ctx.memory.seq_rm(slot.seq, -1, -1)  # what the failed views left is unknown
        slot.held, slot.lost = [], slot.held
        self._release(slot, "error")

    def _release(self, slot: Slot, stop: str) -> None:
        """The slot's task ends: without cache_prompt the slot goes back to its prefix source's
        prefix (or empty), else it keeps every token it decoded for the next request."""
        task = slot.task
        assert task is not None
        slot.task, slot.last, slot.pending, slot.t_last_used = None, task, [], time.perf_counter()
        self.stats.n_tokens_max = max(self.stats.n_tokens_max, slot.n_past)
        if task.req.cache_prompt:
            slot.keeps = bool(slot.held)
        else:
            self._back_to_source(slot, task.req.tokens)
        self._end(task, stop)

    def _back_to_source(self, slot: Slot, tokens: Sequence[int]) -> None:
        """Cuts the slot back to the prefix its source gave, restoring it if the memory lost it."""
        ctx, n = self.ctx, slot.n_source
        if n and ctx.memory.seq_pos_max(slot.seq) + 1 >= n and ctx.can_resume(slot.seq, n):
            ctx.memory.seq_rm(slot.seq, n, -1)
        else:
            ctx.memory.seq_rm(slot.seq, -1, -1)
            n = 0 if slot.source is None else slot.source.restore(ctx, slot, tokens, 0)
        slot.held, slot.n_source = list(slot.held[:n]) if n <= len(slot.held) else list(tokens[:n]), n

    def _end(self, task: Task, stop: str) -> None:
        task.stop = task.stop or stop
        task.t_end = time.perf_counter()
        t = task.timings
        if task.t_start:
            t.prompt_n = task.n_prompt - t.cache_n
            t.prompt_ms = 1e3 * ((task.t_first or task.t_end) - task.t_start)
            t.predicted_n = task.n_decoded
            t.predicted_ms = 1e3 * (task.t_end - task.t_first) if task.t_first else 0.0
            st = self.stats
            st.n_prompt_processed += t.prompt_n
            st.n_prompt_cached += t.cache_n
            st.t_prompt += t.prompt_ms / 1e3
            st.n_predicted += t.predicted_n
            st.t_predicted += t.predicted_ms / 1e3
        self.stats.n_requests += 1
        if task.events is not None:
            task.events.on_done(task)
        task.done.set()
