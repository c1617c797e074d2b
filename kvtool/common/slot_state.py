"""A slot as one kvtool sequence state: what its sequence holds, the token ids of it, and its
context checkpoints (each itself a sequence state, stored as the state's blobs), so that a slot
saved and restored (llama-server's /slots actions, the cache tiers) resumes like the slot it was,
whatever its memory kind. Everything is checked before the slot changes: a file that fails is a
one-line StateError and the slot is as it was."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvtool
from kvtool.common.checkpoints import Checkpoint, SlotCheckpoints

if TYPE_CHECKING:
    from kvtool.common.slots import Slot

APP_KEY = "kvtool.slot"
CHECKPOINT = "checkpoint."  # blob name prefix; the rest is the checkpoint's n_tokens


def encode(ctx: kvtool.Context, slot: Slot) -> bytes:
    """The slot's state: its sequence, the tokens it holds, its checkpoints."""
    return ctx.state_seq_get_data(slot.seq, **with_checkpoints(slot.held, slot.checkpoints))


def with_checkpoints(
    tokens: Sequence[int], cps: SlotCheckpoints, app: dict[str, object] | None = None
) -> dict[str, Any]:
    """The state_seq_get_data arguments that store a sequence's tokens and its checkpoints
    (beside the application's own `app` entries)."""
    blobs = {f"{CHECKPOINT}{c.n_tokens}": c.data for c in cps.items}
    ours = {APP_KEY: {"checkpoint_tokens": list(cps.tokens) if cps.items else []}}
    return {"tokens": list(tokens), "app": {**(app or {}), **ours}, "blobs": blobs}


def _ids(value: object, n_vocab: int, what: str) -> list[int]:
    ok = isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in value
    )
    if not ok:
        raise kvtool.StateError(f"corrupted slot state: bad {what}")
    assert isinstance(value, list)
    return value


def checkpoints_of(info: kvtool.StateInfo, n_vocab: int) -> tuple[list[int], list[Checkpoint]]:
    """The checkpoints a state stored `with_checkpoints` carries (the tokens they are prefixes
    of, and them in order), each verified (checksum, kind, model)."""
    app = (info.app or {}).get(APP_KEY)
    if not isinstance(app, dict):
        raise kvtool.StateError("this sequence state is not a slot's (no 'kvtool.slot' entry)")
    tokens = _ids(app.get("checkpoint_tokens"), n_vocab, "checkpoint tokens")
    items = []
    for name, data in info.blobs.items():
        n = name.removeprefix(CHECKPOINT)
        if not name.startswith(CHECKPOINT) or not n.isdigit() or not 0 < int(n) <= len(tokens):
            raise kvtool.StateError(f"corrupted slot state: unexpected blob {name[:40]!r}")
        cp = kvtool.inspect_state(data)
        seqs = cp.seqs
        if cp.kind != "sequence" or cp.model != info.model or len(seqs) != 1 or seqs[0].pos_max != int(n) - 1:
            raise kvtool.StateError(f"corrupted slot state: checkpoint {n} does not fit")
        items.append(Checkpoint(int(n), data))
    return tokens, sorted(items, key=lambda c: c.n_tokens)


def restore(ctx: kvtool.Context, slot: Slot, data: bytes) -> int:
    """Replaces what the idle slot holds with a slot state (from any slot, any server of the same
    model); returns the number of tokens it holds. Checkpoints beyond what this server keeps are
    dropped (the most recent stay)."""
    info = kvtool.inspect_state(data)
    if info.kind != "sequence" or len(info.seqs) != 1:
        raise kvtool.StateError("a slot state is a sequence state")
    held = _ids(info.tokens(), ctx.model.n_vocab, "token ids (none saved)")
    if len(held) != info.seqs[0].pos_max + 1:
        raise kvtool.StateError("corrupted slot state: the token ids do not match its positions")
    cp_tokens, items = checkpoints_of(info, ctx.model.n_vocab)
    if len(held) >= ctx.n_ctx_seq:
        raise kvtool.StateError(f"the slot state holds {len(held)} tokens; a slot holds {ctx.n_ctx_seq}")
    ctx.state_seq_set_data(data, slot.seq)  # verified again against the model and memory
    slot.checkpoints.put(cp_tokens, items)
    slot.held, slot.lost, slot.source, slot.n_source = held, [], None, 0
    slot.keeps, slot.n_past = bool(held), len(held)
    return len(held)


def erase(ctx: kvtool.Context, slot: Slot) -> int:
    """Empties the idle slot (its sequence and checkpoints); returns the tokens it held."""
    n = len(slot.held)
    ctx.memory.seq_rm(slot.seq, -1, -1)
    slot.checkpoints.clear()
    slot.held, slot.lost, slot.source, slot.n_source, slot.keeps, slot.n_past = [], [], None, 0, False, 0
    return n


def valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename for a slot file: one plain name in the save folder."""
    bad_chars = set('/\\:*?"<>|') | {chr(c) for c in range(32)} | {"\x7f"}
    return (
        0 < len(name.encode()) <= 255
        and not name.startswith(".")
        and not name.endswith((" ", "."))
        and not any(c in bad_chars for c in name)
    )


def write_file(path: Path, data: bytes) -> int:
    """Writes a slot state atomically, over nothing or a state file only; the bytes written."""
    from kvtool.state import files  # torch comes with it: not at import (a verb's --help)

    return files.write_atomic(path, data)


def read_file(path: Path) -> bytes:
    """The bytes of a slot state file (a regular file), or a one-line StateError."""
    from kvtool.state import files

    return files.read_file(path)
