"""The disk prompt cache: a dropped prompt comes back from its file (same greedy tokens), a new
instance on the folder (a restart) finds it, corrupt, truncated and foreign files are refused one
by one and never loaded, the byte budget deletes the least recently used files, and two writers
on one folder leave a sound index."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import kvtool
from kvtool.common.checkpoints import CheckpointParams
from kvtool.common.disk_cache import INDEX, SUFFIX, DiskCache
from kvtool.common.ram_cache import Entry, RamCache
from kvtool.common.scheduler import Scheduler, SchedulerParams
from kvtool.common.task import Request
from tests.kvtool.common.test_scheduler import GREEDY, MODELS, reference, run

A = [1, *[(i * 7) % 200 + 3 for i in range(120)]]
B = [2, *[(i * 5) % 190 + 7 for i in range(100)]]
C = [4, *[(i * 3) % 180 + 9 for i in range(90)]]
N = 4


def make(model: kvtool.Model, folder: Path, lines: list[str] | None = None) -> tuple[Scheduler, DiskCache]:
    disk = DiskCache(folder, model, -1, None if lines is None else lines.append)
    ram = RamCache(0, on_evict=disk.put)  # nothing stays in RAM: every dropped prompt goes to disk
    params = kvtool.ContextParams(n_ctx=512, n_ubatch=8)
    sp = SchedulerParams(1, checkpoints=CheckpointParams(n_max=8, min_step=32), sources=(ram, disk))
    return Scheduler(kvtool.Context(model, params), sp), disk


def ask(sched: Scheduler, model: kvtool.Model, tokens: list[int]) -> tuple[int, str]:
    (t,) = run(sched, Request(tokens, N, GREEDY, ignore_eos=True))
    assert t.generated == reference(model, tokens, N)
    return t.timings.cache_n, t.timings.cache_source


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-mamba2", "tiny-granitehybrid"])
def test_a_dropped_prompt_comes_back_from_disk_also_after_a_restart(name: str, tmp_path: Path) -> None:
    model = kvtool.Model(MODELS / f"{name}.gguf")
    sched, disk = make(model, tmp_path)
    ask(sched, model, A)
    ask(sched, model, B)  # A's slot state goes to disk
    assert len(disk.entries) == 1 and disk.stats.n_saved == 1
    n, src = ask(sched, model, A)
    assert src == "disk" and n == (len(A) - 1 if name == "tiny-llama" else len(A) - 4)
    disk.close()
    sched, disk = make(model, tmp_path)  # a restart: the index and files are all there is
    assert len(disk.entries) == 2  # A and B (B was dropped for A)
    n, src = ask(sched, model, B)
    assert src == "disk" and n >= len(B) - 4


def test_bad_files_are_refused_one_by_one_and_never_loaded(tmp_path: Path) -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    sched, disk = make(model, tmp_path)
    for p in (A, B, C, A):  # A, B, C on disk
        ask(sched, model, p)
    files = {tuple(disk.best(p)[1][: len(p)]): tmp_path / f"{disk.best(p)[0]}{SUFFIX}" for p in (A, B, C)}
    fa, fb, fc = (files[tuple(p)] for p in (A, B, C))
    data = bytearray(fa.read_bytes())
    data[-5] ^= 0xFF
    fa.write_bytes(bytes(data))
    fb.write_bytes(fb.read_bytes()[:1000])
    other = kvtool.Model(MODELS / "tiny-mamba2.gguf")  # a sound state of another model
    octx = kvtool.Context(other, kvtool.ContextParams(n_ctx=256))
    kvtool.decode_tokens(octx, [1, 2, 3], 0, 0)
    fc.write_bytes(octx.state_seq_get_data(0, tokens=[1, 2, 3]))
    disk.close()
    lines: list[str] = []
    sched, disk = make(model, tmp_path, lines)
    for p in (A, B, C):
        assert ask(sched, model, p) == (0, "")  # answered from scratch: nothing was loaded
    assert disk.refused == {"corrupt": 1, "truncated": 1, "foreign": 1} and len(lines) == 3
    assert "checksum" in lines[0] and "truncated" in lines[1] and "another model" in lines[2]
    # the broken files were deleted (A's and B's were written again, whole, when their slot
    # dropped them); the foreign one is left to the servers it suits
    for f in (fa, fb):
        assert not f.exists() or kvtool.inspect_state(f).tokens()
    assert kvtool.inspect_state(fc).model["fingerprint"] == other.fingerprint
    assert ask(sched, model, A) == (len(A) - 1, "disk")  # A's new file serves; nothing else refused
    assert len(lines) == 3


def test_the_budget_deletes_the_least_recently_used_files(tmp_path: Path) -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    disk = DiskCache(tmp_path, model, 2500)
    for i in range(3):
        disk.put(Entry((i, 1, 2), bytes([i]) * 1000))
    assert sorted(n for _, n in disk.entries) == [1000, 1000] and disk.stats.n_evicted == 1
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    disk.put(Entry((9,), b"x" * 3000))  # over the whole budget
    assert disk.stats.n_refused == 1 and len(disk.entries) == 2


def test_two_writers_on_one_folder_leave_a_sound_index(tmp_path: Path) -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256))
    kvtool.decode_tokens(ctx, [1, 2, 3], 0, 0)
    caches = [DiskCache(tmp_path, model, -1) for _ in range(2)]

    def write(w: int) -> None:
        for i in range(15):
            toks = (w, i, 1, 2, 3)
            caches[w].put(Entry(toks, ctx.state_seq_get_data(0, tokens=list(toks))))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = DiskCache(tmp_path, model, -1)
    assert len(fresh.entries) == 30 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 30
    for key, _ in fresh.entries:
        kvtool.inspect_state(tmp_path / f"{key}{SUFFIX}")  # every file whole


def test_an_index_of_something_else_is_refused(tmp_path: Path) -> None:
    import sqlite3

    sqlite3.connect(tmp_path / INDEX).execute("CREATE TABLE notes (x)").connection.commit()
    with pytest.raises(kvtool.KvtoolError, match="belongs to something else"):
        DiskCache(tmp_path, kvtool.Model(MODELS / "tiny-llama.gguf"), -1)
