"""A raw HTTP/1.1 client for tests about the bytes on the wire: exact request bytes out, the
response's status line, headers as spelled and body chunks exactly as framed.

HTTP client libraries hide what these tests are about (they re-frame bodies, merge chunks,
normalise headers), so :class:`RawConnection` speaks HTTP/1.1 over a blocking socket itself.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RawConnection", "RawResponse", "request_bytes"]


def request_bytes(
    method: str,
    target: str,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    *,
    host: str = "127.0.0.1",
) -> bytes:
    """An HTTP/1.1 request: ``Host`` and ``Content-Length`` (for a body) first, then
    ``headers`` exactly as given."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if body or method not in ("GET", "HEAD"):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass(frozen=True)
class RawResponse:
    """``chunks``: a chunked body's chunks as framed (None when not chunked); ``body``: all of
    it; ``complete``: the body ended as its framing said (False: the connection closed first)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    chunks: tuple[bytes, ...] | None
    body: bytes
    complete: bool

    def header(self, name: str) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), if any."""
        wanted = name.lower().encode()
        return next((v for k, v in self.headers if k.lower() == wanted), None)


class RawConnection:
    """One client connection (``rcvbuf``: a small receive buffer, for a client that reads
    slowly; every read is bounded by ``timeout``)."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", *, timeout: float = 10.0, rcvbuf: int = 0
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 16)
        self._buffer += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes | None:
        while marker not in self._buffer:
            if not self._fill():
                return None
        found, self._buffer = self._buffer.split(marker, 1)
        return found

    def _exactly(self, size: int) -> bytes | None:
        while len(self._buffer) < size:
            if not self._fill():
                return None
        found, self._buffer = self._buffer[:size], self._buffer[size:]
        return found

    def read_head(self) -> tuple[int, tuple[tuple[bytes, bytes], ...]]:
        """The status and headers of the next response (ConnectionError if it never came)."""
        head = self._until(b"\r\n\r\n")
        if head is None:
            raise ConnectionError("the connection closed before a response head")
        status_line, *lines = head.split(b"\r\n")
        headers = tuple(
            (name.strip(), value.strip()) for name, value in (line.split(b":", 1) for line in lines)
        )
        return int(status_line.split()[1]), headers

    def read_chunk(self) -> bytes | None:
        """The next chunk of a chunked body; b"" at its end, None if the connection closed."""
        size_line = self._until(b"\r\n")
        if size_line is None:
            return None
        data = self._exactly(int(size_line.split(b";")[0], 16) + 2)
        return None if data is None else data[:-2]

    def read_response(self) -> RawResponse:
        """The next whole response (as much of it as came before the connection closed)."""
        status, headers = self.read_head()
        lookup = {name.lower(): value for name, value in headers}
        if lookup.get(b"transfer-encoding", b"").lower() == b"chunked":
            chunks, complete = self._chunks()
            return RawResponse(status, headers, tuple(chunks), b"".join(chunks), complete)
        length = int(lookup.get(b"content-length", b"0"))
        body = self._exactly(length)
        if body is None:
            body, self._buffer = self._buffer, b""
            return RawResponse(status, headers, None, body, False)
        return RawResponse(status, headers, None, body, True)

    def count_response(self) -> tuple[int, int, bool]:
        """(status, body bytes, complete) of the next response, keeping none of its body: for
        answers too large for the test to hold."""
        status, headers = self.read_head()
        lookup = {name.lower(): value for name, value in headers}
        if lookup.get(b"transfer-encoding", b"").lower() != b"chunked":
            body = self._exactly(int(lookup.get(b"content-length", b"0")))
            return status, len(body or b""), body is not None
        size = 0
        while (chunk := self.read_chunk()) is not None:
            if chunk == b"":
                return status, size, True
            size += len(chunk)
        return status, size, False

    def _chunks(self) -> tuple[list[bytes], bool]:
        chunks: list[bytes] = []
        while True:
            chunk = self.read_chunk()
            if chunk is None:
                return chunks, False
            if chunk == b"":  # the last chunk, and the empty trailer section after it
                return chunks, True
            chunks.append(chunk)

    def closed_by_peer(self) -> bool:
        """Whether the other side has closed (reads the end of the stream, waiting up to the
        timeout); data still unread counts as open."""
        try:
            return not self._buffer and self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
