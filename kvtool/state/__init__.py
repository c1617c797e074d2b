"""State save/load (llama_state_*): containers, per-memory-kind parts, files.

The format is specified in docs/state-format.md. `kvtool.Context.state_*` are the entry
points; this package also offers what needs no context (inspecting a file)."""

from __future__ import annotations

from pathlib import Path

from kvtool.state.codec import inspect
from kvtool.state.files import STATE_FILE, check_state_path, naming, read_file, write_atomic
from kvtool.state.header import SeqInfo, StateInfo


def inspect_state(source: str | Path | bytes) -> StateInfo:
    """Reads and verifies a state (format, version, checksum) without loading a model: a state
    file's path, or the bytes of a state (from `Context.state_get_data`, a store...)."""
    if isinstance(source, bytes):
        return inspect(source)
    data = read_file(source)
    with naming(source):
        return inspect(data)


__all__ = [
    "STATE_FILE",
    "SeqInfo",
    "StateInfo",
    "check_state_path",
    "inspect",
    "inspect_state",
    "naming",
    "read_file",
    "write_atomic",
]
