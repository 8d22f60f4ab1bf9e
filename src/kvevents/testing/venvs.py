"""Where a peer's own interpreter is: the peers (NVIDIA Dynamo's indexer, vLLM, SGLang) pin
dependencies of their own, so each lives in a venv of its own (``make dynamo``, ``make vllm``,
``make sglang``), found the same way for each."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["peer_python", "peer_pythons"]


def peer_pythons(env_var: str, venv: str) -> Iterator[str]:
    """``$env_var`` if set, then ``venv/bin/python`` in the working directory and each of its
    parents that has one, nearest first."""
    env = os.environ.get(env_var)
    if env:
        yield env
    here = Path.cwd().resolve()
    for directory in (here, *here.parents):
        path = directory / venv / "bin" / "python"
        if path.exists():
            yield str(path)


def peer_python(env_var: str, venv: str) -> str | None:
    """The first of :func:`peer_pythons`, or None."""
    return next(peer_pythons(env_var, venv), None)
