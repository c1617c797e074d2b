"""`kvtool serve` with context checkpoints (-ctxcp, -cms) on tiny sliding-window, recurrent and
hybrid models, through HTTP: an edited conversation resumes from the nearest checkpoint (timings
say so), answers as from scratch, and /slots and /metrics show what the slots keep."""

from __future__ import annotations

import json

import pytest

from tests.commands.serve.conftest import MODEL, serving
from tests.commands.serve.test_serve import get, post

MODELS = MODEL.parent
LONG = [1, *[(i * 7) % 200 + 3 for i in range(500)]]  # beyond the window cache (256 cells)


def complete(url: str, tokens: list[int], **extra: object) -> dict:
    body = {"prompt": tokens, "n_predict": 5, "temperature": 0, "ignore_eos": True, **extra}
    status, _, r = post(url, "/completion", body)
    assert status == 200, r
    return r


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-mamba2", "tiny-granitehybrid"])
def test_an_edited_prompt_resumes_from_a_checkpoint(name: str) -> None:
    with serving(
        "-np", "1", "-c", "1024", "-ub", "8", "-cms", "64", "--metrics", model=MODELS / f"{name}.gguf"
    ) as s:
        first = complete(s.url, LONG)
        assert first["timings"]["cache_n"] == 0 and first["timings"]["cache_source"] == ""
        edited = [*LONG[:70], *range(200, 220)]
        r = complete(s.url, edited)
        t = r["timings"]
        assert (t["cache_n"], t["prompt_n"], t["cache_source"]) == (64, len(edited) - 64, "checkpoint")
        assert t["cache_reprocessed"] == "checkpoint_too_far_back"
        assert r["tokens"] == complete(s.url, edited, cache_prompt=False)["tokens"]
        status, text = get(s.url, "/slots")
        cps = json.loads(text)[0]["kv"]["checkpoints"]
        assert status == 200 and cps[0]["n_tokens"] == 64 and all(c["bytes"] > 0 for c in cps)
        metrics = read_metrics(s.url)
        assert metrics["kvtool:checkpoints"] >= 1 and metrics["kvtool:checkpoint_bytes"] > 0
        assert metrics['kvtool:prompt_tokens_reused_total{source="checkpoint"}'] == 64


def test_no_checkpoints_with_ctxcp_0() -> None:
    with serving("-np", "1", "-ub", "8", "-ctxcp", "0", model=MODELS / "tiny-mamba2.gguf") as s:
        complete(s.url, LONG)
        t = complete(s.url, [*LONG[:70], 5])["timings"]
        assert (t["cache_n"], t["cache_reprocessed"]) == (0, "cannot_truncate")


def read_metrics(url: str) -> dict[str, float]:
    status, text = get(url, "/metrics")
    assert status == 200
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
