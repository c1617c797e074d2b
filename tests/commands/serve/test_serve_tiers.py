"""`kvtool serve`'s prompt cache tiers through HTTP: a conversation a slot dropped for another
comes back from host RAM (--cache-ram), timings and /metrics say so; --cache-ram 0 keeps none."""

from __future__ import annotations

from tests.commands.serve.conftest import MODEL, serving
from tests.commands.serve.test_serve_checkpoints import complete, read_metrics

MODELS = MODEL.parent
A = [1, *[(i * 7) % 200 + 3 for i in range(300)]]
B = [2, *[(i * 5) % 190 + 7 for i in range(200)]]


def test_a_dropped_prompt_comes_back_from_ram() -> None:
    with serving(
        "-np", "1", "-ub", "8", "--cache-ram", "64", "--metrics", model=MODELS / "tiny-mamba2.gguf"
    ) as s:
        first = complete(s.url, A)
        complete(s.url, B)  # takes the only slot: A goes to RAM
        again = complete(s.url, A)
        t = again["timings"]
        assert (t["cache_n"], t["cache_source"]) == (len(A) - 4, "ram")  # its end-of-prompt checkpoint
        assert again["tokens"] == first["tokens"]
        m = read_metrics(s.url)
        assert m['kvtool:cache_entries{tier="ram"}'] == 2 and m['kvtool:cache_bytes{tier="ram"}'] > 0
        assert m['kvtool:cache_events_total{event="hits",tier="ram"}'] == 1
        assert m['kvtool:prompt_tokens_reused_total{source="ram"}'] == len(A) - 4


def test_cache_ram_0_keeps_nothing() -> None:
    with serving("-np", "1", "-ub", "8", "--cache-ram", "0", model=MODELS / "tiny-mamba2.gguf") as s:
        complete(s.url, A)
        complete(s.url, B)
        assert complete(s.url, A)["timings"]["cache_n"] == 0
