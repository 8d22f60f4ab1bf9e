"""The wheel ``python -m build`` makes installs in a fresh venv and runs there: its four C
modules built, the bundled trace and both status pages inside it."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a source checkout needs to build the wheel (pyproject.toml names README.md as the readme).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "src")
# Run in the fresh venv: each line checks one thing the wheel must carry.
CHECKS = """
import importlib, importlib.resources as r, pathlib, sys, kvevents
here = pathlib.Path(kvevents.__file__).resolve()
assert here.is_relative_to(pathlib.Path(sys.prefix).resolve()), here
for name in ("index._blocktable", "subscribe._zmqrecv", "publish._zerosend", "http._jsonscan"):
    importlib.import_module("kvevents." + name)
from kvevents.index import table_implementation
from kvevents.subscribe import native_receive
assert table_implementation() == ("c", None), table_implementation()
assert native_receive()
from kvevents.sim import default_trace_path, load_trace
assert len(load_trace(default_trace_path())) > 0
for layer in ("http", "route"):
    page = r.files("kvevents." + layer).joinpath("page.html").read_bytes()
    assert page.lower().startswith(b"<!doctype html>"), (layer, page[:40])
print("ok")
"""


def _copy_sources(into: Path) -> None:
    """The files a build reads, without the C modules built in place or caches."""
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            skip = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info")
            shutil.copytree(source, into / name, ignore=skip)
        else:
            shutil.copy2(source, into / name)


def _fresh_venv(where: Path) -> Path:
    """A venv whose own site-packages comes first, seeing this interpreter's packages only as
    the dependencies (kvevents' runtime needs), not this checkout's kvevents."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    # A plain path in a .pth file adds the directory without running its own .pth files, so an
    # editable install of kvevents there is not seen.
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import build"], capture_output=True).returncode != 0,
    reason="the `build` package is not installed (pip install 'kvevents[dev]')",
)
@pytest.mark.timeout(1200)  # a build compiles four C modules on a possibly busy machine
def test_the_built_wheel_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    """The wheel built from the sources carries the C modules (compiled), the Mooncake trace
    and the two status pages, installs with pip into a new venv and runs the console script."""
    source = tmp_path / "source"
    source.mkdir()
    _copy_sources(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVEVENTS_PURE_PYTHON")}
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
        env=env,
        timeout=900,
    )
    (wheel,) = (tmp_path / "dist").glob("kvevents-*.whl")
    assert "-cp3" in wheel.name, f"{wheel.name} is not a platform wheel: no C module in it"
    python = _fresh_venv(tmp_path / "venv")
    install = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, env=env, timeout=300)
    ran = subprocess.run(
        [python, "-c", CHECKS], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr
    version = subprocess.run(
        [tmp_path / "venv" / "bin" / "kvevents", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert version.returncode == 0, version.stderr
    assert "(index tables: C; message receive: C)" in version.stdout
