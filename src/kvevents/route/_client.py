"""The connections to the engines: HTTP/1.1 on asyncio, kept alive, parsed by httptools.

The front door's hot path is one request out and one answer back per client request, so the
client is what that needs and no more: a request written in one piece (its head from bytes
prepared once per client request, its body as the client sent it), the answer's status and
headers as the engine sent them, and its body handed on piece by piece:

- a chunked body (vLLM writes each SSE event as one HTTP chunk) one whole chunk at a time, so
  the client sees the engine's chunk boundaries; a chunk over ``hold`` bytes in pieces of
  about that size, so no more than that of it is ever held;
- any other body as it arrives.

The reader takes one piece (:meth:`EngineResponse.read`) or every piece read so far
(:meth:`EngineResponse.read_ready`: what one read of the socket brought, passed on in one write).

Reading stops while more than ``hold`` bytes wait for the reader (a client slower than the
engine holds the engine back, not the proxy's memory) and starts again when they are taken.
A connection whose answer ended whole goes back to its engine's pool for the next request;
any other (cut off, cancelled, the answer not read to its end, ``Connection: close``) is
closed, which is how an engine learns that its client went away (vLLM aborts the request).
An idle connection is reused only within ``keepalive_timeout`` of its last answer, below the
engine's own keep-alive (uvicorn's 5 s), so a request is never written to a connection the
engine is closing.

Failures are :class:`UpstreamError` with a kind: ``connect_error`` (no connection within the
timeout), ``reset`` (the connection lost, or an answer that is not HTTP), ``timeout`` (no
answer headers within ``first_byte_timeout``; :meth:`EngineResponse.read` raises
:class:`TimeoutError` after ``idle_timeout`` of silence between two pieces instead).

Before this module the proxy used aiohttp's client: measured in front of a stand-in engine, it
cost about a third of the front door's CPU per request (its request and response objects,
timers rescheduled on every read, a stream reader between the socket and the proxy).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlsplit

import httptools

__all__ = ["EngineClient", "EngineResponse", "Origin", "UpstreamError"]

#: What went wrong with a request to an engine (see the module docstring).
ErrorKind = Literal["connect_error", "reset", "timeout"]
_HOLD = 64 << 10


class UpstreamError(Exception):
    """A request to an engine that failed: ``kind``, and why."""

    def __init__(self, kind: ErrorKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class Origin:
    """Where an engine is: its scheme, host and port, ``Host`` header and path prefix."""

    host: str
    port: int
    tls: bool
    authority: bytes
    prefix: bytes

    @classmethod
    def of(cls, url: str) -> Origin:
        """``url`` (``http://host:port[/prefix]``, or ``https://``) as an origin;
        :class:`ValueError` for anything else."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(
            parts.hostname,
            port,
            tls,
            parts.netloc.rpartition("@")[2].encode("idna"),
            parts.path.rstrip("/").encode("latin-1"),
        )


@dataclass(frozen=True)
class Timeouts:
    """Seconds to connect, to the answer's headers, and of silence within its body."""

    connect: float
    first_byte: float
    idle: float


class _Connection(asyncio.Protocol):
    """One connection to an engine and the answer being read on it."""

    def __init__(self, client: EngineClient, origin: Origin, hold: int) -> None:
        self.client = client
        self.origin = origin
        self._hold = hold
        self._loop = client.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset_answer()

    def _reset_answer(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_type = ""
        self.content_length: int | None = None
        self.chunked = False
        self._until_close = False  # a body that ends when the engine closes the connection
        self.head_done = False
        self.complete = False
        self._keep_alive = False
        self._informational = False
        self._head_only = False
        self._pieces: deque[bytes] = deque()
        self._chunk: list[bytes] = []
        self._chunk_size = 0
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._late = False
        self._error: UpstreamError | None = None
        self._paused = False

    # ------------------------------------------------------------------ asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._error = self._error or UpstreamError("reset", f"not an HTTP answer ({exc})")
            self.close()
        if self._chunk and not self.chunked:
            self._flush_chunk()  # a body without chunks: what arrived is one piece
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client.forget(self)
        if self._until_close and self.head_done and exc is None and not self.complete:
            if self._chunk:
                self._flush_chunk()
            self.complete = True  # the body was all the engine sent before it closed
        if not self.complete and self._error is None:
            why = f"connection lost ({exc})" if exc else "the engine closed the connection"
            self._error = UpstreamError("reset", why)
        self._wake()

    # ------------------------------------------------------------------ the parser's side

    def on_header(self, name: bytes, value: bytes | None) -> None:
        self.headers.append((name, value or b""))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._informational = True  # 100 Continue and the like: the answer follows
            self.headers = []
            return
        self.status = status
        self.head_done = True
        self.content_type, self.content_length, self.chunked = _framing(self.headers)
        if self._head_only:
            self.complete = True  # a HEAD answer has no body, whatever its headers say
        elif not self.chunked and self.content_length is None and status not in (204, 304):
            self._until_close = True

    def on_body(self, body: bytes) -> None:
        self._chunk.append(body)
        self._chunk_size += len(body)
        self._buffered += len(body)
        if self._chunk_size >= self._hold:
            self._flush_chunk()
        if self._buffered > self._hold and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_chunk_complete(self) -> None:
        if self._chunk:
            self._flush_chunk()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._chunk:
            self._flush_chunk()
        self.complete = True
        self._keep_alive = self._parser.should_keep_alive()  # only known here, not after

    def _flush_chunk(self) -> None:
        chunk = self._chunk
        self._pieces.append(chunk[0] if len(chunk) == 1 else b"".join(chunk))
        self._chunk = []
        self._chunk_size = 0

    # ------------------------------------------------------------------ the request

    def send(self, head: bytes, body: bytes, head_only: bool) -> None:
        assert self.transport is not None
        self._reset_answer()
        self._head_only = head_only
        if len(body) > _HOLD:
            self.transport.write(head)
            self.transport.write(body)
        else:
            self.transport.write(head + body if body else head)

    async def head(self, timeout: float) -> None:
        """Wait for the answer's status and headers (:class:`UpstreamError` if none come)."""
        while not self.head_done:
            if self._error is not None:
                raise self._error
            await self._wait(timeout)
            if self._late:
                raise UpstreamError("timeout", f"no answer within {timeout:g} s")

    async def _wait(self, timeout: float) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, self._time_up, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _time_up(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._late = True
            waiter.set_result(None)

    async def read(self, idle: float) -> tuple[bytes, bool]:
        pieces = self._pieces
        if not pieces and not self.complete:
            await self._ready(idle)
        piece = pieces.popleft() if pieces else b""
        self._taken(len(piece))
        return piece, self.complete and not pieces

    async def read_ready(self, idle: float) -> tuple[list[bytes], bool]:
        pieces = self._pieces
        if not pieces and not self.complete:
            await self._ready(idle)
        ready = list(pieces)
        pieces.clear()
        self._taken(sum(map(len, ready)))
        return ready, self.complete

    async def _ready(self, idle: float) -> None:
        """Wait for a piece or the body's end (:class:`TimeoutError` after ``idle`` s of
        neither, the connection's error if it fails first)."""
        pieces = self._pieces
        while not pieces and not self.complete:
            if self._error is not None:
                raise self._error
            await self._wait(idle)
            if self._late and not pieces and not self.complete:
                raise asyncio.TimeoutError()

    def _taken(self, size: int) -> None:
        """``size`` bytes were taken by the reader: reading goes on once they are down to half
        (or to a chunk not finished yet, which only more bytes end)."""
        self._buffered -= size
        if self._paused and (not self._pieces or self._buffered <= self._hold // 2):
            self._paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        ready = self._pieces or self.complete or self.head_done or self._error is not None
        if ready and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def reusable(self) -> bool:
        return self.complete and not self.closed and not self._pieces and self._keep_alive

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class EngineResponse:
    """An engine's answer: ``status``, ``headers`` (as sent), and its body by :meth:`read`.

    :meth:`release` when done with it: the connection goes back to the pool if the answer
    was read to its end, else it is closed (which the engine sees as its client leaving).
    """

    def __init__(self, connection: _Connection, idle: float) -> None:
        self._connection = connection
        self._idle = idle
        self.status = connection.status
        self.headers = connection.headers
        self.content_type = connection.content_type
        self.content_length = connection.content_length
        self.chunked = connection.chunked
        self._released = False

    async def read(self) -> tuple[bytes, bool]:
        """(the next piece of the body, whether it is the last); the last may be empty.
        :class:`UpstreamError` ("reset") if the connection is lost first, :class:`TimeoutError`
        after ``idle_timeout`` without a piece."""
        return await self._connection.read(self._idle)

    async def read_ready(self) -> tuple[list[bytes], bool]:
        """(every piece of the body read so far and not yet taken, at least one unless the
        body has ended; whether the body has ended), as :meth:`read` fails."""
        return await self._connection.read_ready(self._idle)

    async def body(self, limit: int) -> bytes:
        """The whole body (:class:`UpstreamError` "reset" when it is over ``limit`` bytes)."""
        parts: list[bytes] = []
        size, last = 0, False
        while not last:
            piece, last = await self.read()
            size += len(piece)
            if size > limit:
                raise UpstreamError("reset", f"the answer is over {limit} bytes")
            parts.append(piece)
        return b"".join(parts)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._connection.client.put_back(self._connection)

    def close(self) -> None:
        self._released = True
        self._connection.close()


class EngineClient:
    """Kept-alive connections to the engines, by origin (see the module docstring).

    ``tls``: how ``https://`` engines are verified (default: the system's trust store, the
    engine's host name checked)."""

    def __init__(
        self,
        keepalive_timeout: float = 4.0,
        hold: int = _HOLD,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.keepalive_timeout = keepalive_timeout
        self._hold = hold
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tls = tls  # https:// engines: the system's trust store unless given
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def request(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: bytes,
        body: bytes,
        timeouts: Timeouts,
        on_sent: Callable[[], None] | None = None,
    ) -> EngineResponse:
        """Send ``method target`` to ``origin`` with the header lines ``headers`` (each
        ending in CRLF; no Host, Content-Length or hop-by-hop ones) and ``body``; the answer
        once its headers are in. A task cancelled meanwhile closes the connection.

        ``on_sent`` is called once the request is on its way, so that what it does overlaps
        the engine's work: right after the request is written on a kept-alive connection,
        or before connecting when a new connection is needed (which takes a while, and
        others must see it called meanwhile)."""
        head = b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%s" % (
            method,
            origin.prefix,
            target,
            origin.authority,
            headers,
        )
        if body or method not in (b"GET", b"HEAD"):
            head += b"Content-Length: %d\r\n" % len(body)
        connection = self._idle_connection(origin)
        if connection is None:
            if on_sent is not None:
                on_sent()
                on_sent = None
            connection = await self._connect(origin, timeouts.connect)
        try:
            connection.send(head + b"\r\n", body, method == b"HEAD")
            if on_sent is not None:
                on_sent()
            await connection.head(timeouts.first_byte)
        except BaseException:
            connection.close()
            raise
        return EngineResponse(connection, timeouts.idle)

    async def fetch(
        self,
        url: str,
        method: str = "GET",
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
        *,
        timeout: float,
        limit: int = 16 << 20,
    ) -> tuple[int, bytes]:
        """(status, whole body) of one request to ``url``, all of it within ``timeout``
        (:class:`UpstreamError`, "timeout" when it is over): for health checks and the like."""
        parts = urlsplit(url)
        origin = Origin.of(f"{parts.scheme}://{parts.netloc}")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = b"".join(
            b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers
        )
        times = Timeouts(timeout, timeout, timeout)

        async def exchange() -> tuple[int, bytes]:
            response = await self.request(
                origin, method.encode(), target.encode("latin-1"), lines, body, times
            )
            try:
                data = await response.body(limit)
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, data

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("timeout", f"no answer within {timeout:g} s") from None

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        """A kept-alive connection to ``origin`` still fit to reuse, if there is one."""
        idle = self._idle.get(origin)
        if idle:
            now = time.monotonic()
            while idle:
                connection = idle.pop()
                if not connection.closed and now - connection.idle_since < self.keepalive_timeout:
                    return connection
                connection.close()
        return None

    async def _connect(self, origin: Origin, timeout: float) -> _Connection:
        if self._closed:
            raise UpstreamError("connect_error", "the client is closed")
        try:
            _, protocol = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self, origin, self._hold),
                    origin.host,
                    origin.port,
                    ssl=self._context() if origin.tls else None,
                ),
                timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError("connect_error", f"no connection within {timeout:g} s") from None
        except OSError as exc:
            raise UpstreamError("connect_error", f"cannot connect ({_describe(exc)})") from None
        self._open.add(protocol)
        return protocol

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def put_back(self, connection: _Connection) -> None:
        if self._closed or not connection.reusable():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, []).append(connection)

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def aclose(self) -> None:
        """Close every connection (an answer still being read is cut off)."""
        self._closed = True
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # the transports' close callbacks run


def _framing(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, int | None, bool]:
    """The answer's media type (lower case, no parameters), declared length, and whether it
    comes in chunks."""
    content_type, length, chunked = "", None, False
    for name, value in headers:
        lower = name.lower()
        if lower == b"content-type":
            content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif lower == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = None
        elif lower == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return content_type, length, chunked


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
