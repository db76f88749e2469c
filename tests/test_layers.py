"""The package's layers, read from its own imports: the direction is written down here and checked.

Every import counts, those inside functions and ``TYPE_CHECKING`` blocks too. A module stands
one level above the highest module it imports; the README's "Inside the daemon" draws the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dispatcher"

#: top to bottom; a module may import its own layer and the layers below it, never one above
LAYERS: list[tuple[str, ...]] = [
    ("__main__", "cli", "web"),
    ("core",),
    ("ops", "query"),
    ("job",),
    ("store", "checks", "ledger"),
    ("spec",),
    ("<foundation>",),
]
MAX_LEVELS = 12


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [n.name for n in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                targets = [f"{base}.{n.name}" if f"{base}.{n.name}" in files else base for n in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != mod and target != "dispatcher":
                    graph[mod].add(target)
    return graph


def _layer(mod: str) -> int:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "<foundation>"
    if len(parts) == 2 and parts[1] in ("__main__",):
        top = "__main__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{mod}: its folder {top!r} is in no layer of LAYERS")


def _levels(graph: dict[str, set[str]]) -> dict[str, int]:
    levels: dict[str, int] = {}

    def level(mod: str, seen: tuple[str, ...] = ()) -> int:
        assert mod not in seen, "import cycle: " + " -> ".join((*seen, mod))
        if mod not in levels:
            levels[mod] = 1 + max((level(dep, (*seen, mod)) for dep in graph[mod]), default=0)
        return levels[mod]

    for mod in graph:
        level(mod)
    return levels


def test_no_module_imports_a_layer_above_its_own() -> None:
    """Imports flow one way: cli/web, core, ops/query, job, store/checks/ledger, spec, foundation."""
    graph = _graph()
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(d) < _layer(m))
    assert upward == []


def test_the_import_graph_has_no_cycle_and_at_most_twelve_levels() -> None:
    """No two modules import each other (directly or around a loop), and the graph is at most 12 levels deep."""
    levels = _levels(_graph())
    assert max(levels.values()) <= MAX_LEVELS, sorted(levels.items(), key=lambda kv: -kv[1])[:5]


def test_the_ledger_folder_holds_engines_only() -> None:
    """ledger/ imports nothing above the foundation but itself: its factory and its operator tools live elsewhere."""
    graph = _graph()
    outside = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("dispatcher.ledger")
        for d in deps
        if not d.startswith("dispatcher.ledger") and _layer(d) != len(LAYERS) - 1
    )
    assert outside == []
