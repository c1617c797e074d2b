"""llama-server's slot actions on `kvtool serve` (--slot-save-path), through HTTP, for every
memory kind (attention and sliding window over split or unified KV, recurrent, both hybrids):
save, restore into the same slot, another one (leaving the slot it came from as it was) and after
a restart, erase; checkpoints travel with the slot; bad requests and bad
files are 4xx answers that leave the slot as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands.serve.conftest import MODEL, serving
from tests.commands.serve.test_serve import post

MODELS = MODEL.parent
LONG = [1, *[(i * 7) % 200 + 3 for i in range(500)]]
# (model, extra flags): split and unified KV, a sliding window, a recurrent state, both hybrids
KINDS = [
    pytest.param("tiny-llama", (), id="llama"),
    pytest.param("tiny-llama", ("-kvu",), id="llama-kvu"),
    pytest.param("tiny-gemma3", (), id="gemma3"),
    pytest.param("tiny-gemma3", ("-kvu",), id="gemma3-kvu"),
    pytest.param("tiny-mamba2", (), id="mamba2"),
    pytest.param("tiny-granitehybrid", (), id="granitehybrid"),
    pytest.param("tiny-lfm2", (), id="lfm2"),
]


def complete(url: str, tokens: list[int], slot: int, **extra: object) -> dict:
    body = {"prompt": tokens, "n_predict": 4, "temperature": 0, "ignore_eos": True, "id_slot": slot}
    status, _, r = post(url, "/completion", body | extra)
    assert status == 200, r
    return r


def action(url: str, slot: int | str, what: str, filename: str | None = None) -> tuple[int, dict]:
    body = {} if filename is None else {"filename": filename}
    status, _, r = post(url, f"/slots/{slot}?action={what}", body)
    return status, r


@pytest.mark.parametrize(("name", "extra"), KINDS)
def test_save_restore_elsewhere_and_after_a_restart_then_erase(
    name: str, extra: tuple[str, ...], tmp_path: Path
) -> None:
    flags = ("-np", "2", "-c", "2048", "-ub", "8", "-cms", "64", "--slot-save-path", str(tmp_path), *extra)
    model = MODELS / f"{name}.gguf"
    edited = [*LONG[:70], *range(200, 220)]
    with serving(*flags, model=model) as s:
        first = complete(s.url, LONG, 0)
        status, saved = action(s.url, 0, "save", "conv.state")
        assert status == 200 and saved["n_saved"] == len(LONG) + 3 and saved["filename"] == "conv.state"
        assert (
            saved["n_written"] == (tmp_path / "conv.state").stat().st_size and "save_ms" in saved["timings"]
        )
        status, restored = action(s.url, 1, "restore", "conv.state")  # into another slot
        assert status == 200 and restored["n_restored"] == len(LONG) + 3
        assert restored["n_read"] == saved["n_written"]
        again = complete(s.url, LONG, 1)
        assert again["tokens"] == first["tokens"]
        assert again["timings"]["cache_n"] >= len(LONG) - 4  # the slot, or its end-of-prompt checkpoint
        kept = complete(s.url, LONG, 0)  # the restore left the slot it came from as it was
        assert kept["tokens"] == first["tokens"] and kept["timings"]["cache_n"] >= len(LONG) - 4
        status, erased = action(s.url, 0, "erase")
        assert status == 200 and erased == {"id_slot": 0, "n_erased": len(LONG) + 3}
        t = complete(s.url, LONG, 0)["timings"]
        assert (t["cache_n"], t["cache_source"]) == (0, "")
        scratch = complete(s.url, edited, 0, cache_prompt=False)
    with serving(*flags, model=model) as s:  # a restart: the file is all there is
        assert action(s.url, 1, "restore", "conv.state")[0] == 200
        r = complete(s.url, edited, 1)
        want = (70, "slot") if name == "tiny-llama" else (64, "checkpoint")  # checkpoints came back
        assert (r["timings"]["cache_n"], r["timings"]["cache_source"]) == want
        assert r["tokens"] == scratch["tokens"]


def test_bad_actions_and_bad_files_are_refused_one_by_one(tmp_path: Path) -> None:
    with serving("-np", "2", "--slot-save-path", str(tmp_path), model=MODELS / "tiny-mamba2.gguf") as s:
        complete(s.url, LONG[:40], 0)
        assert action(s.url, 0, "save", "good")[0] == 200
        good = (tmp_path / "good").read_bytes()
        (tmp_path / "truncated").write_bytes(good[: len(good) // 2])
        flipped = bytearray(good)
        flipped[-10] ^= 0xFF
        (tmp_path / "corrupt").write_bytes(bytes(flipped))
        (tmp_path / "notes.txt").write_text("not a state")
        for slot, what, name, status, words in [
            (0, "save", "../escape", 400, "Invalid filename"),
            (0, "save", ".hidden", 400, "Invalid filename"),
            (0, "save", "notes.txt", 500, "not a kvtool state file"),
            (0, "fly", "good", 400, "Invalid action"),
            (9, "save", "good", 400, "Invalid slot ID"),
            ("x", "save", "good", 400, "Invalid slot ID"),
            (1, "restore", "missing", 400, "no state file"),
            (1, "restore", "truncated", 400, "Unable to restore slot"),
            (1, "restore", "corrupt", 400, "checksum"),
            (1, "restore", "notes.txt", 400, "Unable to restore slot"),
        ]:
            got, r = action(s.url, slot, what, name)
            assert got == status and words in r["error"]["message"], (what, name, r)
        assert complete(s.url, LONG[:40], 1)["timings"]["cache_n"] == 0  # slot 1 took nothing
        assert (tmp_path / "notes.txt").read_text() == "not a state"
    with serving(
        "-np", "1", "--slot-save-path", str(tmp_path), model=MODELS / "tiny-granitehybrid.gguf"
    ) as s:
        got, r = action(s.url, 0, "restore", "good")  # another model's state
        assert got == 400 and "Unable to restore slot" in r["error"]["message"]
    with serving("-np", "1") as s:
        got, r = action(s.url, 0, "erase")
        assert got == 501 and "--slot-save-path" in r["error"]["message"]
