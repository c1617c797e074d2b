"""The dependency rule, read from the sources: commands -> kvtool's public API -> kernels.
The engine imports no CLI or HTTP library; a verb imports `kvtool` itself and other verbs'
code under `kvtool.commands`, never an engine module (`kvtool.context`, `kvtool.memory`...)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UI_OR_NET = ("rich", "typer", "click", "http", "urllib", "requests", "httpx", "aiohttp")


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_the_engine_imports_no_cli_or_http_library() -> None:
    bad = [
        (str(p.relative_to(ROOT)), name)
        for p in sorted((ROOT / "kvtool").rglob("*.py"))
        for name in imports(p)
        if name.split(".")[0] in UI_OR_NET
    ]
    assert bad == []


def test_commands_use_only_the_public_api() -> None:
    bad = [
        (str(p.relative_to(ROOT)), name)
        for p in sorted((ROOT / "commands").rglob("*.py"))
        for name in imports(p)
        if name.startswith("kvtool.") and not name.startswith("kvtool.commands")
    ]
    assert bad == []
