"""An indexer running as a subprocess, with a kept-alive HTTP client.

The common half of the test peers :class:`~kvevents.testing.dynamo.DynamoIndexer` and
:class:`~kvevents.testing.service.ServiceIndexer`: stopping (SIGINT, then SIGKILL), the log
file, resident memory, and HTTP calls on one kept-alive connection. Subclasses launch the
process and wait until it serves.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import ClassVar, TypeVar

from kvevents._types import JSONValue

__all__ = ["IndexerProcess"]

P = TypeVar("P", bound="IndexerProcess")


class IndexerProcess:
    """Lifecycle and HTTP of one indexer process; used from one thread."""

    #: The exception type raised for a failed start, a dead process or an HTTP error.
    error: ClassVar[type[Exception]] = RuntimeError
    #: File name of the process's log inside its temporary directory.
    log_name: ClassVar[str] = "indexer.log"

    def __init__(self, *, startup_timeout: float, stop_timeout: float, http_timeout: float):
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.http_timeout = http_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self: P) -> P:
        raise NotImplementedError

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """Process id of the running indexer."""
        if self._proc is None:
            raise self.error("the process is not running")
        return self._proc.pid

    def _new_log_dir(self, prefix: str) -> None:
        self._log_dir = tempfile.TemporaryDirectory(prefix=prefix)

    def stop(self) -> None:
        """Stop the process (SIGINT, then SIGKILL after ``stop_timeout``); idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(self.stop_timeout)
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        """Stop the process and delete its log."""
        self.stop()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None

    def __enter__(self: P) -> P:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def log_path(self) -> Path:
        """Where the process's output goes."""
        assert self._log_dir is not None, "start() first"
        return Path(self._log_dir.name) / self.log_name

    def log_text(self) -> str:
        """The log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return ""

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the log, for error messages."""
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(empty log)"

    def rss_bytes(self) -> int:
        """Resident memory of the process (Linux /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise self.error(f"no VmRSS in /proc/{self.pid}/status")

    def send(
        self, method: str, path: str, data: bytes | None = None, *, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """One request with a pre-encoded JSON body on the kept-alive connection: (status, body).

        Benchmarks time this call, so it does no JSON work of its own.
        """
        if self._conn is None:
            self._conn = http.client.HTTPConnection(
                "127.0.0.1", self.port, timeout=timeout or self.http_timeout
            )
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self._conn.request(method, path, body=data, headers=headers)
            response = self._conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            self._conn.close()
            self._conn = None
            raise

    def call(self, method: str, path: str, body: JSONValue = None) -> JSONValue:
        """One HTTP call with a JSON body; the decoded reply, or ``error`` on HTTP >= 400."""
        data = None if body is None else json.dumps(body).encode()
        status, reply = self.send(method, path, data)
        if status >= 400:
            text = reply.decode(errors="replace")
            raise self.error(f"{method} {path} -> HTTP {status}: {text}")
        return json.loads(reply) if reply else None
