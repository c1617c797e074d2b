"""The client simulation against a real local HTTP server streaming server-sent events."""

from __future__ import annotations

import threading

import pytest

import kvtool
from kvtool.commands.parallel.http import HttpParallelSim, ServerError, chat_url, stream_chat
from kvtool.commands.parallel.sim import ParallelParams
from tests.helpers.sse_server import ServerLog, answer_words, prompt_tokens, sse_server


def test_chat_url() -> None:
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"


def test_stream_yields_every_chunk() -> None:
    log = ServerLog()
    body = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4, "stream": True}
    with sse_server(log) as url:
        chunks = list(stream_chat(url, body, timeout=10))
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "".join(p for p in pieces if p) == "one two three one "
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4}


@pytest.mark.parametrize("cont", [True, False])
def test_clients_run_concurrently_and_every_request_is_answered(cont: bool) -> None:
    log = ServerLog(barrier=threading.Barrier(3))  # the first 3 requests wait for each other
    p = ParallelParams(3, 7, 5, cont_batching=cont, n_junk=3, sampler=kvtool.SamplerParams(seed=7, temp=0.5))
    with sse_server(log) as url:
        sim = HttpParallelSim(url, p, model="tiny", timeout=30)
        summary = sim.run()
    assert log.peak == 3
    recs = summary.records
    assert [r.seq for r in recs] == list(range(7))
    assert len(log.bodies) == 7
    by_question: dict[str, list] = {}
    for b in log.bodies:
        assert b["stream"] is True and b["max_tokens"] == 5 and b["seed"] == 7 and b["model"] == "tiny"
        assert b["messages"][0] == {"role": "system", "content": p.system}
        by_question.setdefault(b["messages"][-1]["content"], []).append(b)
    for r in recs:
        body = by_question[r.input][0]
        assert r.response == "".join(answer_words(body)).strip()
        assert r.n_decoded == len(answer_words(body)) and r.stop == "length"
        assert r.n_prompt > 0
        assert r.ttft is not None and 0 <= r.ttft <= r.time
    assert summary.n_prompt == sum(r.n_prompt for r in recs) == sum(prompt_tokens(b) for b in log.bodies)
    assert summary.n_gen == 7 * 5
    if not cont:  # waves of 3, 3, 1: the i-th request starts after the previous waves ended
        n_start = n_end = 0
        for e in log.events:
            if e == "start":
                assert n_end >= n_start // 3 * 3
                n_start += 1
            else:
                n_end += 1


def test_failed_requests_are_recorded() -> None:
    log = ServerLog(fail_every=2)
    with sse_server(log) as url:
        summary = HttpParallelSim(url, ParallelParams(1, 4, 3), timeout=30).run()
    stops = [r.stop for r in summary.records]
    assert stops == ["length", "error", "length", "error"]
    assert "HTTP 500" in summary.records[1].response
    assert summary.n_gen == 6


def test_the_api_key_goes_with_every_request() -> None:
    """--api-key: a server started with llama-server's --api-key answered every request 401."""
    log = ServerLog()
    with sse_server(log) as url:
        HttpParallelSim(url, ParallelParams(2, 3, 2), timeout=30, api_key="k1").run()
        HttpParallelSim(url, ParallelParams(1, 1, 2), timeout=30).run()
    assert log.auth == ["Bearer k1"] * 3 + [None]


def test_unreachable_server_is_a_server_error() -> None:
    with pytest.raises(ServerError):
        list(stream_chat("http://127.0.0.1:9", {"messages": []}, timeout=5))
