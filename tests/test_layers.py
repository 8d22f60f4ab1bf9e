"""The package's layers import one way (docs/architecture.md), and no module-level import
cycle exists."""

from __future__ import annotations

import ast
import re
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
                # ``from kvevents.index import _table`` imports the module, not the package face.
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
    assert "kvevents.index._prefix" in graph and "kvevents.subscribe._loop" in graph


# Layer folders whose ``__init__`` is their face: their other modules are private by name.
FACED = ("wire", "publish", "subscribe", "index", "service", "http", "scaleout", "sim", "route")
# The integrations are modules, each the face of one engine's adapter (vllm and sglang are
# entry points in pyproject.toml); ``cli`` keeps one module per command and ``testing`` its
# public fixture modules.
INTEGRATIONS = {"discovery", "sglang", "tensorrt_llm", "vllm"}


def test_a_faced_layer_has_no_public_module_but_its_face() -> None:
    """Every module of a faced layer but its ``__init__`` has a private name (``_prefix.py``),
    so that a module name without an underscore is a promise to users."""
    public = [
        str(path.relative_to(ROOT))
        for layer in FACED
        for path in (ROOT / layer).glob("*.py")
        if path.name != "__init__.py" and not path.name.startswith("_")
    ]
    assert public == []
    assert {p.stem for p in (ROOT / "integrations").glob("[!_]*.py")} == INTEGRATIONS


def _private_imports(path: Path, layer: str) -> list[str]:
    """The private modules of ``layer`` that the module at ``path`` imports."""
    prefix = f"kvevents.{layer}._"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if name.startswith(prefix)]
    return found


def test_no_module_outside_a_layer_imports_its_private_modules() -> None:
    """Outside ``kvevents/<layer>/`` the library reaches a faced layer through its face only
    (``from kvevents.index import PrefixIndex``, never ``kvevents.index._prefix``)."""
    reached = [
        f"{path.relative_to(ROOT)}: {name}"
        for layer in FACED
        for path in ROOT.rglob("*.py")
        if not path.is_relative_to(ROOT / layer)
        for name in _private_imports(path, layer)
    ]
    assert reached == []


def test_the_private_import_check_sees_one() -> None:
    """The check above finds a private import where there is one (a guard against a no-op)."""
    assert _private_imports(ROOT / "index" / "_prefix.py", "index") != []


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md's layer table names every module of the package in its layer's row
    (a module added without a word there fails here)."""
    page = (ROOT.parent.parent / "docs" / "architecture.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `([a-z]+)/` \|.*$", page, re.M)}
    top = re.search(r"^\| top level \|.*$", page, re.M)
    assert top is not None
    rows["top"] = top[0]
    unnamed = [
        str(path.relative_to(ROOT))
        for path in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py"), *ROOT.glob("*/*.c")]
        if path.stem not in ("__init__", "__main__")
        and not re.search(
            rf"`{path.stem}(\.c|\.py)?`",
            rows.get("top" if path.parent == ROOT else path.parent.name, ""),
        )
    ]
    assert unnamed == []


TESTS = ROOT.parent.parent / "tests"
# The test modules at the top: the cross-cutting ones (layout, hygiene, the README, packaging,
# deployment, observability) and those of the top-level modules (config, files, metrics,
# security, _libzmq) and of bench/.
TOP_LEVEL_TESTS = (
    "test_bench_chart.py",
    "test_bench_route.py",
    "test_code_shape.py",
    "test_config.py",
    "test_config_sglang.py",
    "test_deploy.py",
    "test_hostile_files.py",
    "test_layers.py",
    "test_library_hygiene.py",
    "test_libzmq.py",
    "test_metrics.py",
    "test_metrics_components.py",
    "test_observability.py",
    "test_readme.py",
    "test_security.py",
    "test_smoke.py",
    "test_wheel.py",
)
# Test modules that read another layer's private modules on purpose, and why.
REACHES = {
    "test_code_shape.py": "holds every layer's running counters against their stats records",
    "test_libzmq.py": "the native receive and send of two layers, against pyzmq's",
    "http/test_service.py": "patches the index's decoder (decoding happens outside the lock)",
    "index/test_index_salt.py": "the salt's field in the HTTP API's schema",
    "integrations/test_discovery.py": "discovery's bounds are those of the service's fields",
}


def test_tests_reach_other_layers_through_their_faces() -> None:
    """A test module in ``tests/<layer>/`` may read its own layer's private modules (it
    specifies them); other layers it reaches through their faces, as users do."""
    reached = [
        f"{path.relative_to(TESTS)}: {name}"
        for path in sorted(TESTS.rglob("test_*.py"))
        if str(path.relative_to(TESTS)) not in REACHES
        for layer in FACED
        if layer != path.parent.name
        for name in _private_imports(path, layer)
    ]
    assert reached == []


def test_tests_mirror_the_layers() -> None:
    """Each faced layer's tests live in ``tests/<layer>/``, with the test of its face; only the
    cross-cutting modules stay at the top, and no test module imports another."""
    for layer in FACED:
        assert (TESTS / layer / f"test_{layer}_face.py").is_file() or layer == "http", layer
    assert (TESTS / "http" / "test_http_face.py").is_file()
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert top == sorted(TOP_LEVEL_TESTS)
    sibling = [
        f"{path.relative_to(TESTS)}: {name}"
        for path in TESTS.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [a.name for a in node.names]
        )
        if name.split(".")[0].startswith("test_")
    ]
    assert sibling == []
