"""The uvicorn installed is one the HTTP tests passed on.

``kvevents.http._protocol`` subclasses uvicorn's httptools protocol, which is not uvicorn's
public API (``kvevents.http._uvicorn`` says what it relies on and why). pyproject.toml bounds
uvicorn to the versions tested, and these tests fail on a uvicorn outside that range or whose
protocol modules differ from those of every version tested, before a user's install meets it.
"""

from __future__ import annotations

import re
import shutil
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
import uvicorn

from kvevents.http import _uvicorn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _uvicorn_requirements() -> dict[str, str]:
    """Each extra of pyproject.toml that needs uvicorn, and its requirement."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {
        extra: requirement
        for extra, requirements in extras.items()
        for requirement in requirements
        if re.match(r"uvicorn\b", requirement)
    }


def test_pyproject_bounds_uvicorn_to_the_tested_range() -> None:
    """Every extra that brings uvicorn allows exactly the range the protocol was tested on."""
    low, high = _uvicorn.TESTED_RANGE
    requirements = _uvicorn_requirements()
    assert {"service", "route", "all"} <= requirements.keys()
    assert set(requirements.values()) == {f"uvicorn>={low},<{high}"}


def test_the_installed_uvicorn_is_in_the_tested_range() -> None:
    """The running uvicorn is inside the range pyproject.toml allows."""
    low, high = (_version(bound) for bound in _uvicorn.TESTED_RANGE)
    assert low <= _version(uvicorn.__version__) < high, uvicorn.__version__


def test_the_installed_uvicorn_is_one_the_protocol_was_tested_on() -> None:
    """The source of the uvicorn modules the protocol leans on is that of a version tested,
    and of this very version: else run the HTTP tests on it and record it (see _uvicorn)."""
    digest = _uvicorn.source_digest()
    assert digest in _uvicorn.TESTED, (
        f"uvicorn {uvicorn.__version__}: its {', '.join(_uvicorn.SOURCES)} differ from every "
        "version kvevents.http was tested on"
    )
    assert uvicorn.__version__ in _uvicorn.TESTED[digest].split()
    tested = [version for versions in _uvicorn.TESTED.values() for version in versions.split()]
    low, high = (_version(bound) for bound in _uvicorn.TESTED_RANGE)
    assert all(low <= _version(version) < high for version in tested)


def test_the_digest_changes_with_a_single_byte_of_those_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte changed in a module the protocol leans on makes another digest: the check
    above fails on a uvicorn that changed it."""
    before = _uvicorn.source_digest()
    real = _uvicorn.importlib.util.find_spec(_uvicorn.SOURCES[1])
    assert real is not None and real.origin is not None
    changed = tmp_path / "flow_control.py"
    shutil.copyfile(real.origin, changed)
    changed.write_bytes(changed.read_bytes() + b"\n")
    find_spec = _uvicorn.importlib.util.find_spec

    def patched(name: str) -> ModuleSpec | None:
        if name == _uvicorn.SOURCES[1]:
            return ModuleSpec(name, None, origin=str(changed))
        return find_spec(name)

    monkeypatch.setattr(_uvicorn.importlib.util, "find_spec", patched)
    assert _uvicorn.source_digest() != before
    assert _uvicorn.source_digest() not in _uvicorn.TESTED
