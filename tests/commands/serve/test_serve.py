"""`kvtool serve` driven by the real `openai` client and by plain HTTP: every endpoint, every
error, prompt reuse with timings and the ledger, 16 concurrent streams, a disconnect, limits,
and a clean stop and restart."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

import kvtool
from tests.commands.serve.conftest import MODEL, Served, serving

LONG = "The quick brown fox jumps over the lazy dog. " * 12


def post(
    url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """A plain HTTP POST (body: a JSON value, or raw bytes); (status, headers, JSON answer)."""
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), json.loads(raw) if raw else None


def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text


def client(s: Served, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)


CHAT = [{"role": "user", "content": "Say hello."}]


def test_chat_with_the_openai_client(server: Served) -> None:
    r = client(server).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=6, seed=1)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details is not None
    timings = (r.model_extra or {})["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == r.usage.prompt_tokens
    assert timings["predicted_n"] == r.usage.completion_tokens


def test_streaming_chat_with_the_openai_client(server: Served) -> None:
    kw: dict[str, Any] = {"model": "tiny-llama", "messages": CHAT, "max_tokens": 8, "temperature": 0.0}
    whole = client(server).chat.completions.create(**kw)
    chunks = list(
        client(server).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer either way
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert "timings" in (chunks[-1].model_extra or {})


def test_completions_with_the_openai_client(server: Served) -> None:
    c = client(server)
    r = c.completions.create(
        model="tiny-llama", prompt="hello world", max_tokens=5, temperature=0.0, logprobs=2
    )
    assert r.object == "text_completion" and r.usage is not None and r.usage.completion_tokens <= 5
    streamed = c.completions.create(
        model="tiny-llama", prompt="hello world", max_tokens=5, temperature=0.0, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed) == r.choices[0].text
    lp = (r.choices[0].logprobs.model_extra or {}) if r.choices[0].logprobs else {}
    assert len(lp["content"]) == r.usage.completion_tokens and len(lp["content"][0]["top_logprobs"]) == 2
    models = c.models.list()
    assert [m.id for m in models.data] == ["tests/data/tiny/models/tiny-llama.gguf"] or len(models.data) == 1


def test_a_shared_long_prefix_is_reused(server: Served) -> None:
    """The second request shares a long prefix: cache_n > 0, fewer prompt tokens processed,
    and the ledger counts the reused tokens."""
    first = post(server.url, "/completion", {"prompt": LONG + "first", "n_predict": 2})[2]
    second = post(server.url, "/completion", {"prompt": LONG + "second", "n_predict": 2})[2]
    assert first["timings"]["cache_n"] <= 1
    assert second["timings"]["cache_n"] > 100
    assert second["timings"]["prompt_n"] < first["timings"]["prompt_n"] // 4
    assert second["id_slot"] == first["id_slot"]
    cold = post(server.url, "/completion", {"prompt": LONG + "third", "n_predict": 2, "cache_prompt": False})[
        2
    ]
    assert cold["timings"]["cache_n"] == 0
    status, text = get(server.url, "/metrics")
    assert status == 200
    metrics = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert metrics["llamacpp:prompt_tokens_cached_total"] >= second["timings"]["cache_n"]
    assert metrics['kvtool:prompt_tokens_reused_total{source="slot"}'] >= second["timings"]["cache_n"]
    assert metrics['kvtool:requests_reprocessed_total{reason="cache_prompt_off"}'] >= 1
    used = [v for k, v in metrics.items() if k.startswith("kvtool:kv_cells{") and 'state="used"' in k]
    assert len(used) == 4 and sum(used) > 0  # one stream per slot
    assert metrics['kvtool:kv_bytes{kind="attention",part="kv"}'] > 0


def test_native_completion_slots_and_id_slot(server: Served) -> None:
    status, _, r = post(
        server.url, "/completion", {"prompt": "abc", "n_predict": 3, "id_slot": 2, "stream": False}
    )
    assert status == 200 and r["id_slot"] == 2 and r["stop"] is True and r["tokens_predicted"] <= 3
    assert r["stop_type"] in ("eos", "limit", "word") and "timings" in r
    status, text = get(server.url, "/slots")
    slots = json.loads(text)
    assert status == 200 and [s["id"] for s in slots] == [0, 1, 2, 3]
    s2 = slots[2]
    assert not s2["is_processing"] and s2["n_prompt_tokens"] == r["tokens_evaluated"]
    assert s2["kv"]["tokens_cached"] == s2["kv"]["pos_max"] + 1 > 0


def test_native_streaming(server: Served) -> None:
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/completion", body=json.dumps({"prompt": "abc", "n_predict": 4, "stream": True}))
    lines = [ln for ln in conn.getresponse().read().decode().splitlines() if ln.startswith("data: ")]
    docs = [json.loads(ln[6:]) for ln in lines]
    assert [d["stop"] for d in docs] == [False] * (len(docs) - 1) + [True]
    assert "timings" in docs[-1]


def test_tokenize_detokenize_props_health_models(server: Served) -> None:
    _, _, t = post(server.url, "/tokenize", {"content": "hello world", "with_pieces": True})
    ids = [p["id"] for p in t["tokens"]]
    assert ids and all("piece" in p for p in t["tokens"])
    assert post(server.url, "/detokenize", {"tokens": ids})[2]["content"].strip() == "hello world"
    assert json.loads(get(server.url, "/health")[1]) == {"status": "ok"}
    props = json.loads(get(server.url, "/props")[1])
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 1024
    models = json.loads(get(server.url, "/v1/models")[1])
    assert models["object"] == "list" and models["data"][0]["meta"]["n_ctx"] == 1024


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_request_error"),
        ("/v1/chat/completions", [1, 2], 400, "invalid_request_error"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request_error"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400, "invalid_request_error"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": True}, 400, "invalid_request_error"),
        ("/v1/chat/completions", {"messages": CHAT, "model": ["gpt-4"]}, 400, "invalid_request_error"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "invalid_request_error"),
        # no content (llama-server's "Expected 'content' or 'tool_calls'"); tool calls in the history
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "invalid_request_error"),
        (
            "/v1/chat/completions",
            {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            400,
            "invalid_request_error",
        ),
        ("/v1/completions", {"prompt": "x " * 2000}, 400, "exceed_context_size_error"),
        ("/completion", {"prompt": [1, 99999]}, 400, "invalid_request_error"),
        ("/completion", {"prompt": "x", "id_slot": 9}, 400, "invalid_request_error"),
        ("/tokenize", {"content": 5}, 400, "invalid_request_error"),
        ("/nowhere", {}, 404, "not_found_error"),
        ("/v1/completions", b"x" * (17 << 20), 413, "invalid_request_error"),
        # JSON escapes of half a surrogate pair: no UTF-8 answer can hold them (500s before)
        ("/completion", b'{"prompt": "a\\udcff", "n_predict": 1}', 400, "invalid_request_error"),
        ("/tokenize", b'{"content": "\\ud800"}', 400, "invalid_request_error"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            400,
            "invalid_request_error",
        ),
        # nesting past Python's recursion limit (a RecursionError, 500, before)
        ("/completion", b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, "invalid_request_error"),
    ],
)
def test_bad_requests_are_openai_shaped_4xx(
    server: Served, path: str, body: Any, status: int, kind: str
) -> None:
    got, _, answer = post(server.url, path, body)
    assert got == status
    assert (
        answer["error"]["code"] == status and answer["error"]["type"] == kind and answer["error"]["message"]
    )
    assert get(server.url, "/health")[0] == 200  # and the server keeps serving


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
        ("json_schema", {}),
        ("grammar", 'root ::= "yes"'),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("logit_bias", {"42": -100}),
        ("mirostat", 2),
        ("dry_multiplier", 0.8),
        ("xtc_probability", 0.5),
        ("top_n_sigma", 1.0),
    ],
)
def test_a_feature_kvtool_lacks_is_a_400_not_ignored(server: Served, field: str, value: Any) -> None:
    """llama-server's grammars, tools, logit biases and other samplers are not in kvtool serve:
    asking for one is a 400 naming it (an answer that ignored it, non-JSON to a JSON request,
    looked like one that honoured it), on every completion endpoint."""
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/completion", {"prompt": "hi"}),
    ):
        got, _, answer = post(server.url, path, {**body, "max_tokens": 2, field: value})
        assert got == 400, (path, answer)
        assert answer["error"]["message"].startswith(f"'{field}' is not supported: kvtool serve has no ")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("echo", True, "Only no echo is supported"),
        ("best_of", 3, "Unsupported param: best_of"),
        ("suffix", "}", "Unsupported param: suffix"),
    ],
)
def test_openai_completion_fields_llama_server_refuses(
    server: Served, field: str, value: Any, message: str
) -> None:
    """/v1/completions refuses `echo`, `best_of` and `suffix` in llama-server's words (they were
    ignored); null, `best_of` 1 and `suffix` "" ask for nothing and are served."""
    got, _, answer = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert got == 400 and answer["error"]["message"] == message
    inert = {"echo": False, "best_of": 1, "suffix": ""}
    got, _, answer = post(
        server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: inert[field]}
    )
    assert got == 200, answer


def test_llama_servers_inert_values_of_those_features_are_served(server: Served) -> None:
    """The values that ask for nothing, as clients send them by default, are answered."""
    inert = {
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "auto",
        "logit_bias": {},
        "grammar": "",
        "mirostat": 0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "top_n_sigma": -1.0,
    }
    got, _, answer = post(server.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **inert})
    assert got == 200, answer


def test_several_prompts_are_refused_as_such(server: Served) -> None:
    """OpenAI's batch of prompts (llama-server answers each): one prompt is served, several are
    a 400 that says so (it said 'prompt' must be a string or a list of token ids)."""
    for prompt in (["a", "b"], [[1, 2], [3, 4]]):
        got, _, answer = post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert (
            got == 400
            and answer["error"]["message"] == "only one prompt per request is supported ('prompt' holds 2)"
        )
    assert post(server.url, "/v1/completions", {"prompt": ["a"], "max_tokens": 2})[0] == 200


def test_a_value_out_of_range_names_its_bound(server: Served) -> None:
    got, _, answer = post(server.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": -5})
    assert got == 400 and answer["error"]["message"] == "'max_tokens' must be at least -1, got -5"


def test_any_model_name_is_served_by_the_model(server: Served) -> None:
    """llama-server with one model answers whatever `model` a client sends (placeholders such
    as "gpt-4o" are common), in its own model's name; a `model` of the wrong type is a 400."""
    answer = client(server).chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert answer.model == client(server).models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="'model' must be a string"):
        client(server).chat.completions.create(model=7, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]


def test_sixteen_concurrent_streams(server: Served) -> None:
    """16 clients stream at once over 4 slots: every one gets a whole answer."""
    results: dict[int, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            chunks = client(server).chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": f"Question {i}?"}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, n = "", 0
            for c in chunks:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                if c.usage is not None:
                    n = c.usage.completion_tokens
            results[i] = (text, n)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and sorted(results) == list(range(16))
    assert all(n == 12 for _, n in results.values())


def slot_busy(s: Served) -> list[bool]:
    return [x["is_processing"] for x in json.loads(get(s.url, "/slots")[1])]


def test_a_disconnect_frees_the_slot_at_once(server: Served) -> None:
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    body = {"prompt": "abc", "n_predict": 900, "ignore_eos": True, "stream": True, "id_slot": 1}
    conn.request("POST", "/completion", body=json.dumps(body))
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")
    assert slot_busy(server)[1]
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    deadline = time.monotonic() + 2
    while slot_busy(server)[1]:
        assert time.monotonic() < deadline, "the slot is still busy 2 s after the client left"
        time.sleep(0.05)
    last = json.loads(get(server.url, "/slots")[1])[1]
    assert last["next_token"][0]["n_decoded"] < 900


def test_api_key_queue_limit_and_timeout() -> None:
    with serving("-np", "1", "-c", "2048", "--api-key", "k1,k2", "--max-queue", "0", "--timeout", "1") as s:
        assert post(s.url, "/completion", {"prompt": "a", "n_predict": 1})[0] == 401
        assert (
            post(s.url, "/completion", {"prompt": "a", "n_predict": 1}, {"Authorization": "Bearer k3"})[0]
            == 401
        )
        assert get(s.url, "/health")[0] == 200  # public, as llama-server's
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=1)
        assert post(s.url, "/completion", {"prompt": "a", "n_predict": 1}, {"X-Api-Key": "k2"})[0] == 200
        auth = {"Authorization": "Bearer k1"}
        # one slot busy with a long answer, no queue: the next request is refused with Retry-After
        long = {"prompt": "a", "n_predict": 2000, "ignore_eos": True}
        t = threading.Thread(target=lambda: results.append(post(s.url, "/completion", long, auth)))
        results: list[tuple[int, dict[str, str], Any]] = []
        t.start()
        deadline = time.monotonic() + 10
        while not json.loads(get(s.url, "/slots", auth)[1])[0]["is_processing"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, headers, answer = post(s.url, "/completion", {"prompt": "b", "n_predict": 1}, auth)
        assert (
            status == 503 and headers["retry-after"] == "1" and answer["error"]["type"] == "unavailable_error"
        )
        t.join(30)
        # the long one ran past --timeout 1: answered 408, its slot freed
        (status, _, answer), *_ = results
        assert status == 408 and answer["error"]["type"] == "timeout_error"
        deadline = time.monotonic() + 2  # the engine ends the cancelled task at its next step
        while json.loads(get(s.url, "/slots", auth)[1])[0]["is_processing"]:
            assert time.monotonic() < deadline, "the slot is still busy 2 s after the timeout"
            time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_server_cleanly_and_it_restarts(sig: int) -> None:
    s = serving("-np", "2", "-c", "1024")
    with s as first:
        port = first.port
        assert post(first.url, "/completion", {"prompt": "a", "n_predict": 2})[0] == 200
        t0 = time.monotonic()
        rc, err = first.stop(sig)
        assert rc == 0 and "serve: stopped" in err and "Traceback" not in err
        assert re.search(r"^serve: \S+\.gguf on CPU \([^)]+\), 2 slots", err, re.M)  # the backend
        assert "serve: stopping: requests in flight get 5 s" in err
        # one line per request, as llama-server logs them (health checks left out)
        assert "serve: request: POST /completion HTTP/1.1 127.0.0.1:" in err and "/health" not in err
        assert time.monotonic() - t0 < 10
    with serving("-np", "2", "-c", "1024", port=port) as again:
        assert post(again.url, "/completion", {"prompt": "a", "n_predict": 2})[0] == 200


def test_auto_slots_share_the_whole_context_and_an_answer_stops_when_it_is_full() -> None:
    """llama-server without -np: 4 slots over one unified buffer, each up to the whole context;
    a max_tokens beyond it is served until the slot is full (stop_type limit, truncated)."""
    with serving("-c", "512") as s:
        slots = json.loads(get(s.url, "/slots")[1])
        assert len(slots) == 4 and {x["n_ctx"] for x in slots} == {512}
        body = {"prompt": "abc", "n_predict": 100_000, "ignore_eos": True}
        status, _, r = post(s.url, "/completion", body)
        assert status == 200, r
        assert r["stop_type"] == "limit" and r["truncated"] is True
        assert r["tokens_evaluated"] + r["tokens_predicted"] == 512 + 1  # the last one is never stored
        status, _, r = post(s.url, "/completion", {"prompt": "abc", "n_predict": 3, "ignore_eos": True})
        assert r["stop_type"] == "limit" and r["truncated"] is False and r["tokens_predicted"] == 3


def test_zero_slots_is_refused() -> None:
    import subprocess
    import sys

    from tests.commands.serve.conftest import MODEL

    cmd = [sys.executable, "-m", "kvtool.commands", "serve", "-m", str(MODEL), "-np", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must be -1 (auto) or in [1, 63], got 0" in r.stderr


def test_sighup_with_its_terminal_gone_still_stops_cleanly() -> None:
    """SIGHUP is the terminal closing: stderr then fails (here: a pipe nobody reads). The stop
    goes on without its notes and exits 0 (it exited 2 on the last note's write error)."""
    s = serving("-np", "1", "-c", "512")
    with s as first:
        assert first.proc.stderr is not None
        first.proc.stderr.close()
        first.proc.send_signal(signal.SIGHUP)
        assert first.proc.wait(timeout=30) == 0


def test_a_taken_port_is_one_line() -> None:
    with serving("-np", "1", "-c", "512") as s:
        import subprocess
        import sys

        from tests.commands.serve.conftest import MODEL

        cmd = [sys.executable, "-m", "kvtool.commands", "serve", "-m", str(MODEL), "--port", str(s.port)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2
        assert (
            r.stderr.strip().startswith("error: cannot listen on 127.0.0.1:") and "\n" not in r.stderr.strip()
        )


def _streaming() -> tuple[Served, http.client.HTTPResponse]:
    """A server of one slot, streaming a long answer (its first event read)."""
    from tests.commands.serve.conftest import start

    s = start("-np", "1", "-c", "4096")
    conn = http.client.HTTPConnection(s.url.removeprefix("http://"), timeout=60)
    body = {"prompt": "a", "n_predict": 4000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/completion", body=json.dumps(body))
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")
    return s, r


def test_a_stop_during_a_stream_closes_it_between_whole_events() -> None:
    """SIGINT while an answer streams: the server lets it run for 5 s, then ends it; the client
    gets whole events up to a last one, and the server exits 0 without a traceback."""
    s, r = _streaming()
    s.proc.send_signal(signal.SIGINT)
    try:
        rest = r.read()
    except http.client.IncompleteRead as e:  # the chunked body was cut at an event's end
        rest = e.partial
    events = [
        json.loads(ev.strip().removeprefix("data: ")) for ev in rest.decode().split("\n\n") if ev.strip()
    ]
    assert events[-1]["stop"] is True and 0 < events[-1]["tokens_predicted"] < 4000
    _, err = s.proc.communicate(timeout=30)
    assert s.proc.returncode == 0 and "Traceback" not in err and "serve: stopped" in err


def test_a_second_ctrl_c_during_a_stream_stops_at_once_without_a_traceback() -> None:
    """Ctrl-C twice while an answer streams: the second ends it at once (the client's stream is
    cut), and the server still exits 0 with its one line, not uvicorn's traceback of the
    cancelled request."""
    s, r = _streaming()
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    s.proc.send_signal(signal.SIGINT)
    with contextlib.suppress(http.client.HTTPException, OSError):
        r.read()
    _, err = s.proc.communicate(timeout=30)
    assert s.proc.returncode == 0, err
    assert "Traceback" not in err and "ERROR" not in err and err.rstrip().endswith("serve: stopped"), err


GEMMA3 = MODEL.parent / "tiny-gemma3.gguf"  # heads of 32: every block type tiles them
Q8_0_ROW = 34  # bytes per 32 values


def test_quantized_kv_types_in_the_ledger_and_a_completion() -> None:
    """-ctk/-ctv q8_0 as llama-server takes them: a completion runs over the blocks, /slots names
    the types, /metrics counts K and V in q8_0 blocks, per part, from the model's shapes."""
    flags = ("-np", "2", "-c", "1024", "--metrics", "-ctk", "q8_0", "-ctv", "q8_0")
    with serving(*flags, model=GEMMA3) as s:
        status, _, r = post(
            s.url, "/completion", {"prompt": "hello the cat", "n_predict": 4, "temperature": 0}
        )
        assert status == 200 and 1 <= r["tokens_predicted"] <= 4 and r["content"]
        slots = json.loads(get(s.url, "/slots")[1])
        cells = [c for slot in slots for c in slot["kv"]["cells"]]
        assert cells and all((c["type_k"], c["type_v"]) == ("q8_0", "q8_0") for c in cells)
        text = get(s.url, "/metrics")[1]
    metrics = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln[:1] != "#"}
    m = kvtool.Model(GEMMA3)
    hp, swa = m.hparams, m.memory_spec().swa_layers
    for part, layers in (("base", [i for i in range(hp.n_layer) if i not in swa]), ("swa", sorted(swa))):
        kind = "sliding_window" if part == "swa" else "attention"
        n_cells = [
            v for k, v in metrics.items() if k.startswith("kvtool:kv_cells{") and f'part="{part}"' in k
        ]
        rows = sum(n_cells)  # used + free over both streams (split KV: one per slot)
        for t, hd in (("k", hp.head_dim_k), ("v", hp.head_dim_v)):
            want = rows * sum(hp.n_head_kv[il] * hd // 32 * Q8_0_ROW for il in layers)
            key = f'kvtool:kv_tensor_bytes{{kind="{kind}",part="{part}",tensor="{t}",type="q8_0"}}'
            assert metrics[key] == want


@pytest.mark.parametrize("flags", [["-ctk", "q3"], ["-ctv", "q8_0"]])
def test_a_kv_type_is_refused_as_run_refuses_it(flags: list[str]) -> None:
    """A type kvtool lacks, or one whose blocks do not tile the heads (tiny llama: 16): serve's
    one error line is run's."""

    def error(*verb: str) -> str:
        cmd = [sys.executable, "-m", "kvtool.commands", *verb, "-m", str(MODEL), *flags]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
        return r.stderr

    assert error("serve", "--port", "0") == error("run", "-p", "hi", "-n", "1", "--no-chat")


def test_a_model_that_fails_to_load_leaves_nothing_listening(tmp_path: Path) -> None:
    """The port is bound before the model loads; a load that fails closes it, also in a process
    that goes on (a test's, the special-files fuzzer's worker)."""
    from typer.testing import CliRunner

    from kvtool.commands import _register, app
    from kvtool.commands.serve import _bind
    from tests.commands.serve.conftest import free_port

    _register()
    bad = tmp_path / "not-a-model.gguf"
    bad.write_text("not a model\n")
    port = free_port()
    result = CliRunner().invoke(app, ["serve", "-m", str(bad), "--port", str(port)])
    assert result.exit_code != 0
    _bind("127.0.0.1", port).close()  # the port is free again
