"""Every file a command writes goes through one writer, kvtool/atomic_file.py (docs/commands.md,
Where commands write), read from the sources: no other module opens a file for writing, writes
one with pathlib, or saves a figure or an array to a path. What writes otherwise is listed here
with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRITER = ROOT / "kvtool" / "atomic_file.py"
WRITE_METHODS = {"write_text", "write_bytes", "savefig", "tofile", "mkstemp"}
ARRAY_SAVES = {"np.save", "np.savez", "numpy.save", "numpy.savez", "torch.save"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}

# (file, call): why it is not the atomic writer's
ALLOWED = {
    ("commands/__init__.py", "os.open"): "/dev/null in place of a closed standard stream",
    ("commands/__init__.py", "open"): "that stream's file object over /dev/null",
    (
        "commands/defrag_sim/plot.py",
        "savefig",
    ): "into memory (io.BytesIO): defrag-sim writes the bytes with write_file",
    (
        "kvtool/common/store.py",
        "sqlite3.connect",
    ): "the conversation store: an SQLite database (its own journal)",
    ("kvtool/common/disk_cache.py", "sqlite3.connect"): "the disk cache's index: an SQLite database",
}


def _name(f: ast.expr) -> str:
    """`open`, `os.open`, `x.write_text` -> "write_text" (a method: its name only)."""
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and f.value.id in ("os", "sqlite3", "np", "numpy", "torch"):
            return f"{f.value.id}.{f.attr}"
        return f.attr
    return ""


def _writes(call: ast.Call) -> str | None:
    """The call's name where it may create or change a file, else None."""
    name = _name(call.func)
    if (name == "open" and isinstance(call.func, ast.Name)) or name == "os.fdopen":  # by the mode
        mode = (
            call.args[1]
            if len(call.args) > 1
            else next((k.value for k in call.keywords if k.arg == "mode"), None)
        )
        if (
            isinstance(mode, ast.Constant)
            and isinstance(mode.value, str)
            and not set("wax+") & set(mode.value)
        ):
            return None
        return None if mode is None else name
    if name == "open":  # a method: Path.open(mode), by its mode where it is spelled out
        mode = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "mode"), None)
        writes = (
            isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set("wax+") & set(mode.value)
        )
        return name if writes else None
    if name == "os.open":
        flags = {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)}
        return name if flags & WRITE_FLAGS else None
    if name == "sqlite3.connect" or name in ARRAY_SAVES or name.split(".")[-1] in WRITE_METHODS:
        return name
    return None


def writers() -> set[tuple[str, str]]:
    found = set()
    for top in ("kvtool", "commands"):
        for p in sorted((ROOT / top).rglob("*.py")):
            if p == WRITER:
                continue
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and (name := _writes(node)):
                    found.add((str(p.relative_to(ROOT)), name))
    return found


def test_user_files_are_written_by_the_atomic_writer_only() -> None:
    assert writers() - set(ALLOWED) == set()


def test_every_exception_is_still_there() -> None:
    """An exception that no longer exists is removed from the list, not left to excuse another."""
    assert set(ALLOWED) - writers() == set()
