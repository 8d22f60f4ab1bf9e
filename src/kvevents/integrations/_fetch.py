"""One HTTP exchange with an engine, bounded in time and size (discovery, the TensorRT-LLM poll).

urllib's ``timeout`` bounds each socket operation, not the exchange: a server that sends a
byte a second answers every read in time and holds its caller for as long as it likes, and
``read()`` without a size takes whatever it is sent. :func:`fetch` gives the whole exchange
(connect, TLS, headers, redirects, body) one deadline, enforced by shutting the connection's
socket down when it passes, and reads at most ``max_bytes`` of body. Name resolution is the
one step it cannot interrupt (``getaddrinfo`` takes no timeout).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from kvevents.deadline import Deadline

__all__ = ["FetchError", "fetch"]


class FetchError(Exception):
    """No whole answer: ``reason`` says why; ``status`` is the HTTP status of an error answer."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class _Watchdog:
    """Shuts down the sockets of one exchange when its deadline passes.

    A socket is watched through a duplicate of its descriptor: ``shutdown`` acts on the
    connection, so it wakes a read blocked on the original, wrapped in TLS or not.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = Deadline(seconds)
        self.expired = False
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._watched:
                sock.close()
            self._watched.clear()

    def watch(self, sock: socket.socket) -> None:
        twin = socket.socket(fileno=socket.dup(sock.fileno()))
        with self._lock:
            self._watched.append(twin)
            if self.expired:
                _shut(twin)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._watched:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Watched(http.client.HTTPConnection):
    """A connection whose socket the watchdog of its exchange may shut down."""

    #: Set by :func:`_maker` on each connection it makes (urllib builds the connection with
    #: its own arguments, so it cannot be a constructor's).
    watchdog: _Watchdog | None = None

    def connect(self) -> None:
        super().connect()  # the TCP connection; HTTPS wraps it in TLS after this returns
        assert self.sock is not None and self.watchdog is not None
        self.watchdog.watch(self.sock)


class _WatchedSecure(http.client.HTTPSConnection, _Watched):
    """An HTTPS connection watched from its TCP connect on (the TLS handshake included)."""


# What do_open takes: typeshed's protocol for it is private to the stubs.
def _maker(kind: type[_Watched], watchdog: _Watchdog) -> Any:
    """What urllib's ``do_open`` calls for a connection: one of ``kind``, watched."""

    def make(*args: Any, **kwargs: Any) -> _Watched:  # urllib forwards any connection arguments
        connection = kind(*args, **kwargs)
        connection.watchdog = watchdog
        return connection

    return make


class _Handler(urllib.request.HTTPHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._make = _maker(_Watched, watchdog)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._make, req)


class _SecureHandler(urllib.request.HTTPSHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._make = _maker(_WatchedSecure, watchdog)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._make, req)  # the default TLS context: certificates checked


def fetch(
    url: str,
    *,
    timeout: float,
    max_bytes: int,
    data: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """The body of ``url`` (a POST of ``data`` when given), all of it within ``timeout``
    seconds and at most ``max_bytes`` long; :class:`FetchError` saying why otherwise."""
    request = urllib.request.Request(url, data=data, headers=dict(headers or {}))
    with _Watchdog(timeout) as watchdog:
        opener = urllib.request.build_opener(_Handler(watchdog), _SecureHandler(watchdog))
        try:
            return _read(opener, request, watchdog, max_bytes)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if isinstance(exc, urllib.error.HTTPError):
                exc.close()  # its answer is not read: let the connection go
            if watchdog.expired:  # whatever a cut connection raised, the deadline explains it
                raise FetchError(f"no answer within {timeout:g}s") from None
            raise FetchError(_why(exc, timeout), getattr(exc, "code", None)) from None


def _read(
    opener: urllib.request.OpenerDirector,
    request: urllib.request.Request,
    watchdog: _Watchdog,
    max_bytes: int,
) -> bytes:
    with opener.open(request, timeout=max(watchdog.deadline.remaining(), 0.001)) as response:
        body: bytes = response.read(max_bytes + 1)
    if watchdog.expired:  # the body was cut short by the deadline, not ended by the server
        raise FetchError(f"no answer within {watchdog.seconds:g}s")
    if len(body) > max_bytes:
        raise FetchError(f"the answer is over {max_bytes} bytes")
    return body


def _why(exc: Exception, timeout: float) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, urllib.error.URLError):
        return f"cannot connect: {exc.reason}"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__}: {exc})"
    return f"cannot read the answer: {exc}"
