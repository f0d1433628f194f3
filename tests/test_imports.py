"""The layout stays a layered one: every import points down and no module imports itself back.

    bench_longctx -> engine_adapter -> kvstore -> eviction, tiers -> kvcuda

Imports inside functions count too (a lazy import is still a dependency), and so do imports under
`if TYPE_CHECKING:`: an annotation that names a module above, or one that imports this one back, is the
same tangle even if Python never loads it. No module is loaded by name (importlib), so this walk sees
every arrow, the `kvtier` command's included.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"bench_longctx": 3, "engine_adapter": 2, "kvstore": 1, "eviction": 0, "tiers": 0, "kvcuda": -1}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in LAYERS for p in (REPO / package).rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports (the longest known module name each import names)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_every_import_points_down() -> None:
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            src, dst = module.split(".")[0], target.split(".")[0]
            if src != dst and LAYERS[dst] >= LAYERS[src]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    graph = _graph()
    # A package's __init__ may re-export its submodules: edges from a package to its own children
    # are how Python loads it, not a dependency back.
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_walk_sees_the_tree() -> None:
    """The checks above are only as good as the graph: it must hold the modules and edges we know."""
    graph = _graph()
    assert "kvstore.blocks.tierset" in graph["kvstore.store"] and "tiers.hot" in graph["kvstore.blocks.tier_stack"]
    assert len(graph) > 60


def test_nothing_is_imported_by_name() -> None:
    """importlib.import_module("pkg.mod") hides an arrow from the walk above: the CLI imports its commands."""
    hidden = [str(p.relative_to(REPO)) for p in _modules().values() if "import_module(" in p.read_text(encoding="utf-8")]
    assert not hidden, f"modules loaded by name: {hidden}"
