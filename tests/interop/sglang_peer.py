"""SGLang's publisher-side code as a test peer: ``sglang_publisher.py`` run by SGLang's own
interpreter (``.venv-sglang``, found like vLLM's: ``$KVEVENTS_SGLANG_PYTHON``, then
``.venv-sglang/bin/python`` in the working directory or a parent), spoken to in JSON lines.
"""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

from kvevents.deadline import Deadline
from kvevents.testing.venvs import PeerSilent, peer_python, read_json_line

SGLANG_PYTHON_ENV = "KVEVENTS_SGLANG_PYTHON"
REQUIRE_ENV = "KVEVENTS_REQUIRE_SGLANG"
SCRIPT = Path(__file__).with_name("sglang_publisher.py")
_VENV_PYTHON = Path(".venv-sglang") / "bin" / "python"
REQUEST_TIMEOUT = 30.0


def find_sglang_python() -> str | None:
    """The interpreter that has SGLang, or None."""
    return peer_python(SGLANG_PYTHON_ENV, ".venv-sglang")


@functools.cache
def sglang_unavailable_reason() -> str | None:
    """None when SGLang's kv-events module runs under its interpreter, else why not."""
    python = find_sglang_python()
    if python is None:
        return f"no {_VENV_PYTHON} (run `make sglang`) and ${SGLANG_PYTHON_ENV} is unset"
    try:
        with SGLang(python) as peer:
            peer.ready()
    except (OSError, PeerError) as exc:
        return f"SGLang's kv-events module does not run in {python}: {exc}"
    return None


class PeerError(RuntimeError):
    """The script exited, timed out or answered with an error."""


class SGLang:
    """One ``sglang_publisher.py`` process; ``plugins`` runs SGLang's ``load_plugins()``."""

    def __init__(self, python: str, *, plugins: bool = False) -> None:
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close)
        try:
            self._proc = subprocess.Popen(
                [python, str(SCRIPT), json.dumps({"plugins": plugins})],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
            )
        except OSError:
            self._log.close()
            raise
        self._hello: dict[str, Any] | None = None

    def __enter__(self) -> SGLang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ready(self) -> dict[str, Any]:
        """The script's first line: SGLang's version and its factory's publisher names."""
        if self._hello is None:
            self._hello = self._read(Deadline(REQUEST_TIMEOUT), "start")
        return self._hello

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, one reply; a reply with ``error`` raises :class:`PeerError`."""
        reply = self.try_call(op, **fields)
        if "error" in reply:
            raise PeerError(reply["error"])
        return reply

    def try_call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, one reply, as it comes (``error`` included)."""
        self.ready()
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        self._proc.stdin.flush()
        return self._read(Deadline(REQUEST_TIMEOUT), op)

    def _read(self, deadline: Deadline, what: str) -> dict[str, Any]:
        try:
            return read_json_line(self._proc, deadline)
        except PeerSilent as exc:
            raise PeerError(f"sglang_publisher.py {exc} during {what}: {self.log_tail()}") from None

    def log_tail(self, lines: int = 10) -> str:
        self._log.seek(0)
        return "\n".join(self._log.read().decode(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Quit (killed after a bound); idempotent."""
        proc = self._proc
        if proc.poll() is None and proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.close()
                proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(15)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self._log.close()
