"""The state header: model identity, per-sequence summary, and what a reader gets back."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.errors import StateError
from kvtool.state.container import canonical, shown

if TYPE_CHECKING:
    from kvtool.model import Model
    from kvtool.sampling import Sampler


_SAMPLE = 64 << 10


def sampled_content_hash(path: Path) -> str:
    """Version 2's model.content: SHA-256 of the file size, its first and its last 64 KiB (what a
    version-2 state is checked against; it misses weights that differ in between)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        f.seek(max(0, size - _SAMPLE))
        h.update(f.read(_SAMPLE))
    return h.hexdigest()[:32]


def plain(obj: object) -> Any:
    """`obj` as JSON values (hyper-parameters may hold numpy scalars, tuples or sets)."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted(plain(v) for v in obj)
    if isinstance(obj, np.ndarray | np.generic):
        return plain(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return plain(dataclasses.asdict(obj))
    return str(obj)


def model_identity(model: Model) -> dict[str, Any]:
    """What a state records of the model it was made with."""
    return {
        "arch": model.arch,
        "name": model.name,
        "path": str(model.path.resolve()),  # where it was loaded from: a reader may load it again
        "fingerprint": model.fingerprint,
        "content": model.file.content_hash(),  # every byte: weights that differ anywhere differ
        "n_vocab": model.n_vocab,
        "hparams": plain(dataclasses.asdict(model.hparams)),
    }


def check_model(saved: dict[str, Any], model: Model, version: int) -> None:
    """Refuses a state made with another model (checks identity and shared hyper-parameters);
    a version-2 state's content hash is compared with version 2's sampled one."""
    try:
        mine = model_identity(model)
        if version == 2:
            mine["content"] = sampled_content_hash(model.path)
        same = all(saved[k] == mine[k] for k in ("arch", "fingerprint", "content", "n_vocab"))
        hp = saved["hparams"]
        if not isinstance(saved, dict) or not isinstance(hp, dict):
            raise TypeError("model")
        same = same and all(canonical(hp[k]) == canonical(v) for k, v in mine["hparams"].items() if k in hp)
    except (KeyError, TypeError):
        raise StateError("corrupted state: bad model section") from None
    if not same:
        raise StateError(
            f"state was saved with another model ({shown(saved.get('name'))}, {shown(saved.get('arch'))}, "
            f"fingerprint {shown(saved.get('fingerprint'), 12)}), not {model.name} "
            f"({model.arch}, fingerprint {mine['fingerprint'][:12]})"
        )


@dataclass(frozen=True)
class SeqInfo:
    """One saved sequence: its cells, positions and (if the saver gave them) token ids."""

    seq_id: int
    n_cells: int
    pos_min: int
    pos_max: int
    tokens: list[int] | None


@dataclass(frozen=True)
class StateInfo:
    """What a state holds (returned by the load calls and by `inspect_state`).

    kind: "context" (every sequence and the last logits) or "sequence" (one sequence).
    memory: the memory layout it was saved from; app: what the application stored
    (a chat keeps its messages there), blobs: its bytes (a server's slot keeps its checkpoints
    there); sampler: seed, parameters and history, if saved."""

    kind: str
    version: int
    model: dict[str, Any]
    memory: dict[str, Any]
    seqs: list[SeqInfo]
    n_outputs: int
    sampler: dict[str, Any] | None
    app: dict[str, Any] | None
    n_bytes: int
    tensor_bytes: dict[str, int]
    sampler_rng: bytes | None = None
    blobs: dict[str, bytes] = field(default_factory=dict)  # the application's binary attachments

    def tokens(self, seq: int | None = None) -> list[int] | None:
        """The token ids saved for `seq` (None: the only sequence of the state)."""
        if seq is None:
            return self.seqs[0].tokens if len(self.seqs) == 1 else None
        return next((s.tokens for s in self.seqs if s.seq_id == seq), None)

    def restore_sampler(self, sampler: Sampler) -> bool:
        """Puts the saved random state and penalty history into `sampler`; False if none saved."""
        from kvtool.state.sampler_state import restore

        if self.sampler is None or self.sampler_rng is None:
            return False
        restore(sampler, self.sampler, self.sampler_rng)
        return True


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_seqs(raw: object) -> list[SeqInfo]:
    """The header's sequence list, every field checked (ids in 0..63, each once)."""
    if not isinstance(raw, list):
        raise StateError("corrupted state: bad sequence list")
    out = []
    for s in raw:
        if not isinstance(s, dict) or set(s) != {"seq_id", "n_cells", "pos_min", "pos_max", "tokens"}:
            raise StateError("corrupted state: bad sequence list")
        seq_id, n_cells, p0, p1, tokens = s["seq_id"], s["n_cells"], s["pos_min"], s["pos_max"], s["tokens"]
        if not all(_is_int(v) for v in (seq_id, n_cells, p0, p1)):
            raise StateError("corrupted state: bad sequence list")
        if not 0 <= seq_id < 64 or n_cells < 0 or p0 < -1 or p1 < -1 or p1 >= 2**31:
            raise StateError("corrupted state: bad sequence list")
        if tokens is not None and (
            not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens)
        ):
            raise StateError("corrupted state: bad token ids")
        out.append(SeqInfo(seq_id, n_cells, p0, p1, tokens))
    if len({s.seq_id for s in out}) != len(out):
        raise StateError("corrupted state: a sequence is listed twice")
    return out


def check_tokens(info: StateInfo, n_vocab: int) -> None:
    """Refuses token ids (saved sequences, sampler history) that the model has no row for."""
    lists = [s.tokens or [] for s in info.seqs]
    if info.sampler is not None:
        lists.append(info.sampler["history"])
    if any(t >= n_vocab for ts in lists for t in ts):
        raise StateError(f"corrupted state: a token id is beyond the model's vocabulary ({n_vocab})")
