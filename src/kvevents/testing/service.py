"""Our index service (``kvevents serve``) as a test peer in its own process.

:class:`ServiceIndexer` has the methods of :class:`kvevents.testing.dynamo.DynamoIndexer` where
they mean the same thing, so one benchmark or test drives either: ``start()`` (ready once the
server says it accepts connections), ``register``, ``matched_blocks``, ``send`` (a pre-encoded
body on a kept-alive connection), ``rss_bytes``, ``pid``, ``stop``/``close``, ``with``.

The process is ``python -m kvevents.cli serve --host 127.0.0.1 --port 0``: the server binds
the port itself and prints ``serving on URL`` once it accepts connections, so there is no
port race and no polling. Its log (stderr) goes to a temporary file, quoted in errors.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Sequence
from typing import IO

from kvevents._types import Document
from kvevents.events import StreamKey
from kvevents.testing._process import IndexerProcess
from kvevents.testing.sockets import Deadline

__all__ = ["ServiceIndexer", "ServiceIndexerError"]

_READY_PREFIX = "serving on "


class ServiceIndexerError(RuntimeError):
    """The service could not start, died, or answered an HTTP call with an error status."""


class ServiceIndexer(IndexerProcess):
    """``kvevents serve`` in a subprocess on a free port, with an HTTP client.

    ``python``: the interpreter (default: the running one). ``args``: more ``serve`` options
    (e.g. ``["--policy", "longest_prefix"]``; ``["--api", "dynamo"]`` answers in Dynamo's
    shapes, for a client of Dynamo's indexer: then use :meth:`call` and :meth:`send`, as the
    helpers below speak our own API). ``env``: extra environment variables. One instance is
    used from one thread.
    """

    error = ServiceIndexerError
    log_name = "service.log"

    def __init__(
        self,
        *,
        python: str | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        http_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            startup_timeout=startup_timeout, stop_timeout=stop_timeout, http_timeout=http_timeout
        )
        self.python = python or sys.executable
        self.args = list(args)
        self.env = dict(env or {})

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ServiceIndexer:
        """Launch the service; return once it accepts connections (bounded by startup_timeout)."""
        if self._proc is not None:
            return self
        self._new_log_dir("kvevents-service-")
        command = [self.python, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", "0", *self.args]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        try:
            self.port = self._read_port(Deadline(self.startup_timeout))
        except BaseException:
            self.stop()
            raise
        return self

    def _read_port(self, deadline: Deadline) -> int:
        """The port from the ``serving on URL`` line, waiting no longer than ``deadline``."""
        assert self._proc is not None and self._proc.stdout is not None
        line = _read_line(self._proc.stdout, deadline)
        if not line.startswith(_READY_PREFIX):
            if self._proc.poll() is None and deadline.expired:
                raise ServiceIndexerError(
                    f"service not ready within {self.startup_timeout}s: {self.log_tail()}"
                )
            self._proc.wait(self.stop_timeout)
            raise ServiceIndexerError(
                f"service exited with status {self._proc.returncode} before serving: "
                f"{line!r} {self.log_tail()}"
            )
        return int(line[len(_READY_PREFIX) :].rsplit(":", 1)[1])

    # ------------------------------------------------------------------ HTTP

    def register(
        self,
        worker: int | str,
        endpoint: str,
        *,
        block_size: int,
        replay_endpoint: str | None = None,
        ranks: int = 1,
    ) -> None:
        """Index a worker: its ranks publish on ``endpoint`` (base port + rank)."""
        body: Document = {
            "worker_id": str(worker),
            "endpoint": endpoint,
            "block_size": block_size,
            "ranks": ranks,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self.call("POST", "/register", body)

    def unregister(self, worker: int | str, rank: int | None = None) -> None:
        """Forget a worker (or one of its ranks) and everything it held."""
        body: Document = {"worker_id": str(worker)}
        if rank is not None:
            body["rank"] = rank
        self.call("POST", "/unregister", body)

    def workers(self) -> list[Document]:
        """``GET /workers``: registrations with their per-rank index and stream state."""
        result: list[Document] = self.call("GET", "/workers")["workers"]
        return result

    def dump(self) -> Document:
        """``GET /dump``: every holder's blocks, and the index stats."""
        result: Document = self.call("GET", "/dump")
        return result

    def query(self, token_ids: Sequence[int]) -> Document:
        """``POST /query``: the raw reply (matches per holder, and a routing decision)."""
        result: Document = self.call("POST", "/query", {"token_ids": list(token_ids)})
        return result

    def matched_blocks(
        self, token_ids: Sequence[int], block_size: int | None = None
    ) -> dict[StreamKey, int]:
        """Matched prefix length in blocks per (worker id, rank); absent means 0.

        ``block_size`` is accepted for symmetry with ``DynamoIndexer``, whose replies count
        tokens: ours count blocks of each worker's own size already.
        """
        scores = self.query(token_ids).get("scores", {})
        return {
            (worker, int(rank)): blocks
            for worker, ranks in scores.items()
            for rank, blocks in ranks.items()
            if blocks
        }


def _read_line(stream: IO[bytes], deadline: Deadline) -> str:
    """One line of a child's stdout, or what came before EOF or the deadline."""
    fd = stream.fileno()
    data = b""
    while not data.endswith(b"\n") and not deadline.expired:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline.remaining()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()
