"""The code's shape, checked: one class per SGLang seam, no import cycle in the plugin, no
private name of one of our files used in another.

These read the source (``ast``), so they run everywhere, SGLang installed or not. A second TP
subclass of a seam class, an import that closes a circle between plugin modules, or a
``group._claim`` read from a kernel file fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ulacache": "ulacache", "patches": "ulacache.patches", "kernels": "ulacache.kernels"}
# SGLang's own private attributes the sizing hook and the rehearsal read or adjust
# (DefaultPoolConfigurator's cell and fixed overhead: sglang/srt/model_executor/
# pool_configurator.py); they are SGLang's names, not ours
SGLANG_PRIVATE = {"_cell_size", "_fixed_overhead_bytes"}
SEAMS = {"HiSparseDSATokenToKVPool": "UlaCacheDSATokenToKVPool",
         "HiSparseTokenToKVPoolAllocator": "UlaCacheTokenToKVPoolAllocator",
         "HiSparseCoordinator": "UlaCacheCoordinator"}


def _files() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p))
            for d in PACKAGES for p in sorted((ROOT / d).rglob("*.py"))}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_one_class_per_sglang_seam():
    """Each HiSparse class SGLang builds has exactly one ulacache stand-in, and nothing
    subclasses a stand-in (the mode is chosen inside, once, not by a second class)."""
    found: dict[str, list[str]] = {}
    for path, tree in _files().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = ast.unparse(base).split(".")[-1]
                    if name in SEAMS or name in SEAMS.values():
                        found.setdefault(name, []).append(f"{_module(path)}.{node.name}")
    assert found == {stock: [f"ulacache.patches.{mod}.{ours}"] for stock, ours, mod in (
        ("HiSparseDSATokenToKVPool", "UlaCacheDSATokenToKVPool", "sglang_pool"),
        ("HiSparseTokenToKVPoolAllocator", "UlaCacheTokenToKVPoolAllocator",
         "sglang_allocator"),
        ("HiSparseCoordinator", "UlaCacheCoordinator", "sglang_coordinator"))}, found


def test_plugin_modules_import_no_circle():
    """Module-level imports between ``ulacache.patches`` modules form no cycle (imports inside
    functions are the plugin's lazy loads of SGLang-dependent code, also listed)."""
    files = _files()
    graph: dict[str, set[str]] = {}
    for path, tree in files.items():
        mod = _module(path)
        if not mod.startswith("ulacache.patches"):
            continue
        deps = graph.setdefault(mod, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.rsplit(".", node.level)[0] if not path.name == "__init__.py" \
                        else mod
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps.update(n for n in names if n in {_module(p) for p in files}
                        and n.startswith("ulacache.patches") and n != mod)
    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        if seen.get(m) == 2:
            return
        assert seen.get(m) != 1, "import circle: " + " -> ".join(stack + [m])
        seen[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, stack + [m])
        seen[m] = 2

    for m in sorted(graph):
        visit(m, [])
    assert "ulacache.patches.sglang_pool" in graph["ulacache.patches.sglang_allocator"]


def test_no_private_name_crosses_a_file():
    """A name starting with one underscore that one of our files defines is used only there:
    no ``x._field`` of another file's object, no ``from .m import _helper``."""
    files = _files()
    defined: dict[str, set[Path]] = {}
    for path, tree in files.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                defined.setdefault(name, set()).add(path)
    crossing = []
    for path, tree in files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in defined and \
                    node.attr not in SGLANG_PRIVATE and \
                    ast.unparse(node.value) not in ("self", "cls") and \
                    path not in defined[node.attr]:
                crossing.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and (node.level or
                                                     (node.module or "").startswith("ulacache")):
                crossing += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}"
                             for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, "\n".join(crossing)
