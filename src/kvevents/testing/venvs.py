"""Peers in interpreters of their own: the peers (NVIDIA Dynamo's indexer, vLLM, SGLang) pin
dependencies of their own, so each lives in a venv of its own (``make dynamo``, ``make vllm``,
``make sglang``), found the same way for each; a peer script run there answers one JSON line
per request line (:func:`read_json_line`)."""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kvevents._types import Document
from kvevents.deadline import Deadline

__all__ = ["PeerSilent", "peer_python", "peer_pythons", "read_json_line"]


class PeerSilent(RuntimeError):
    """A peer process gave no whole reply line: it ``timed out`` or ``exited (rc)``."""


def read_json_line(proc: subprocess.Popen[bytes], deadline: Deadline) -> Document:
    """The next JSON line ``proc`` writes to its stdout, waiting until ``deadline`` at most."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline.remaining()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            raise PeerSilent("timed out" if not ready else f"exited ({proc.poll()})")
        data += chunk
    reply: Document = json.loads(data)
    return reply


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
