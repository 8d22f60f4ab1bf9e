"""An HTTP peer that misbehaves on purpose: it drips its answer, floods it, or never ends it.

:class:`HostileHttpServer` answers every connection with the bytes it was given (a status
line and headers, then a body), ``chunk`` bytes every ``pace`` seconds, optionally followed by
``flood`` bytes of spaces, and then holds the connection open until it is closed. It does not
parse the request: what a client under test must survive is the answer. Used for engine
discovery and the TensorRT-LLM poller (an engine that drips, hangs or answers 200 MB).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from types import TracebackType

__all__ = ["HostileHttpServer", "dripping", "flooding"]


class HostileHttpServer:
    """A loopback server on a free port; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, head: bytes, *, flood: int = 0, chunk: int = 1, pace: float = 0.05) -> None:
        self.head, self.flood, self.chunk, self.pace = head, flood, chunk, pace
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hostile-http", daemon=True)
        self._thread.start()

    def __enter__(self) -> HostileHttpServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop answering and close the listening socket (the connection it holds too)."""
        self._stop.set()
        self._thread.join(5)
        self.listener.close()

    def _serve(self) -> None:
        self.listener.settimeout(0.05)  # so that close() is seen between connections
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                self._answer(conn)

    def _chunks(self) -> Iterator[bytes]:
        for i in range(0, len(self.head), self.chunk):
            yield self.head[i : i + self.chunk]
        spaces = b" " * self.chunk
        for _ in range(0, self.flood, self.chunk):
            yield spaces

    def _answer(self, conn: socket.socket) -> None:
        for piece in self._chunks():
            if self.pace and self._stop.wait(self.pace):
                return
            try:
                conn.sendall(piece)
            except OSError:
                return  # the client gave up: on to the next connection
        self._stop.wait()  # the answer never ends


def dripping(body_bytes: int = 100_000, pace: float = 0.05) -> HostileHttpServer:
    """A 200 answer announcing ``body_bytes`` of body, sent one byte every ``pace`` seconds:
    each read is answered in time, the whole answer takes hours."""
    head = f"HTTP/1.1 200 OK\r\ncontent-length: {body_bytes}\r\n\r\n".encode()
    return HostileHttpServer(head + b" " * body_bytes, pace=pace)


def flooding(body_bytes: int = 200 * 2**20) -> HostileHttpServer:
    """A 200 answer of ``body_bytes`` (200 MB by default), sent as fast as it is read."""
    head = f"HTTP/1.1 200 OK\r\ncontent-length: {body_bytes}\r\n\r\n".encode()
    return HostileHttpServer(head, flood=body_bytes, chunk=1 << 16, pace=0)
