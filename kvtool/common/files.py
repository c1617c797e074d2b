"""The writer of every file a tool saves (plots, traces, summaries, conversations): atomic,
regular files only, never over a file of another kind. The engine's own state files go
through the same writer; this is where the tools reach it."""

from __future__ import annotations

from kvtool.atomic_file import FileKind, atomic_write, check_writable, write_file

__all__ = ["FileKind", "atomic_write", "check_writable", "write_file"]
