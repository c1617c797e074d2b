"""Whole states: a context's (every sequence + the last logits) or one sequence's, to bytes and
back. `Context.state_*` delegate here; a load validates everything before it changes anything."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtool.errors import StateError
from kvtool.state import sampler_state
from kvtool.state.container import FORMAT, VERSION, Array, RawTensor, read_container, write_container
from kvtool.state.header import StateInfo, check_model, check_tokens, model_identity, parse_seqs
from kvtool.state.io import StateReader, StateWriter

if TYPE_CHECKING:
    from kvtool.memory.base import Memory
    from kvtool.model import Model
    from kvtool.sampling import Sampler

Tokens = Mapping[int, Sequence[int]] | Sequence[int] | None
BLOB = "app."  # the tensors of the application's blobs


@dataclass
class Loaded:
    """A committed load: what the state held, and (context states) the logits to put back."""

    info: StateInfo
    logits: torch.Tensor | None
    out_row: np.ndarray | None


def _seq_tokens(tokens: Tokens, seqs: list[int]) -> dict[int, list[int]]:
    if tokens is None:
        return {}
    if isinstance(tokens, Mapping):
        return {int(s): [int(t) for t in ts] for s, ts in tokens.items()}
    if len(seqs) != 1:
        raise StateError("a plain token list needs a state of exactly one sequence (give a dict seq -> ids)")
    return {seqs[0]: [int(t) for t in tokens]}


def encode(
    model: Model,
    memory: Memory,
    seq: int | None,
    tokens: Tokens = None,
    sampler: Sampler | None = None,
    app: Mapping[str, Any] | None = None,
    logits: torch.Tensor | None = None,
    out_row: np.ndarray | None = None,
    blobs: Mapping[str, bytes] | None = None,
) -> bytes:
    """The container of a context state (seq None) or of sequence `seq`; `blobs` are stored
    as they are, as U8 tensors `app.<name>`."""
    w = StateWriter()
    memory.state_write(w, seq)
    layout, tensors, counts = w.layout, w.tensors, w.counts
    present = sorted(counts) if seq is None else [seq]
    toks = _seq_tokens(tokens, present)
    seqs = [
        {
            "seq_id": s,
            "n_cells": counts.get(s, 0),
            "pos_min": int(memory.seq_pos_min(s)),
            "pos_max": int(memory.seq_pos_max(s)),
            "tokens": toks.get(s),
        }
        for s in present
    ]
    out: dict[str, Array] = dict(tensors)
    for name, blob in (blobs or {}).items():
        if not name or not blob:
            raise StateError("a state's blob needs a name and at least one byte")
        out[f"{BLOB}{name}"] = np.frombuffer(blob, dtype=np.uint8)
    n_outputs = 0
    if seq is None and logits is not None and out_row is not None:
        out["context.logits"] = logits.detach().to("cpu", torch.float32).contiguous()
        out["context.out_row"] = np.asarray(out_row, dtype=np.int64)
        n_outputs = int(logits.shape[0])
    samp = None
    if sampler is not None:
        samp, rng = sampler_state.capture(sampler)
        out["sampler.rng"] = rng
    state = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "context" if seq is None else "sequence",
        "model": model_identity(model),
        "memory": layout,
        "seqs": seqs,
        "n_outputs": n_outputs,
        "sampler": samp,
        "app": None if app is None else dict(app),
    }
    return write_container(state, out)


def _info(state: dict[str, Any], tensors: dict[str, RawTensor], n_bytes: int) -> StateInfo:
    try:
        kind, n_outputs, samp, app = state["kind"], state["n_outputs"], state["sampler"], state["app"]
        memory, model = state["memory"], state["model"]
    except KeyError:
        raise StateError("corrupted state: bad header fields") from None
    ok = (
        kind in ("context", "sequence")
        and isinstance(n_outputs, int)
        and not isinstance(n_outputs, bool)
        and n_outputs >= 0
        and (kind == "context" or n_outputs == 0)
        and isinstance(memory, dict)
        and isinstance(model, dict)
        and (app is None or isinstance(app, dict))
    )
    if not ok:  # not asserts: user input is checked under python -O too
        raise StateError("corrupted state: bad header fields")
    rng = tensors.get("sampler.rng")
    blobs = {n[len(BLOB) :]: t for n, t in tensors.items() if n.startswith(BLOB)}
    if any(t.dtype != "U8" or len(t.shape) != 1 for t in blobs.values()):
        raise StateError("corrupted state: a blob is not a U8 vector")
    if samp is not None:
        sampler_state.check(samp, b"" if rng is None else bytes(rng.data))
    sizes: dict[str, int] = {}
    for name, t in tensors.items():
        group = "kv" if name.startswith("memory.") else name.split(".")[0]
        sizes[group] = sizes.get(group, 0) + len(t.data)
    return StateInfo(
        kind=kind,
        version=state["version"],
        model=model,
        memory=memory,
        seqs=parse_seqs(state.get("seqs")),
        n_outputs=n_outputs,
        sampler=samp,
        app=app,
        n_bytes=n_bytes,
        tensor_bytes=sizes,
        sampler_rng=None if rng is None else bytes(rng.data),
        blobs={n: bytes(t.data) for n, t in blobs.items()},
    )


def inspect(data: bytes | memoryview) -> StateInfo:
    """Reads and verifies a state (format, version, checksum) without a model."""
    state, tensors = read_container(data)
    return _info(state, tensors, len(data))


def _logits(info: StateInfo, tensors: dict[str, RawTensor], n_vocab: int) -> tuple[torch.Tensor, np.ndarray]:
    lg, rows = tensors.pop("context.logits", None), tensors.pop("context.out_row", None)
    n = info.n_outputs
    if n == 0 and lg is None and rows is None:
        return torch.empty(0, n_vocab), np.zeros(0, dtype=np.int64)
    if lg is None or rows is None or lg.dtype != "F32" or lg.shape != (n, n_vocab):
        raise StateError("corrupted state: bad logits")
    if rows.dtype != "I64" or len(rows.shape) != 1:
        raise StateError("corrupted state: bad output rows")
    out_row = rows.numpy()
    if ((out_row < -1) | (out_row >= n)).any():
        raise StateError("corrupted state: bad output rows")
    logits = lg.torch()
    if not bool(logits.isfinite().all()):  # a decode never leaves these; a sampler cannot use them
        raise StateError("corrupted state: the logits hold NaN or infinite values")
    return logits, out_row


def decode(model: Model, memory: Memory, data: bytes | memoryview, seq: int | None) -> Loaded:
    """Validates a state against the model and memory, then restores it (seq None: the whole
    context, replacing every sequence; else the saved sequence becomes `seq`, replacing it).
    On any error nothing has changed."""
    state, tensors = read_container(data)
    info = _info(state, tensors, len(data))
    if seq is None and info.kind != "context":
        raise StateError("this is a sequence state: load it into a sequence (give a sequence id)")
    if seq is not None and info.kind != "sequence":
        raise StateError("this is a whole-context state: load it without a sequence id")
    check_model(info.model, model, info.version)
    check_tokens(info, model.n_vocab)
    pool = {n: t for n, t in tensors.items() if not n.startswith(BLOB)}
    pool.pop("sampler.rng", None)
    logits, out_row = _logits(info, pool, model.n_vocab) if seq is None else (None, None)
    commit = memory.state_read(StateReader(info.memory, pool), seq)
    if pool:
        raise StateError(f"corrupted state: unexpected tensors {sorted(pool)[:3]}")
    commit()
    return Loaded(info, logits, out_row)
