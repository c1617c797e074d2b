"""Where a conversation goes when it cannot be saved where it belongs (a full disk, a store
another process keeps locked, a folder that became read-only): a state file in kvtool's folder
of rescued conversations (`$XDG_STATE_HOME/kvtool/rescued`, else the system's temporary
folder), which `kvtool run --session FILE` resumes; where even that cannot be written, the
messages alone as JSON. The caller says where it went."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

from kvtool import KvtoolError
from kvtool.common import files

_JSON = files.FileKind("a rescued conversation", rb"\{")


def folders() -> list[Path]:
    """Where rescued conversations go, in order: the user's state folder, then the system's
    temporary one (often another file system than a full disk)."""
    home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return [Path(home) / "kvtool" / "rescued", Path(tempfile.gettempdir()) / f"kvtool-rescued-{os.getuid()}"]


def name_for(label: str) -> str:
    """A file name (without suffix) for a conversation's rescue: its label, the time, the pid."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", label)[:60] or "conversation"
    return f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def rescue(data: bytes | None, messages: list[dict[str, str]], name: str) -> Path | None:
    """Writes the conversation (its state `data`, else or when None its messages) as `name` in
    the first folder that takes it; returns the file, or None when none does."""
    kinds = [(".json", json.dumps({"messages": messages}, ensure_ascii=False).encode(), _JSON)]
    if data is not None:
        kinds.insert(0, (".kvs", data, files.STATE_FILE))
    for suffix, payload, kind in kinds:
        for folder in folders():
            path = folder / f"{name}{suffix}"
            with contextlib.suppress(KvtoolError, OSError):
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                files.write_file(path, payload, kind)
                return path
    return None
