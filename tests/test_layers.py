"""The package's layers import one way (docs/architecture.md), and no module-level import
cycle exists."""

from __future__ import annotations

import ast
from pathlib import Path

import kvevents

ROOT = Path(kvevents.__file__).parent

# Layer of each folder; a module may import its own layer and those listed for it.
ALLOWED = {
    "top": {"top", "wire"},
    "wire": {"top", "wire"},
    "publish": {"top", "wire", "publish"},
    "subscribe": {"top", "wire", "subscribe"},
    "index": {"top", "wire", "index"},
    "service": {"top", "wire", "subscribe", "index", "service"},
    # The service's API over HTTP, and the pieces of any HTTP server of the package.
    "http": {"top", "wire", "subscribe", "index", "service", "http"},
    "sim": {"top", "wire", "publish", "subscribe", "index", "service", "sim"},
    # Our publisher and subscriber inside other programs (engines' plugin systems).
    "integrations": {"top", "wire", "publish", "subscribe", "integrations"},
    "testing": {
        "top",
        "wire",
        "publish",
        "subscribe",
        "index",
        "service",
        "http",
        "sim",
        "route",
        "testing",
    },
    # Relays and router replicas over NATS JetStream: a subscriber in, an index service out.
    "scaleout": {"top", "wire", "subscribe", "index", "service", "scaleout"},
    # The front door: exact tokens in process, the proxy, routing on the index service.
    "route": {"top", "wire", "subscribe", "index", "service", "http", "route"},
    "cli": {
        "top",
        "wire",
        "publish",
        "subscribe",
        "index",
        "service",
        "sim",
        "testing",
        "integrations",
        "scaleout",
        "route",
        "http",
        "cli",
    },
}
# Modules of the top level that only the façade may reach: the top ``__init__`` names every
# layer (lazily), which is its job.
FACADE = "kvevents"


def _module_name(path: Path) -> str:
    parts = ("kvevents", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "top"


_MODULES = {_module_name(path) for path in ROOT.rglob("*.py")}


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(imported kvevents module, imported at module level) for every import in ``tree``."""
    found: list[tuple[str, bool]] = []
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "kvevents":
                # ``from kvevents.index import table`` imports the module, not the package face.
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    target = sub if sub in _MODULES else node.module
                    found.append((target, id(node) in top_level))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvevents":
                    found.append((alias.name, id(node) in top_level))
    return found


def _graph() -> dict[str, list[tuple[str, bool]]]:
    return {
        _module_name(path): _imports(ast.parse(path.read_text())) for path in ROOT.rglob("*.py")
    }


def test_imports_point_one_way() -> None:
    """No module imports from a layer above its own (the index never imports the subscriber,
    the library never imports kvevents.testing, wire imports no other layer)."""
    wrong = []
    for module, imports in _graph().items():
        if module == FACADE:
            continue
        mine = _layer(module)
        for target, _ in imports:
            if target != FACADE and _layer(target) not in ALLOWED[mine]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_module_level_import_cycle() -> None:
    """Module-level imports between kvevents modules form no cycle."""
    graph = {
        module: sorted({t for t, top in imports if top and t != module})
        for module, imports in _graph().items()
    }
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in graph:
        if not state.get(start):
            visit(start, [start])
    assert cycles == []


def test_the_layer_rules_see_every_module() -> None:
    """The checks above read every module of the package (a guard against a silent no-op)."""
    graph = _graph()
    assert len(graph) > 60
    assert "kvevents.index.prefix" in graph and "kvevents.subscribe.loop" in graph
