"""What one HTTP client may cost the service: bytes, seconds, connections.

:class:`HttpLimits` is the configuration; :func:`read_body` reads a request body within it.
Without these a client that opens connections and never finishes its headers (slowloris),
or sends an endless body, holds sockets and memory for as long as it likes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from dataclasses import dataclass

from starlette.types import Receive, Scope

from kvevents.http._errors import BadRequest

__all__ = [
    "STATUS_FIELDS",
    "HttpCounters",
    "HttpLimits",
    "HttpStats",
    "body_timeout_error",
    "read_body",
    "too_large_error",
]


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on every HTTP client (``kvevents serve`` options of the same names).

    ``max_body_bytes``: the largest request body (413 above it; a 128k-token query is about
    1 MB of JSON). ``header_timeout``: seconds a connection may take to send a request's
    headers, from when it opens or its previous response ends; it is closed after that.
    ``body_timeout``: seconds a request may take to send its whole body (408).
    ``max_connections``: open connections; more are closed as soon as they are accepted.
    ``max_header_bytes``: bytes of request line and headers (431 above it; counted as they
    arrive, in steps of at most 64 KiB). ``send_timeout``: seconds a response may wait for the
    client to read it: once the connection's write buffer has stayed over its high-water mark
    that long, the connection is closed (a ``GET /dump`` nobody reads is abandoned, and the
    next dump may start).
    """

    max_body_bytes: int = 8 << 20
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 256
    max_header_bytes: int = 64 << 10
    send_timeout: float = 30.0

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_connections, self.max_header_bytes) < 1:
            raise ValueError("max_body_bytes, max_connections and max_header_bytes must be >= 1")
        if not min(self.header_timeout, self.body_timeout, self.send_timeout) > 0:
            raise ValueError("header_timeout, body_timeout and send_timeout must be > 0")


@dataclass(frozen=True)
class HttpStats:
    """What the HTTP side refused or cut off, by kind (``kvevents_http_*`` metrics)."""

    bad_requests: int = 0  #: requests refused with 400 (malformed, out of range, layout rule)
    unauthorized: int = 0  #: requests refused with 401 (no or wrong bearer token)
    forbidden_endpoints: int = 0  #: registrations refused with 403 (endpoint host not allowed)
    not_found: int = 0  #: requests for an unknown route or with a wrong method (404, 405)
    body_timeouts: int = 0  #: requests whose body did not arrive in time (408)
    bodies_too_large: int = 0  #: requests whose body was over the size limit (413)
    headers_too_large: int = 0  #: connections whose request headers were over the limit (431)
    header_timeouts: int = 0  #: connections closed for not sending request headers in time
    connections_refused: int = 0  #: connections closed at accept, over the connection cap
    send_timeouts: int = 0  #: connections closed for not reading a response within send_timeout


class HttpCounters:
    """The running counts behind :class:`HttpStats`; shared by the app and the server.

    Incremented on the event loop thread; :meth:`stats` may be called from any thread.
    """

    def __init__(self) -> None:
        self._counts = {f.name: 0 for f in dataclasses.fields(HttpStats)}
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        """Count one ``name`` (a field of :class:`HttpStats`)."""
        with self._lock:
            self._counts[name] += 1

    def refused(self, status: int) -> None:
        """Count a request refused with ``status``, under its field (:data:`STATUS_FIELDS`;
        a status without one is not counted)."""
        name = STATUS_FIELDS.get(status)
        if name is not None:
            self.add(name)

    def stats(self) -> HttpStats:
        with self._lock:
            return HttpStats(**self._counts)


#: The HttpStats field counting each refusal status of a request.
STATUS_FIELDS = {
    400: "bad_requests",
    401: "unauthorized",
    403: "forbidden_endpoints",
    404: "not_found",
    405: "not_found",
    408: "body_timeouts",
    413: "bodies_too_large",
}


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise BadRequest("content-length is not a number") from None
    return None


async def read_body(scope: Scope, receive: Receive, limits: HttpLimits) -> bytes | None:
    """The whole request body; None if the client went away first.

    BadRequest 413 when the body is (or says it will be) over ``max_body_bytes``, 408 when it
    does not arrive within ``body_timeout``: checked while reading, not after.
    """
    declared = _declared_length(scope)
    if declared is not None and declared > limits.max_body_bytes:
        raise too_large_error(limits)
    # One timer per request that cancels the read, not a wait_for per message: this is the
    # hot path of /query, and wait_for costs a task each time.
    task = asyncio.current_task()
    expired: list[bool] = []

    def expire() -> None:
        expired.append(True)
        if task is not None:
            task.cancel()

    timer = asyncio.get_running_loop().call_later(limits.body_timeout, expire)
    try:
        return await _read_all(receive, limits)
    except asyncio.CancelledError:
        if not expired:
            raise
        if sys.version_info >= (3, 11) and task is not None:
            task.uncancel()  # our own cancel, consumed here: the task goes on
        raise body_timeout_error(limits) from None
    finally:
        timer.cancel()


async def _read_all(receive: Receive, limits: HttpLimits) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise too_large_error(limits)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def too_large_error(limits: HttpLimits) -> BadRequest:
    """The 413 of a body over ``max_body_bytes``."""
    return BadRequest(f"the request body is over the limit of {limits.max_body_bytes} bytes", 413)


def body_timeout_error(limits: HttpLimits) -> BadRequest:
    """The 408 of a body that did not arrive within ``body_timeout``."""
    return BadRequest(f"the request body did not arrive within {limits.body_timeout:g} s", 408)
