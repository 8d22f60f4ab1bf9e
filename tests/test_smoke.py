"""The package imports cleanly and exposes its public face."""

from __future__ import annotations

import subprocess
import sys

import kvevents


def test_public_names_resolve() -> None:
    """Every name in __all__ is importable from the top-level package (ruff keeps it sorted)."""
    missing = [name for name in kvevents.__all__ if not hasattr(kvevents, name)]
    assert missing == []


def test_pure_modules_do_not_import_zmq() -> None:
    """The package, codec, cursor, engine side and index are usable without loading ZeroMQ."""
    code = (
        "import sys; import kvevents, kvevents.wire, kvevents.subscribe._cursor, kvevents.sim._engine, "
        "kvevents.index._prefix, kvevents.index._router; print('zmq' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_schema_module_loads_nothing_heavy() -> None:
    """``import kvevents.events`` loads neither pydantic, ZeroMQ nor xxhash."""
    code = (
        "import sys; import kvevents.events; "
        "print(sorted(m for m in ('pydantic', 'zmq', 'xxhash') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_comes_from_the_package_metadata() -> None:
    """``kvevents.__version__`` is the installed distribution's version, not a second copy."""
    from importlib.metadata import version

    assert kvevents.__version__ == version("kvevents")


def test_every_subpackage_face_resolves_its_names() -> None:
    """Every name in each layer's ``__all__`` resolves (ruff's RUF022 keeps the lists sorted)."""
    import importlib

    for name in ("wire", "publish", "subscribe", "index", "service", "sim", "testing.conformance"):
        package = importlib.import_module(f"kvevents.{name}")
        missing = [n for n in package.__all__ if not hasattr(package, n)]
        assert missing == [], name


def test_simulator_names_are_not_on_the_library_face() -> None:
    """The simulator's names live in ``kvevents.sim``, not in the library's ``__all__``."""
    for name in ("SimulatedEngine", "EngineConfig", "PrefixCache", "load_trace", "TraceRow"):
        assert name not in kvevents.__all__
        assert hasattr(__import__("kvevents.sim").sim, name)
