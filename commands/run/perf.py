"""The timings `run` prints, laid out as llama.cpp's llama_perf_context_print lays them out:
load time, prompt eval and eval with ms per token and tokens per second, total; plus the time
to the first token of the last reply."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvtool.commands.common.generate import Timings


def _rate(label: str, seconds: float, n: int, unit: str) -> str:
    ms = seconds * 1e3
    per = ms / n if n else 0.0
    tps = n / seconds if seconds > 0 else 0.0
    return (
        f"{label:>16} = {ms:10.2f} ms / {n:5d} {unit:<6} "
        f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
    )


@dataclass
class Perf:
    """Wall-clock marks of a run: when it started, how long loading took, and the time from a
    turn's start to its first streamed text (time to first token)."""

    t_start: float = field(default_factory=time.perf_counter)
    t_load: float = 0.0
    t_turn: float = 0.0
    ttft: float | None = None

    def turn_started(self) -> None:
        self.t_turn, self.ttft = time.perf_counter(), None

    def text_arrived(self) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t_turn

    def lines(self, t: Timings) -> list[str]:
        """The report for the timings summed so far."""
        total = time.perf_counter() - self.t_start
        out = [
            f"{'load time':>16} = {self.t_load * 1e3:10.2f} ms",
            _rate("prompt eval time", t.t_prompt, t.n_prompt, "tokens"),
            _rate("eval time", t.t_gen, t.n_gen, "runs"),
            f"{'total time':>16} = {total * 1e3:10.2f} ms / {t.n_prompt + t.n_gen:5d} tokens",
        ]
        if self.ttft is not None:
            out.append(f"{'first token':>16} = {self.ttft * 1e3:10.2f} ms after the turn began")
        return out
