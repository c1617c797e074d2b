"""The writer of every file a tool saves (plots, traces, summaries, conversations): atomic,
regular files only, never over a file of another kind, never over another process's newer
version when the tool names the one it has (`FileVersion`). The engine's own state files go
through the same writer; this is where the tools reach it (STATE_FILE: their kind)."""

from __future__ import annotations

from kvtool.atomic_file import FileChanged, FileKind, FileVersion, atomic_write, check_writable, write_file


def __getattr__(name: str) -> FileKind:
    """STATE_FILE on first use: kvtool.state imports torch, which `--help` and a missing model
    must not wait for."""
    if name == "STATE_FILE":
        from kvtool.state.files import STATE_FILE

        return STATE_FILE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FileChanged",
    "FileKind",
    "FileVersion",
    "atomic_write",
    "check_writable",
    "write_file",
]
