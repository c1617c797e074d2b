"""llama-parallel's server simulation on a local Context: n clients share one batch; each
takes requests (a question after a fixed system transcript) from a common queue and gets
its answer token by token. Sequence 0 holds the system prompt, client c decodes on c + 1."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import kvtool
from kvtool.commands.common.generate import TextStream
from kvtool.commands.parallel.prompts import QUESTIONS, SYSTEM_PROMPT, pick_requests

REVERSE_PROMPT = "User:"


@dataclass
class ParallelParams:
    """The simulation's knobs, named after llama-parallel's flags (-np, -ns, -n, -pps, -j)."""

    n_clients: int = 1
    n_sequences: int = 1
    n_predict: int = 128
    cont_batching: bool = True
    shared_system: bool = False
    n_junk: int = 1
    system: str = SYSTEM_PROMPT
    prompts: Sequence[str] = QUESTIONS
    sampler: kvtool.SamplerParams = field(default_factory=lambda: kvtool.SamplerParams())
    prompt_seed: int = 1234  # request order and junk, fixed like llama-parallel's srand(1234)


@dataclass
class RequestRecord:
    """One answered request; times are seconds since the simulation started."""

    client: int
    seq: int
    n_junk: int
    n_prompt: int
    n_decoded: int
    t_start: float
    t_end: float
    cache_miss: int  # the run's miss count when the request finished, as llama-parallel prints
    stop: str  # "eog" | "length" | "reverse_prompt"
    input: str
    response: str
    ttft: float | None = None  # seconds to the first answer token (server runs)

    @property
    def time(self) -> float:
        return self.t_end - self.t_start

    @property
    def speed(self) -> float:
        return (max(self.n_prompt, 0) + self.n_decoded) / self.time if self.time > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "time": self.time, "speed": self.speed}


@dataclass
class ParallelSummary:
    """Totals over every answered request (llama-parallel's closing block)."""

    n_clients: int
    n_sequences: int
    cont_batching: bool
    n_system_tokens: int
    n_prompt: int
    n_gen: int
    t_total: float
    n_cache_miss: int
    records: list[RequestRecord]

    def speed(self, n: int) -> float:
        return n / self.t_total if self.t_total > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["records"] = [r.to_dict() for r in self.records]
        d["speed_prompt"] = self.speed(self.n_prompt)
        d["speed_gen"] = self.speed(self.n_gen)
        d["speed_total"] = self.speed(self.n_prompt + self.n_gen)
        return d


def _view(batch: kvtool.Batch, i: int, j: int) -> kvtool.Batch:
    """Tokens i..j of a batch (llama.cpp's batch views)."""
    return kvtool.Batch(batch.tokens[i:j], batch.pos[i:j], batch.seq_ids[i:j], batch.logits[i:j])


@dataclass(frozen=True)
class ClientStatus:
    """What the live view shows of one client."""

    client: int
    seq: int  # -1: idle
    phase: str  # "idle" | "prompt" | "gen"
    n_decoded: int


@dataclass
class Client:
    """A simulated client; `seq` is its current request (-1: idle)."""

    id: int
    sampler: kvtool.Sampler
    stream: TextStream
    seq: int = -1
    sampled: int = 0
    n_past: int = 0
    n_prompt: int = 0
    n_junk: int = 0
    n_decoded: int = 0
    i_batch: int = -1
    t_start: float = 0.0
    input: str = ""
    response: str = ""

    @property
    def kv_seq(self) -> int:
        return self.id + 1


class ParallelSim:
    """Runs the simulation; `clients`, `n_gen` and `n_cache_miss` can be read while it runs."""

    def __init__(self, ctx: kvtool.Context, params: ParallelParams) -> None:
        if ctx.params.n_seq_max < params.n_clients + 1:
            raise ValueError(f"the context needs n_seq_max >= {params.n_clients + 1} (clients + system)")
        if not params.prompts:
            raise ValueError("no prompts")
        self.ctx = ctx
        self.p = params
        seeds = [params.sampler.seed] * params.n_clients
        if params.sampler.seed < 0:  # different random seeds per client, as llama-parallel
            seeds = [random.getrandbits(31) for _ in range(params.n_clients)]
        self.clients = [
            Client(i, kvtool.Sampler(replace(params.sampler, seed=s)), TextStream(ctx.model))
            for i, s in enumerate(seeds)
        ]
        self.system_tokens = ctx.model.tokenize(params.system, add_special=True)
        self.records: list[RequestRecord] = []
        self.n_cache_miss = 0
        self.n_prompt = 0
        self.n_gen = 0
        self.n_tokens = 0  # tokens decoded so far (prompts and answers), for live speed
        self.next_seq = 0
        self.t0 = time.perf_counter()
        self._requests = pick_requests(params.prompts, params.n_sequences, params.n_junk, params.prompt_seed)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def status(self) -> list[ClientStatus]:
        return [
            ClientStatus(
                c.id, c.seq, "idle" if c.seq < 0 else "gen" if c.n_decoded else "prompt", c.n_decoded
            )
            for c in self.clients
        ]

    def run(
        self,
        on_start: Callable[[Client], None] | None = None,
        on_finish: Callable[[RequestRecord], None] | None = None,
        on_miss: Callable[[int], None] | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> ParallelSummary:
        """Serves n_sequences requests; raises kvtool.DecodeError if a batch of one token fails.
        `on_step` runs before each step is built: the memory then holds every live client's
        tokens up to its pending sampled one (position `n_past`), so it may change the memory
        as long as each live sequence still ends just before its client's `n_past`, or is empty."""
        ctx, p = self.ctx, self.p
        self.t0 = time.perf_counter()
        if p.shared_system and self.system_tokens:  # empty: no system text, no BOS
            kvtool.decode_tokens(ctx, self.system_tokens, 0, 0)
            for c in self.clients:
                ctx.memory.seq_cp(0, c.kv_seq, -1, -1)
        while True:
            if on_step is not None:
                on_step()
            batch = kvtool.Batch()
            for c in self.clients:
                if c.seq >= 0:
                    c.i_batch = len(batch)
                    batch.add(c.sampled, c.n_past, (c.kv_seq,), True)
                    c.n_past += 1
                    c.n_decoded += 1
            if len(batch) == 0:  # a wave ended: every client starts again from the system prompt
                for c in self.clients:
                    ctx.memory.seq_rm(c.kv_seq, -1, -1)
                    ctx.memory.seq_cp(0, c.kv_seq, -1, -1)
            if p.cont_batching or len(batch) == 0:
                for c in self.clients:
                    if c.seq < 0 and self.next_seq < p.n_sequences:
                        self._start(c, batch)
                        if on_start is not None:
                            on_start(c)
            if len(batch) == 0:
                break
            self._decode_step(batch, on_finish, on_miss)
        return ParallelSummary(
            p.n_clients,
            p.n_sequences,
            p.cont_batching,
            len(self.system_tokens),
            self.n_prompt,
            self.n_gen,
            self.now(),
            self.n_cache_miss,
            self.records,
        )

    def _start(self, c: Client, batch: kvtool.Batch) -> None:
        p = self.p
        c.seq = self.next_seq
        self.next_seq += 1
        c.t_start = self.now()
        c.input, c.n_junk, junk = self._requests[c.seq]
        c.response = ""
        c.stream = TextStream(self.ctx.model)
        c.n_past = len(self.system_tokens) if p.shared_system else 0
        text = "" if p.shared_system else p.system
        for q, a in junk:
            text += f"User:\n{q}\nAssistant:\n {a}\n"
        text += f"User:\n{c.input}\nAssistant:\n"
        c.sampler.reset()
        # No BOS: the text continues the system prompt (which has one).
        tokens = self.ctx.model.tokenize(text, add_special=False)
        for t in tokens:
            batch.add(t, c.n_past, (c.kv_seq,), False)
            c.n_past += 1
        batch.logits[-1] = True
        c.n_prompt = len(tokens)
        c.n_decoded = 0
        c.i_batch = len(batch) - 1

    def _decode_step(
        self,
        batch: kvtool.Batch,
        on_finish: Callable[[RequestRecord], None] | None,
        on_miss: Callable[[int], None] | None,
    ) -> None:
        """Decodes the step's batch in n_batch views; when the memory has no room for a view,
        halves n_batch and retries (a cache miss). Clients sample as soon as their token's
        view is done, so a finished client frees its cells before the next view."""
        n_batch = self.ctx.n_batch
        i = 0
        while i < len(batch):
            n = min(n_batch, len(batch) - i)
            try:
                self.ctx.decode(_view(batch, i, i + n))
            except kvtool.DecodeError as e:
                if n_batch == 1 or e.status < 0:
                    raise kvtool.DecodeError(
                        f"{e} (n_batch = {n_batch}; raise -c/--ctx-size)", e.status
                    ) from e
                self.n_cache_miss += 1
                n_batch //= 2
                if on_miss is not None:
                    on_miss(n_batch)
                continue
            self.n_tokens += n
            for c in self.clients:
                if c.seq >= 0 and i <= c.i_batch < i + n:
                    self._sample(c, c.i_batch - i, on_finish)
            i += n
            n_batch = self.ctx.n_batch

    def _sample(self, c: Client, row: int, on_finish: Callable[[RequestRecord], None] | None) -> None:
        model = self.ctx.model
        tok = c.sampler.sample(self.ctx.logits_ith(row))
        c.sampler.accept(tok)
        c.response += c.stream.push(tok)
        c.sampled = tok
        c.i_batch = -1
        eog = model.is_eog(tok)
        stop = "eog" if eog else "length" if 0 < self.p.n_predict <= c.n_decoded else ""
        if REVERSE_PROMPT in c.response:
            stop = "reverse_prompt"
        if c.n_decoded <= 2 or not stop:
            return
        c.response = c.response.split(REVERSE_PROMPT, 1)[0]
        # Forget the answer, keep the system prompt (seq 0's cells) for the client's next request.
        self.ctx.memory.seq_rm(c.kv_seq, -1, -1)
        self.ctx.memory.seq_cp(0, c.kv_seq, -1, -1)
        rec = RequestRecord(
            c.id,
            c.seq,
            c.n_junk,
            c.n_prompt,
            c.n_decoded,
            c.t_start,
            self.now(),
            self.n_cache_miss,
            stop,
            c.input.strip(),
            c.response.strip(),
        )
        self.records.append(rec)
        self.n_prompt += c.n_prompt
        self.n_gen += c.n_decoded
        c.seq = -1
        if on_finish is not None:
            on_finish(rec)
