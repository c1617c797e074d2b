"""Fuzzing the state loader (issue 14): real states of every memory kind, mutated, loaded.

Sources are whole-context and sequence states written by the tiny fixture models (unified KV,
split streams, gemma3's sliding window, mamba/rwkv recurrent, granitehybrid/lfm2 hybrid), with
shared cells, pending shifts, a sampler and token ids. Each is mutated three ways:

* raw bytes: truncation at every section boundary (length field, header, each tensor) and
  inside sections, bit flips, inserted/removed/appended bytes, a hostile header length;
* re-signed containers: the tensor index rewritten (huge, overflowing or negative shapes and
  offsets, unknown dtypes, extra keys) with a correct checksum, as a hostile author would;
* re-signed states: a header field set to a hostile value (huge, negative, wrong type) or
  removed, tensors resized, retyped, dropped, added, or filled with extreme values.

The checksum is SHA-256 without a key, so anyone can sign anything: the loader must validate
every field by itself. The invariant, for every case: the load succeeds (and the context
still decodes), or raises a one-line `KvtoolError` leaving the context exactly as it was
(every array and tensor of the memory, the logits) -- never another exception, a hang or an
allocation beyond the file's size. `benchmarks/fuzz_state.py` runs the same for longer.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import resource
import signal
import struct
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtool
from kvtool.errors import KvtoolError

TINY = Path(__file__).parents[1] / "data" / "tiny" / "models"
ARCHS = ["llama", "gemma3", "mamba", "rwkv6", "granitehybrid", "lfm2"]
N_SEQ = 3
N_CTX = 64

# -- sources: real states -------------------------------------------------------------------


@dataclass
class Source:
    """One saved state and the live context of the same model it is loaded into."""

    arch: str
    unified: bool
    kind: str  # "context" or "sequence"
    data: bytes
    model: kvtool.Model


@dataclass(frozen=True)
class Target:
    """The context a state is loaded into: like the saver's, or not (another KV mode, fewer
    sequences, another cache type)."""

    unified: bool
    n_seq: int = N_SEQ
    type_kv: str = "f32"


def _params(t: Target) -> kvtool.ContextParams:
    return kvtool.ContextParams(
        n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=t.n_seq, kv_unified=t.unified, type_k=t.type_kv,
        type_v=t.type_kv,
    )  # fmt: skip


def _fill(ctx: kvtool.Context, seed: int) -> None:
    """Three sequences, one sharing cells with another, one with a pending shift where the
    memory can shift positions."""
    rng = np.random.default_rng(seed)
    n_vocab = ctx.model.n_vocab
    kvtool.decode_tokens(ctx, rng.integers(3, n_vocab, 6).tolist(), 0, 0)
    if ctx.memory.can_shift():
        ctx.memory.seq_cp(0, 1, 0, 3)
        kvtool.decode_tokens(ctx, rng.integers(3, n_vocab, 2).tolist(), 1, 3)
        ctx.memory.seq_add(0, 2, -1, 5)
    else:
        kvtool.decode_tokens(ctx, rng.integers(3, n_vocab, 5).tolist(), 1, 0)
    kvtool.decode_tokens(ctx, rng.integers(3, n_vocab, 3).tolist(), 2, 0)


def new_context(model: kvtool.Model, target: Target, seed: int = 1) -> kvtool.Context:
    """A context holding sequences 0..2 (or just 0 when it has fewer than 3)."""
    ctx = kvtool.Context(model, _params(target))
    if target.n_seq >= N_SEQ:
        _fill(ctx, seed)
    else:
        kvtool.decode_tokens(ctx, np.random.default_rng(seed).integers(3, model.n_vocab, 4).tolist(), 0, 0)
    return ctx


def make_sources(archs: list[str] = ARCHS) -> list[Source]:
    out = []
    for arch in archs:
        model = kvtool.Model(TINY / f"tiny-{arch}.gguf")
        for unified in (True, False):
            ctx = new_context(model, Target(unified), seed=0)
            toks = {s: list(range(3, 3 + ctx.memory.seq_pos_max(s) + 1)) for s in range(N_SEQ)}
            sampler = kvtool.Sampler(kvtool.SamplerParams(seed=7, temp=0.8))
            for t in (5, 6, 7):
                sampler.accept(t)
            app = {"chat": {"system": None, "messages": [{"role": "user", "content": "hi"}]}}
            out.append(
                Source(arch, unified, "context", ctx.state_get_data(tokens=toks, sampler=sampler), model)
            )
            out.append(Source(arch, unified, "context", ctx.state_get_data(), model))
            seq_data = ctx.state_seq_get_data(1, tokens=toks[1], sampler=sampler, app=app)
            out.append(Source(arch, unified, "sequence", seq_data, model))
            out.append(Source(arch, unified, "sequence", ctx.state_seq_get_data(0), model))
    return out


# -- the container, per docs/state-format.md (an independent writer, to re-sign mutations) ---


def canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def parse(data: bytes) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """(tensor index, state header, data bytes) of a valid container."""
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + n])
    meta = head.pop("__metadata__")
    return head, json.loads(meta["kvtool.state"]), data[8 + n :]


def sign(index: dict[str, Any], state_json: str, body: bytes) -> bytes:
    """A container with a correct checksum over whatever `index`, `state_json` and `body` say."""

    def header(checksum: str) -> bytes:
        head = dict(index)
        head["__metadata__"] = {"kvtool.state": state_json, "kvtool.checksum": checksum}
        return json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    checksum = hashlib.sha256(header("") + body).hexdigest()
    raw = header(checksum)
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


_ELEM = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U8": 1}
_NP = {
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "U64": np.uint64,
    "I32": np.int32,
    "U8": np.uint8,
}


def rebuild(state: dict[str, Any], tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A well-formed, signed container of `state` and (dtype, shape, bytes) tensors."""
    index, chunks, off = {}, [], 0
    for name in sorted(tensors, key=lambda n: (-_ELEM.get(tensors[n][0], 1), n)):
        dtype, shape, raw = tensors[name]
        index[name] = {"data_offsets": [off, off + len(raw)], "dtype": dtype, "shape": shape}
        chunks.append(raw)
        off += len(raw)
    return sign(index, canonical(state), b"".join(chunks))


def split(data: bytes) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], bytes]]]:
    index, state, body = parse(data)
    tensors = {
        n: (e["dtype"], list(e["shape"]), body[e["data_offsets"][0] : e["data_offsets"][1]])
        for n, e in index.items()
    }
    return state, tensors


# -- mutations ------------------------------------------------------------------------------

HUGE = [2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30]
HOSTILE: list[Any] = [
    *HUGE,
    *[-h for h in HUGE],
    0,
    -1,
    1,
    2,
    3,
    63,
    64,
    65,
    255,
    256,
    1.5,
    -0.0,
    1e308,
    True,
    False,
    None,
    "",
    "x",
    "F16",
    "Q4_0",
    "kv",
    "recurrent",
    "[/x]",
    "\u0000",
    "\udc80" * 0 + "é",
    [],
    [0],
    [-1],
    [2**40],
    [[0, 2, 16, 16]],
    {},
    {"kind": "kv"},
    {"n_swa": 2**40, "kind": "standard"},
]


def _paths(obj: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            yield from _paths(v, (*at, i))


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _hostile_value(rng: random.Random, old: Any) -> Any:
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.5:
        return old + rng.choice([1, -1, 2, -2, 64, -old - 1, 2**31, 2**32, -(2**31), 2**63])
    if rng.random() < 0.05:
        return [[[[[[[[[[0]]]]]]]]]] * 1000
    return copy.deepcopy(rng.choice(HOSTILE))


def mutate_header(rng: random.Random, state: dict[str, Any]) -> str:
    """Sets, removes or duplicates one field of the state header; returns what it did."""
    paths = [p for p in _paths(state) if p]
    path = rng.choice(paths)
    parent, key = _get(state, path[:-1]), path[-1]
    op = rng.random()
    if op < 0.15:
        del parent[key]
        return f"del {path}"
    if op < 0.25 and isinstance(parent[key], list) and parent[key]:
        parent[key].append(copy.deepcopy(parent[key][-1]))
        return f"dup {path}"
    parent[key] = _hostile_value(rng, parent[key])
    return f"set {path}={str(parent[key])[:40]}"


_INT_EXTREMES = {
    "I32": [-(2**31), -1, 0, 1, 63, 64, 2**31 - 1, 2**16],
    "I64": [-(2**63), -2, -1, 0, 1, 2**31, 2**63 - 1],
    "U64": [0, 1, 2**63, 2**64 - 1, 1 << 3, 1 << 40, 7],
    "U8": [0, 255, 1],
}


def mutate_tensors(rng: random.Random, tensors: dict[str, tuple[str, list[int], bytes]]) -> str:
    """Resizes, retypes, drops, adds a tensor, or writes extreme values into one."""
    name = rng.choice(sorted(tensors))
    dtype, shape, raw = tensors[name]
    op = rng.randrange(7)
    if op == 0:
        del tensors[name]
        return f"drop {name}"
    if op == 1:
        tensors[rng.choice([name + "x", "memory.extra", "context.extra", "sampler.extra"])] = (
            dtype,
            shape,
            raw,
        )
        return f"extra copy of {name}"
    if op == 2 and shape:  # one row more or fewer
        row = len(raw) // shape[0] if shape[0] else _ELEM[dtype] * int(np.prod(shape[1:]))
        if rng.random() < 0.5 and shape[0]:
            tensors[name] = (dtype, [shape[0] - 1, *shape[1:]], raw[: len(raw) - row])
        else:
            tensors[name] = (
                dtype,
                [shape[0] + 1, *shape[1:]],
                raw + bytes(rng.randrange(256) for _ in range(row)),
            )
        return f"resize {name}"
    if op == 3:  # the same bytes under another type or shape
        other = rng.choice([d for d in _ELEM if d != dtype])
        n = len(raw) // _ELEM[other]
        tensors[name] = (other, [n], raw[: n * _ELEM[other]])
        return f"retype {name} {other}"
    if op == 4 and len(shape) > 1:
        tensors[name] = (dtype, [shape[0], int(np.prod(shape[1:]))], raw)
        return f"reshape {name}"
    if dtype not in _NP or not raw:
        tensors[name] = (dtype, shape, bytes(b ^ 0xFF for b in raw))
        return f"invert {name}"
    a = np.frombuffer(raw, dtype=_NP[dtype]).copy()
    k = rng.randrange(1, min(len(a), 4) + 1)
    where = [rng.randrange(len(a)) for _ in range(k)]
    if dtype in ("F32", "F16"):
        a[where] = rng.choice([np.nan, np.inf, -np.inf, 1e30, 0.0])
    else:
        a[where] = rng.choice(_INT_EXTREMES[dtype])
    tensors[name] = (dtype, shape, a.tobytes())
    return f"values {name}[{where}]"


def mutate_index(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A re-signed container whose tensor index lies (sizes, offsets, dtypes, extra keys)."""
    index, state, body = parse(data)
    name = rng.choice(sorted(index))
    e = index[name]
    op = rng.randrange(8)
    if op == 0:
        e["shape"] = [2**32, 2**32, *e["shape"][1:]]  # wraps to 0 elements in int64
    elif op == 1:
        e["shape"] = [rng.choice(HUGE), *e["shape"][1:]]
    elif op == 2:
        e["shape"] = rng.choice([[-1], [1.5], ["2"], None, 7, [True], [[2]]])
    elif op == 3:
        e["data_offsets"] = rng.choice([[0, 2**64], [-8, 0], [0], None, [0.0, 4.0], [2**63, 2**63 + 4]])
    elif op == 4:
        e["dtype"] = rng.choice(["Q4_0", "F64", "", None, 3, "f32", "BOOL"])
    elif op == 5:
        e["extra"] = 1
    elif op == 6:
        index[name] = rng.choice([None, [], "x", 0])
    else:
        n = 2**61
        index["memory.huge"] = {"data_offsets": [0, 0], "dtype": "U8", "shape": [n, n, n]}
    return sign(index, canonical(state), body), f"index {name} op{op}"


def boundaries(data: bytes) -> list[int]:
    """Every section boundary of a container: length field, header, each tensor's bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    index, _, _ = parse(data)
    cuts = {0, 4, 8, 8 + n, len(data)}
    for e in index.values():
        cuts |= {8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1]}
    return sorted(c for c in cuts if c < len(data))


def mutate_raw(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    op = rng.randrange(7)
    if op == 0:
        c = rng.choice(boundaries(data))
        c = max(0, c + rng.choice([-1, 0, 0, 1]))
        return data[:c], f"truncate at boundary {c}"
    if op == 1:
        c = rng.randrange(len(data))
        return data[:c], f"truncate at {c}"
    if op == 2:
        b = bytearray(data)
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), "bit flips"
    if op == 3:
        i = rng.randrange(len(data))
        return data[:i] + data[i + rng.randrange(1, 16) :], f"cut bytes at {i}"
    if op == 4:
        return data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), "appended bytes"
    if op == 5:
        n = rng.choice([0, 1, 7, 8, 16, len(data), len(data) - 8, 2**32, 2**63, 2**64 - 8, 64 << 20])
        return struct.pack("<Q", n) + data[8:], f"header length {n}"
    nest = rng.choice([100_000, 1_000_000])
    head = b'{"a":' + b"[" * nest + b"]" * nest + b"}"
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, f"nested header {nest}"


@dataclass
class Case:
    source: Source
    data: bytes
    what: str
    seq: int | None  # None: whole-context load
    target: Target


def cases(sources: list[Source], seed: int) -> Iterator[Case]:
    """An endless, seeded stream of mutated states."""
    rng = random.Random(seed)
    while True:
        src = rng.choice(sources)
        kind = rng.random()
        if kind < 0.35:
            data, what = mutate_raw(rng, src.data)
        elif kind < 0.5:
            data, what = mutate_index(rng, src.data)
        else:
            state, tensors = split(src.data)
            whats = []
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                if rng.random() < 0.55:
                    whats.append(mutate_header(rng, state))
                else:
                    whats.append(mutate_tensors(rng, tensors))
            try:
                data = rebuild(state, tensors)
            except (TypeError, ValueError):  # not JSON any more (a NaN...): sign the raw text
                continue
            what = "; ".join(whats)
        seq = None if src.kind == "context" else 1
        r = rng.random()
        if r < 0.05:
            seq = rng.choice([-1, N_SEQ, 64, 2**40, 0, 2])
        elif r < 0.08:
            seq = None if seq is not None else 0
        target = Target(src.unified)
        if rng.random() < 0.2:
            target = rng.choice(
                [
                    Target(not src.unified),
                    Target(src.unified, 1),
                    Target(src.unified, 2),
                    Target(src.unified, N_SEQ, "f16"),
                ]
            )
        yield Case(src, data, what, seq, target)


# -- the invariant --------------------------------------------------------------------------


def _walk(obj: Any, out: list[Any], seen: set[int]) -> None:
    """Every array, tensor and number reachable from a memory object (its whole state)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach().clone())
    elif isinstance(obj, np.ndarray):
        out.append(obj.copy())
    elif isinstance(obj, int | float | str | bool) or obj is None:
        out.append(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            out.append(k)
            _walk(obj[k], out, seen)
    elif isinstance(obj, list | tuple):
        out.append(len(obj))
        for v in obj:
            _walk(v, out, seen)
    elif type(obj).__module__.startswith("kvtool.memory"):
        for k, v in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else []:
            out.append(k)
            _walk(v, out, seen)


def snapshot(ctx: kvtool.Context) -> list[Any]:
    out: list[Any] = [ctx.logits().clone()]
    _walk(ctx.memory, out, set())
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape or not torch.equal(x, y):
                if not (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())):
                    return False
                if not torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)):
                    return False
        elif isinstance(x, np.ndarray):
            if not isinstance(y, np.ndarray) or not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                return False
        elif x != y:
            return False
    return True


class Timeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Timeout("no answer within the time limit")


@dataclass
class Finding:
    case: Case
    problem: str

    def line(self) -> str:
        c, src = self.case, self.case.source
        into = f"{c.target.unified:d}/{c.target.n_seq}/{c.target.type_kv}"
        return f"{src.arch} kvu={src.unified:d} {src.kind} into {into} seq={c.seq} [{c.what}]: {self.problem}"


@dataclass
class Live:
    """One live context per (model, mode), restored from its pristine state after each
    successful load."""

    contexts: dict[tuple[str, Target], tuple[kvtool.Context, bytes]] = field(default_factory=dict)

    def get(self, case: Case) -> kvtool.Context:
        key = (case.source.arch, case.target)
        if key not in self.contexts:
            ctx = new_context(case.source.model, case.target, seed=1)
            self.contexts[key] = (ctx, ctx.state_get_data())
        return self.contexts[key][0]

    def reset(self, case: Case) -> None:
        ctx, pristine = self.contexts[(case.source.arch, case.target)]
        ctx.state_set_data(pristine)


def check_api(case: Case, live: Live, limit_s: float = 10.0) -> Finding | None:
    """Loads one case through the public API and checks the invariant."""
    ctx = live.get(case)
    before = snapshot(ctx)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        try:
            if case.seq is None:
                info = ctx.state_set_data(case.data)
            else:
                info = ctx.state_seq_set_data(case.data, case.seq)
        except KvtoolError as e:
            if "\n" in str(e) or not str(e):
                return Finding(case, f"error is not one line: {str(e)!r}")
            if not same(before, snapshot(ctx)):
                return Finding(case, f"refused ({e}) but the context changed")
            return None
        # Loaded: the state was consistent, so the context must go on working.
        held = [s for s in range(case.target.n_seq) if ctx.memory.seq_pos_max(s) >= 0]
        try:
            info.tokens()
            if held:
                s = held[-1]
                kvtool.decode_tokens(ctx, [4], s, ctx.memory.seq_pos_max(s) + 1)
        except KvtoolError:
            pass
        live.reset(case)
        return None
    except Timeout:
        return Finding(case, "hang (no answer within the time limit)")
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return Finding(case, f"{type(e).__name__}: {str(e)[:120]} at {Path(tb.filename).name}:{tb.lineno}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_api(
    sources: list[Source], seed: int, n: int, on_case: Callable[[int], None] | None = None
) -> list[Finding]:
    live, found = Live(), []
    for i, case in enumerate(cases(sources, seed)):
        if i >= n:
            break
        f = check_api(case, live)
        if f is not None:
            found.append(f)
            try:  # a finding may have left the context in any state
                live.reset(case)
            except Exception:
                del live.contexts[(case.source.arch, case.target)]
        if on_case is not None:
            on_case(i)
    return found


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the bounded CI run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources() -> list[Source]:
    return make_sources()


@pytest.mark.parametrize("seed", [0])
def test_state_fuzz_api(sources: list[Source], seed: int) -> None:
    rss = peak_rss_mb()
    found = run_api(sources, seed, 250)
    assert not found, "\n".join(f.line() for f in found[:20])
    # a load allocates what the file justifies: a few KiB states, so the peak barely moves
    assert peak_rss_mb() - rss < 512


# -- through the CLI: `kvtool state load`, `state inspect`, chat `/load` ----------------------


def cli_state_cases(sources: list[Source], seed: int) -> Iterator[tuple[list[str], str, Case]]:
    """(argv with FILE for the state's path, chat stdin or "", the case) for the CLI."""
    for case in cases(sources, seed):
        src = case.source
        model = str(TINY / f"tiny-{src.arch}.gguf")
        r = random.Random(len(case.data) ^ seed)
        verb = r.random()
        if src.kind == "sequence" and verb < 0.3:
            argv = ["run", "-m", model, "-c", "128", "-n", "2", "--no-progress", "--no-chat"]
            yield argv, "/load FILE\nhello\n/exit\n", case
        elif verb < 0.45:
            yield ["state", "inspect", "FILE"], "", case
        else:
            seq = [] if case.seq is None or r.random() < 0.5 else ["--seq", str(case.seq)]
            yield ["state", "load", "-m", model, "-i", "FILE", "-n", "2", "-c", "128", *seq], "", case


def run_cli(sources: list[Source], seed: int, n: int, worker: Any, folder: Path) -> list[str]:
    """Runs `n` CLI cases; returns the problems found (one line each)."""
    from tests.fuzz.test_cli_fuzz import problem

    found = []
    for i, (argv, stdin, case) in enumerate(cli_state_cases(sources, seed)):
        if i >= n:
            break
        path = folder / f"case{i % 4}.kvs"
        path.write_bytes(case.data)
        argv = [str(path) if a == "FILE" else a for a in argv]
        res = worker.run(argv, stdin.replace("FILE", str(path)), timeout=30.0)
        p = problem(res)
        if p is None and stdin and res["rc"] != 0:
            p = f"a failed /load ended the chat (exit {res['rc']})"
        if p is not None:
            found.append(f"{' '.join(argv[:2])} [{case.what}] {case.source.arch} {case.source.kind}: {p}")
    return found


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    from tests.fuzz.test_cli_fuzz import Worker

    w = Worker()
    yield w
    w.close()


def test_state_fuzz_cli(sources: list[Source], worker: Any, tmp_path: Path) -> None:
    found = run_cli([s for s in sources if s.arch in ("llama", "lfm2")], 0, 30, worker, tmp_path)
    assert not found, "\n".join(found[:20])


# -- what the fuzzer found: each a regular test (each failed before its fix) -------------------


@pytest.fixture(scope="module")
def llama() -> kvtool.Model:
    return kvtool.Model(TINY / "tiny-llama.gguf")


@pytest.fixture
def ctx(llama: kvtool.Model) -> kvtool.Context:
    return new_context(llama, Target(unified=True))


def refused(ctx: kvtool.Context, data: bytes, seq: int | None = None) -> str:
    """Loads `data`, which must fail with one line and leave the context as it was."""
    before = snapshot(ctx)
    with pytest.raises(KvtoolError) as e:
        ctx.state_set_data(data) if seq is None else ctx.state_seq_set_data(data, seq)
    assert "\n" not in str(e.value)
    assert same(before, snapshot(ctx))
    return str(e.value)


def edited(data: bytes, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> bytes:
    """The state re-signed after `edit(state, tensors)`."""
    state, tensors = split(data)
    edit(state, tensors)
    return rebuild(state, tensors)


def test_deeply_nested_header_is_refused(ctx: kvtool.Context) -> None:
    head = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    head += b" " * (-len(head) % 8)
    assert "unreadable header" in refused(ctx, struct.pack("<Q", len(head)) + head)
    with pytest.raises(KvtoolError):
        kvtool.inspect_state(struct.pack("<Q", len(head)) + head)


def test_nan_in_header_is_refused(ctx: kvtool.Context) -> None:
    index, state, body = parse(ctx.state_get_data())
    text = canonical(state).replace('"n_outputs":1', '"n_outputs":NaN')
    assert "NaN" in text
    assert "altered" in refused(ctx, sign(index, text, body))


def test_shape_beyond_64_bits_is_refused(ctx: kvtool.Context) -> None:
    index, state, body = parse(ctx.state_get_data())
    index["memory.cell"]["shape"] = [2**64]
    assert "bad tensor entry" in refused(ctx, sign(index, canonical(state), body))


def test_shape_whose_size_wraps_in_64_bits_is_refused(ctx: kvtool.Context, llama: kvtool.Model) -> None:
    """2**57 logits rows of 384 floats: the element count wraps to 0 in int64, so the tensor
    claimed no bytes and the loader allocated its full shape."""
    rows = 2**57
    assert (rows * llama.n_vocab) % 2**64 == 0

    def wrap(state: dict[str, Any], tensors: dict[str, Any]) -> None:
        state["n_outputs"] = rows
        tensors["context.logits"] = ("F32", [rows, llama.n_vocab], b"")  # no bytes: 0 elements?

    assert "bad tensor entry" in refused(ctx, edited(ctx.state_get_data(), wrap))


def test_token_list_of_another_type_is_refused(ctx: kvtool.Context) -> None:
    data = edited(ctx.state_get_data(), lambda s, t: s["seqs"][0].update(tokens=5))
    assert "token ids" in refused(ctx, data)
    with pytest.raises(KvtoolError):
        kvtool.inspect_state(data)


def test_token_ids_beyond_the_vocabulary_are_refused(ctx: kvtool.Context, llama: kvtool.Model) -> None:
    data = ctx.state_seq_get_data(0, tokens=[3, 4, 5, 6, 7, llama.n_vocab])
    assert "vocabulary" in refused(ctx, data, 2)


def test_sampler_seed_beyond_the_generator_is_refused(ctx: kvtool.Context) -> None:
    sampler = kvtool.Sampler(kvtool.SamplerParams(seed=3))
    data = edited(ctx.state_get_data(sampler=sampler), lambda s, t: s["sampler"].update(seed=2**70))
    assert "sampler" in refused(ctx, data)


def test_sampler_random_state_torch_refuses_is_refused(ctx: kvtool.Context) -> None:
    sampler = kvtool.Sampler(kvtool.SamplerParams(seed=3))

    def zero_rng(s: dict[str, Any], t: dict[str, Any]) -> None:
        dtype, shape, raw = t["sampler.rng"]
        t["sampler.rng"] = (dtype, shape, bytes(len(raw)))  # an all-zero mt19937 state

    data = edited(ctx.state_get_data(sampler=sampler), zero_rng)
    assert "sampler" in refused(ctx, data)
    with pytest.raises(KvtoolError):
        kvtool.inspect_state(data)


def test_messages_quote_file_text_on_one_line(ctx: kvtool.Context) -> None:
    data = edited(ctx.state_get_data(), lambda s, t: s["model"].update(name="evil\nname", arch="x\ny"))
    assert "evil\\nname" in refused(ctx, data)
    data = edited(ctx.state_get_data(), lambda s, t: s["memory"].update(kind="k\nv"))
    assert "k\\nv" in refused(ctx, data)


@pytest.mark.parametrize(
    "memory",
    [
        {"kind": "x", "parts": [1]},
        {"kind": "kv", "swa": 5},
        {"kind": "kv", "layers": 7},
        {"kind": "x", "parts": {"a": 5}},
    ],
)
def test_inspect_shows_any_memory_layout(
    ctx: kvtool.Context, worker: Any, tmp_path: Path, memory: dict[str, Any]
) -> None:
    """`state inspect` reads no model: it shows whatever layout a file holds, never crashes on it."""
    from tests.fuzz.test_cli_fuzz import problem

    path = tmp_path / "s.kvs"
    path.write_bytes(edited(ctx.state_get_data(), lambda s, t: s.update(memory=memory)))
    res = worker.run(["state", "inspect", str(path)])
    assert problem(res) is None and res["rc"] == 0, res
    assert "memory:" in res["out"]
    assert refused(ctx, path.read_bytes())


def test_a_pipe_or_device_is_not_read_as_a_state(ctx: kvtool.Context, tmp_path: Path) -> None:
    """A FIFO (or /dev/zero) never ends, or ends anywhere: only regular files are read. Here a
    FIFO holds a valid state, which was loaded before."""
    import os
    import threading

    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    data = ctx.state_get_data()

    def feed() -> None:
        try:
            with open(fifo, "wb") as f:
                f.write(data)
        except OSError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    before = snapshot(ctx)
    with pytest.raises(KvtoolError, match="not a regular file"):
        ctx.state_load_file(fifo)
    with pytest.raises(KvtoolError, match="not a regular file"):
        kvtool.inspect_state(Path("/dev/zero"))
    assert same(before, snapshot(ctx))
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # lets the writer's open return
    writer.join(timeout=5)


def _poison(name: str, value: float) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    def edit(state: dict[str, Any], tensors: dict[str, Any]) -> None:
        dtype, shape, raw = tensors[name]
        a = np.frombuffer(raw, dtype=_NP[dtype]).copy()
        a[len(a) // 2] = value
        tensors[name] = (dtype, shape, a.tobytes())

    return edit


@pytest.mark.parametrize(
    ("arch", "tensor", "value"),
    [
        ("llama", "memory.k.1", np.nan),
        ("gemma3", "memory.swa.v.0", np.inf),
        ("mamba", "memory.ssm.0", np.nan),
        ("granitehybrid", "memory.recurrent.conv.0", -np.inf),
        ("llama", "context.logits", np.nan),
    ],
)
def test_non_finite_values_are_refused(arch: str, tensor: str, value: float) -> None:
    """No decode leaves NaN or infinity in K/V rows, recurrent states or logits; a state that
    holds them would poison every later logit (the sampler then has no candidate)."""
    model = kvtool.Model(TINY / f"tiny-{arch}.gguf")
    ctx = new_context(model, Target(unified=True))
    assert "NaN or infinite" in refused(ctx, edited(ctx.state_get_data(), _poison(tensor, value)))
