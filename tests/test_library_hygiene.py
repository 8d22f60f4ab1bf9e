"""The library logs through `logging` only: no prints, no handlers of its own, named loggers."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import kvevents

ROOT = Path(kvevents.__file__).parent
# Programs run as `python -m ...` by tests and users; their output is their purpose.
PROGRAMS = {"cli", "testing/publisher.py", "testing/chat_model.py", "testing/route_demo.py"}


def _library_sources() -> list[Path]:
    return [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if not any(str(path.relative_to(ROOT)).startswith(p) for p in PROGRAMS)
    ]


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def test_every_library_module_imports() -> None:
    """Every module under kvevents imports cleanly (the scan below covers real code)."""
    names = [m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="kvevents.")]
    names = [n for n in names if not n.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    assert "kvevents.subscribe.subscriber" in names and "kvevents.cli.listen" in names


def test_library_never_prints() -> None:
    """Outside the command line programs, nothing calls print() or writes to sys.stdout/stderr."""
    offenders = []
    for path in _library_sources():
        tree = ast.parse(path.read_text(), str(path))
        for call in _calls(tree):
            if _name(call) == "print":
                offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("stdout", "stderr")
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} (sys.{node.attr})")
    assert offenders == []


def test_library_configures_no_logging() -> None:
    """The library never calls basicConfig or adds handlers: that is the application's choice."""
    offenders = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path in _library_sources()
        for call in _calls(ast.parse(path.read_text()))
        if _name(call) in ("basicConfig", "addHandler", "dictConfig", "fileConfig")
    ]
    assert offenders == []


def test_loggers_live_under_kvevents() -> None:
    """Every logger the library creates is named kvevents.<component>, so one line tunes them."""
    names = []
    for path in _library_sources():
        for call in _calls(ast.parse(path.read_text())):
            if _name(call) == "getLogger":
                arg = call.args[0] if call.args else None
                names.append(arg.value if isinstance(arg, ast.Constant) else "<dynamic>")
    assert names, "no logger found: the scan is broken"
    assert all(isinstance(n, str) and n.startswith("kvevents.") for n in names), names


def test_commands_without_their_extra_say_what_to_install() -> None:
    """With only the core installed, the CLI still starts and names the missing extra."""
    code = (
        "import sys; sys.modules['xxhash'] = None; from kvevents.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )

    assert cli("listen", "--help").returncode == 0
    assert "kvevents[index]" in cli("--help").stdout
    result = cli("simulate", "--limit", "5")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "kvevents simulate: error: needs 'xxhash': pip install 'kvevents[index]'"
    )
    # A command that parses without the extra but needs it to run says the same.
    served = cli("serve", "--port", "0")
    assert served.returncode == 1
    assert "needs 'xxhash': pip install 'kvevents[service]'" in served.stderr
