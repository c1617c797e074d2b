"""The dependency rule, read from the sources: commands -> kvtool's public API -> kernels.
The engine imports no CLI or HTTP library; a verb imports `kvtool` itself and other verbs'
code under `kvtool.commands`, never an engine module (`kvtool.context`, `kvtool.memory`...)."""

from __future__ import annotations

import ast
import re
import sys
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


def from_imports(path: Path) -> list[str]:
    """`from a import b` as "a.b" (b may be a module: `from kvtool import kernels`)."""
    return [
        f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        for a in node.names
    ]


def test_the_engine_imports_no_cli_or_http_library() -> None:
    bad = [
        (str(p.relative_to(ROOT)), name)
        for p in sorted((ROOT / "kvtool").rglob("*.py"))
        for name in imports(p)
        if name.split(".")[0] in UI_OR_NET
    ]
    assert bad == []


def test_commands_use_only_the_public_api() -> None:
    """Commands use the public API and the common layer, never an engine module."""
    bad = [
        (str(p.relative_to(ROOT)), name)
        for p in sorted((ROOT / "commands").rglob("*.py"))
        for name in imports(p)
        if name.startswith("kvtool.") and not name.startswith(("kvtool.commands", "kvtool.common"))
    ]
    assert bad == []


def test_the_engine_does_not_import_the_common_layer() -> None:
    """Dependencies point down: commands -> kvtool.common -> the engine -> kernels. The facade
    (kvtool/__init__.py) names one common function, load_model, which takes a known model's
    name as the design card's API does; it imports nothing at load (names resolve on use)."""
    facade = ROOT / "kvtool" / "__init__.py"
    engine = [
        p
        for p in sorted((ROOT / "kvtool").rglob("*.py"))
        if "common" not in p.relative_to(ROOT).parts and p != facade
    ]
    bad = [
        (str(p.relative_to(ROOT)), name)
        for p in engine
        for name in imports(p)
        if name == "kvtool.common" or name.startswith(("kvtool.common.", "kvtool.commands"))
    ]
    assert bad == []


def test_model_modules_import_no_kernel_module() -> None:
    """The architectures and their building blocks name ops (`self.ops.attend`...): which kernel
    computes an op is the backend's choice (kvtool/backend), made once at model load."""
    bad = [
        (str(p.relative_to(ROOT)), name)
        for p in sorted((ROOT / "kvtool" / "models").rglob("*.py"))
        for name in imports(p) + from_imports(p)
        if name.startswith("kvtool.kernels") or name.split(".")[0] == "kernels"
    ]
    assert bad == []


def memory_attributes(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) read off a context's memory (`x.memory.attr`, or `m.attr` where
    `m = x.memory`): what a command asks of the memory object."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "memory"
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Attribute) and v.attr == "memory") or (
            isinstance(v, ast.Name) and v.id in aliases
        ):
            out.append((node.lineno, node.attr))
    return out


def test_commands_use_only_the_memory_contract() -> None:
    """`ctx.memory` is public as its contract (kvtool.memory.base.Memory: the seq ops, the
    position queries...); its cells and tensors are the engine's (defrag-sim's replay used to
    write them)."""
    from kvtool.memory.base import Memory

    contract = {n for n in dir(Memory) if not n.startswith("_")}
    bad = [
        (str(p.relative_to(ROOT)), line, attr)
        for p in sorted((ROOT / "commands").rglob("*.py"))
        for line, attr in memory_attributes(p)
        if attr not in contract
    ]
    assert bad == []


def test_the_public_api_is_llama_h_sized() -> None:
    """The engine's API is llama.h's concepts (models, contexts, batches, decoding, sampling,
    state, devices, errors): at most 30 names, each resolved from the module that owns it."""
    import kvtool

    assert len(kvtool.__all__) <= 30
    assert sorted(kvtool.__all__) == sorted(kvtool._WHERE)
    assert all(getattr(kvtool, name) is not None for name in kvtool.__all__)
    assert not [
        m for m in kvtool._WHERE.values() if m.startswith("kvtool.common") and m != "kvtool.common.registry"
    ]
    # the map says how many
    said = re.search(
        r"`kvtool/__init__.py` exports \((\d+) names", (ROOT / "docs" / "architecture.md").read_text()
    )
    assert said is not None and int(said.group(1)) == len(kvtool.__all__)


KERNEL_DEPS = ("torch", "numpy", "triton")  # and the standard library


def test_kernels_import_no_engine_module() -> None:
    """The bottom layer: kernels/ imports torch, numpy, triton (guarded, kernels/_triton.py), the
    standard library and other kernels, never the engine, the common layer or the commands."""
    bad = [
        (p.name, name)
        for p in sorted((ROOT / "kernels").rglob("*.py"))
        for name in imports(p)
        if not name.startswith("kvtool.kernels")
        and name.split(".")[0] not in (*KERNEL_DEPS, *sys.stdlib_module_names)
    ]
    assert bad == []


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The engine modules `path` imports when it runs, at the top or inside a function
    (imports under `if TYPE_CHECKING:` never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                name = f"{node.module}.{a.name}"
                out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & known


def _packages(m: str) -> set[str]:
    """The packages Python imports before module `m` (a.b.c: a and a.b)."""
    parts = m.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_engine_has_no_import_cycle() -> None:
    """An import inside a function is still a dependency, and so is the __init__ of every
    package Python enters to reach a module (`kvtool.backend.linear` runs kvtool/backend's
    __init__ first): no engine module depends on itself through others (the facade, which names
    every module, is left out)."""
    paths = {
        _module(p): p
        for p in (ROOT / "kvtool").rglob("*.py")
        if "common" not in p.relative_to(ROOT).parts and p != ROOT / "kvtool" / "__init__.py"
    }
    graph = {}
    for m, p in paths.items():
        deps = _runtime_imports(p, set(paths))
        deps |= {pkg for d in deps for pkg in _packages(d) - _packages(m) if pkg in paths}
        graph[m] = deps - {m}
    cycles = []
    for start in graph:  # a path from a module's imports back to itself
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                cycles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo += graph[m]
    assert cycles == []


_IMPORT_EACH = """
import importlib, sys
bad = []
for m in sys.argv[1:]:
    for k in [k for k in sys.modules if k.split(".")[0] == "kvtool" and not k.startswith("kvtool.kernels")]:
        del sys.modules[k]
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {e!r}")
print("\\n".join(bad))
"""


def test_every_module_imports_first() -> None:
    """Each module of the engine, the common layer and the commands imports on its own, as the
    first kvtool module of a process (the kernels, which import only torch, stay loaded between
    two): an import order that only works when another module came first fails here."""
    import subprocess

    mods = [_module(p) for p in sorted((ROOT / "kvtool").rglob("*.py"))]
    mods += [
        "kvtool.commands" + _module(p).removeprefix("commands")
        for p in sorted((ROOT / "commands").rglob("*.py"))
        if p.name != "__main__.py"  # runs the CLI
    ]
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *mods], capture_output=True, text=True, cwd=ROOT
    )
    assert (out.returncode, out.stderr[-2000:], out.stdout.strip()) == (0, "", "")
