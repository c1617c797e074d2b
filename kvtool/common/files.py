"""The writer of every file a tool saves (plots, traces, summaries, conversations): atomic,
regular files only, never over a file of another kind, never over another process's newer
version when the tool names the one it has (`FileVersion`). The engine's own state files go
through the same writer; this is where the tools reach it (STATE_FILE: their kind)."""

from __future__ import annotations

from kvtool.atomic_file import FileChanged, FileKind, FileVersion, atomic_write, check_writable, write_file
from kvtool.state.files import STATE_FILE

__all__ = [
    "STATE_FILE",
    "FileChanged",
    "FileKind",
    "FileVersion",
    "atomic_write",
    "check_writable",
    "write_file",
]
