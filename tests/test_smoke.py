"""The package imports cleanly and exposes its public face."""

from __future__ import annotations

import subprocess
import sys

import kvevents


def test_public_names_resolve() -> None:
    """Every name in __all__ is importable from the top-level package, and __all__ is sorted."""
    missing = [name for name in kvevents.__all__ if not hasattr(kvevents, name)]
    assert missing == []
    assert kvevents.__all__ == sorted(kvevents.__all__)


def test_pure_modules_do_not_import_zmq() -> None:
    """The package, codec, cursor, engine side and index are usable without loading ZeroMQ."""
    code = (
        "import sys; import kvevents, kvevents.wire, kvevents.cursor, kvevents.engine, "
        "kvevents.index, kvevents.router; print('zmq' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
