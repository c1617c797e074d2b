"""`kvtool serve`'s prompt cache tiers through HTTP: a conversation a slot dropped for another
comes back from host RAM (--cache-ram), timings and /metrics say so; --cache-ram 0 keeps none;
a restarted server on the same --cache-dir serves from disk, and refuses truncated, corrupt and
another model's files one by one, answering on."""

from __future__ import annotations

from pathlib import Path

import kvtool
from tests.commands.serve.conftest import MODEL, serving, start
from tests.commands.serve.test_serve_checkpoints import complete, read_metrics

MODELS = MODEL.parent
A = [1, *[(i * 7) % 200 + 3 for i in range(300)]]
B = [2, *[(i * 5) % 190 + 7 for i in range(200)]]
C = [3, *[(i * 3) % 170 + 11 for i in range(200)]]


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


def test_an_entry_sharing_no_more_than_the_slot_holds_is_not_loaded() -> None:
    with serving(
        "-np",
        "1",
        "-ub",
        "8",
        "-cms",
        "64",
        "--cache-ram",
        "64",
        "--metrics",
        model=MODELS / "tiny-mamba2.gguf",
    ) as s:
        complete(s.url, A)
        complete(s.url, B)
        assert complete(s.url, A)["timings"]["cache_source"] == "ram"  # with A's checkpoints
        # the slot holds A; so does its RAM entry: the edit resumes from the slot's checkpoint,
        # loading the entry would end there too
        t = complete(s.url, [*A[:150], 7, 8, 9])["timings"]
        assert (t["cache_n"], t["cache_source"]) == (128, "checkpoint")
        assert read_metrics(s.url)['kvtool:cache_events_total{event="hits",tier="ram"}'] == 1


def test_cache_ram_0_keeps_nothing() -> None:
    with serving("-np", "1", "-ub", "8", "--cache-ram", "0", model=MODELS / "tiny-mamba2.gguf") as s:
        complete(s.url, A)
        complete(s.url, B)
        assert complete(s.url, A)["timings"]["cache_n"] == 0


def test_a_restart_on_the_same_cache_dir_serves_from_disk(tmp_path: Path) -> None:
    flags = ("-np", "1", "-ub", "8", "--cache-dir", str(tmp_path), "--metrics")
    model = MODELS / "tiny-granitehybrid.gguf"
    with serving(*flags, model=model) as s:
        first = complete(s.url, A)
        complete(s.url, B)  # A falls out of the slot: RAM
    # the stop wrote RAM's entries and the slot's prompt (B) to disk
    files = sorted(tmp_path.glob("*.state"))
    assert len(files) == 2
    with serving(*flags, model=model) as s:
        again = complete(s.url, A)
        t = again["timings"]
        assert (t["cache_n"], t["cache_source"]) == (len(A) - 4, "disk") and again["tokens"] == first[
            "tokens"
        ]
        assert read_metrics(s.url)['kvtool:cache_events_total{event="hits",tier="disk"}'] == 1
    for f in sorted(tmp_path.glob("*.state")):  # every file broken: each refused, the server serves on
        f.write_bytes(f.read_bytes()[:-7])
    s = start(*flags, model=model)
    try:
        assert complete(s.url, A)["timings"]["cache_n"] == 0
        assert complete(s.url, B)["timings"]["cache_n"] == 0
        assert read_metrics(s.url)['kvtool:cache_refused_total{reason="truncated",tier="disk"}'] == 2
    finally:
        rc, err = s.stop()
    assert rc == 0 and err.count("refused (truncated)") == 2


def test_truncated_corrupt_and_foreign_cache_files_are_refused_one_by_one(tmp_path: Path) -> None:
    flags = ("-np", "1", "-ub", "8", "--cache-dir", str(tmp_path), "--metrics")
    model = MODELS / "tiny-mamba2.gguf"
    prompts = {"truncated": A, "corrupt": B, "foreign": C}
    with serving(*flags, model=model) as s:  # A and B go to RAM, C stays in the slot
        answers = {why: complete(s.url, p)["tokens"] for why, p in prompts.items()}
    files = {why: entry_of(tmp_path, p) for why, p in prompts.items()}  # the stop wrote all three
    data = files["truncated"].read_bytes()
    files["truncated"].write_bytes(data[:-7])
    data = bytearray(files["corrupt"].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files["corrupt"].write_bytes(bytes(data))
    files["foreign"].write_bytes(other_models_state(C))
    s = start(*flags, model=model)
    try:
        for i, (why, p) in enumerate(prompts.items()):  # each refused as it comes; the server answers on
            r = complete(s.url, p)
            assert r["timings"]["cache_n"] == 0 and r["tokens"] == answers[why]
            m = read_metrics(s.url)
            counts = [m.get(f'kvtool:cache_refused_total{{reason="{w}",tier="disk"}}', 0) for w in prompts]
            assert counts == [1] * (i + 1) + [0] * (len(prompts) - i - 1)
            # a broken file is deleted, another model's left for the servers it suits
            assert files[why].exists() == (why == "foreign")
    finally:
        rc, err = s.stop()
    assert rc == 0 and all(err.count(f"refused ({why})") == 1 for why in prompts), err


def entry_of(folder: Path, prompt: list[int]) -> Path:
    """The --cache-dir file holding a slot state that starts with `prompt`."""
    found = [f for f in folder.glob("*.state") if kvtool.inspect_state(f).tokens()[: len(prompt)] == prompt]
    assert len(found) == 1, found
    return found[0]


def other_models_state(tokens: list[int]) -> bytes:
    """A sound sequence state of `tokens` made with another model (the tiny llama)."""
    model = kvtool.load_model(str(MODEL))
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1))
    kvtool.decode_tokens(ctx, tokens, 0, 0)
    return ctx.state_seq_get_data(0, tokens=tokens)
