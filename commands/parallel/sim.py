"""llama-parallel's server simulation on a local Context: n clients share one batch; each
takes requests (a question after a fixed system transcript) from a common queue and gets
its answer token by token. Sequence 0 holds the system prompt, client c decodes on c + 1."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import kvtool
from kvtool.commands.parallel.prompts import QUESTIONS, SYSTEM_PROMPT, pick_requests
from kvtool.common.prefix import SharedPrefix
from kvtool.common.scheduler import Scheduler, SchedulerParams
from kvtool.common.task import Request, Task, TokenOut

REVERSE_PROMPT = "User:"
MIN_TOKENS = 3  # llama-parallel honours a stop from an answer's third token on


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


@dataclass(frozen=True)
class ClientStatus:
    """What the live view shows of one client."""

    client: int
    seq: int  # -1: idle
    phase: str  # "idle" | "prompt" | "gen"
    n_decoded: int


@dataclass
class Client:
    """A simulated client; `seq` is its current request (-1: idle). Client c runs in slot c,
    sequence c + 1 (sequence 0 holds the shared system prompt)."""

    id: int
    seed: int
    seq: int = -1
    n_prompt: int = 0
    n_junk: int = 0
    input: str = ""
    task: Task | None = None

    @property
    def kv_seq(self) -> int:
        return self.id + 1

    @property
    def n_decoded(self) -> int:
        return self.task.n_decoded if self.task is not None else 0


class ParallelSim:
    """Runs the simulation on the shared scheduler (kvtool.common.scheduler, as `kvtool serve`);
    `clients`, `n_tokens` and `n_cache_miss` can be read while it runs."""

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
        self.clients = [Client(i, s) for i, s in enumerate(seeds)]
        self.system_tokens = ctx.model.tokenize(params.system, add_special=True)
        self.records: list[RequestRecord] = []
        self.n_prompt = 0
        self.n_gen = 0
        self.next_seq = 0
        self.t0 = time.perf_counter()
        self._requests = pick_requests(params.prompts, params.n_sequences, params.n_junk, params.prompt_seed)
        self.sched: Scheduler | None = None
        self._on_start: Callable[[Client], None] | None = None
        self._on_finish: Callable[[RequestRecord], None] | None = None
        self._failed: Task | None = None

    @property
    def n_cache_miss(self) -> int:
        return self.sched.stats.n_cache_miss if self.sched is not None else 0

    @property
    def n_tokens(self) -> int:
        """Tokens decoded so far (prompts and answers), for the live speed."""
        return self.sched.stats.n_tokens_decoded if self.sched is not None else 0

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
        tokens up to its pending sampled one, so it may change the memory as long as each
        live sequence still ends just before the position that token takes, or is empty."""
        p = self.p
        self.t0 = time.perf_counter()
        self._on_start, self._on_finish = on_start, on_finish
        sources = []
        if p.shared_system and self.system_tokens:  # empty: no system text, no BOS
            sources.append(SharedPrefix(self.ctx, 0, self.system_tokens))
        sp = SchedulerParams(
            p.n_clients,
            seqs=[c.kv_seq for c in self.clients],
            slot_prompt_similarity=0.0,
            cont_batching=p.cont_batching,
            sources=sources,
        )
        self.sched = sched = Scheduler(self.ctx, sp, on_miss)
        while True:
            for c in self.clients:
                if c.seq < 0 and self.next_seq < p.n_sequences:
                    self._submit(c)
            if on_step is not None:
                on_step()
            if not sched.step():
                break
            if self._failed is not None:
                raise kvtool.DecodeError(self._failed.error, 1)
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

    def _submit(self, c: Client) -> None:
        """The client's next request: the system transcript, junk turns, its question. Without
        -pps the text is one prompt without BOS, as llama-parallel tokenizes it."""
        p = self.p
        c.seq = self.next_seq
        self.next_seq += 1
        c.input, c.n_junk, junk = self._requests[c.seq]
        text = "" if p.shared_system else p.system
        for q, a in junk:
            text += f"User:\n{q}\nAssistant:\n {a}\n"
        text += f"User:\n{c.input}\nAssistant:\n"
        tokens = self.ctx.model.tokenize(text, add_special=False)
        c.n_prompt = len(tokens)
        if p.shared_system:
            tokens = self.system_tokens + tokens
        req = Request(
            tokens,
            n_predict=p.n_predict if p.n_predict > 0 else -1,
            sampler=replace(p.sampler, seed=c.seed),
            stop=(REVERSE_PROMPT,),
            cache_prompt=False,  # llama-parallel starts every request from the system prompt
            id_slot=c.id,
            min_tokens=MIN_TOKENS,
        )
        assert self.sched is not None
        c.task = self.sched.submit(req, self, c)

    # -- TaskEvents, on the scheduler's step ---------------------------------------------------
    def on_start(self, task: Task) -> None:
        if self._on_start is not None:
            self._on_start(self.clients[task.slot])

    def on_token(self, task: Task, out: TokenOut) -> None:
        return None

    def on_done(self, task: Task) -> None:
        c = self.clients[task.slot]
        if task.stop == "error":
            self._failed = task
            return
        stop = {"eos": "eog", "word": "reverse_prompt", "limit": "length"}.get(task.stop, task.stop)
        rec = RequestRecord(
            c.id,
            c.seq,
            c.n_junk,
            c.n_prompt,
            task.n_decoded,
            task.t_start - self.t0,
            task.t_end - self.t0,
            self.n_cache_miss,
            stop,
            c.input.strip(),
            task.text.strip(),
        )
        self.records.append(rec)
        self.n_prompt += c.n_prompt
        self.n_gen += task.n_decoded
        c.seq, c.task = -1, None
        if self._on_finish is not None:
            self._on_finish(rec)
