"""The HTTP connection protocol: client limits, and ``POST /query`` answered on the connection.

uvicorn keeps a connection that never finishes its request headers open forever and accepts
any number of them (200 idle connections stayed open against the previous server). Its
httptools protocol is extended here by :class:`LimitedProtocol`: a connection must finish each
request's headers within ``header_timeout`` and in ``max_header_bytes``, and connections past
``max_connections`` are closed as soon as they are accepted.

``POST /query`` is answered by the protocol itself (:class:`FastQuery`): its body is gathered
from the parser's callbacks and the answer written from ``on_message_complete``, without an
ASGI task, receive/send messages or middleware. Those took about 130 us of the ~330 us of CPU
a kept-alive 8k-token query cost the server (docs/native.md, "/query on the connection"),
and every query pays them on the one thread that answers them all. The protections stay: the body is bounded in size (413, also by
its content-length) and in time (408), the bearer token is checked where reads need it, and
every refusal is counted as on the ASGI path. A request this path does not take on
(``Expect: 100-continue``, HTTP/1.0, a token that does not pass, a request pipelined behind
one the app still answers) goes to the app, where :class:`~kvevents.service.query.LeanQuery`
and the routes answer it as before.

Each request the app answers carries :data:`ABORT` in ``scope["extensions"]``: a call that
closes the connection mid-response (the front door's answer from an engine that broke off).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Literal

import msgspec
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from kvevents.service.access import TokenCheck
from kvevents.service.limits import (
    STATUS_FIELDS,
    HttpCounters,
    HttpLimits,
    body_timeout_error,
    too_large_error,
)
from kvevents.service.query import Reader
from kvevents.service.schema import BadRequest

__all__ = ["ABORT", "FastQuery", "LimitedProtocol"]

log = logging.getLogger("kvevents.service.protocol")

_TOO_LARGE_BODY = b'{"error": "request headers are over the limit"}'
_HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY)
)
_QUERY_PATH = b"/query"
#: The ASGI extension (in ``scope["extensions"]``) whose ``"close"`` closes the connection
#: mid-response: a proxy whose upstream broke after its answer began calls it, so the client
#: sees the answer incomplete. Returning an unfinished response does the same, but uvicorn then logs
#: an error of its own for what is not an error of the app.
ABORT = "kvevents.abort"
_encoder = msgspec.json.Encoder()

#: Where a connection is in a ``POST /query`` the protocol answers itself: not in one, reading
#: its body, or refused (the connection is closing; what is left of the request is dropped).
FastState = Literal["off", "body", "refused"]


@dataclass(frozen=True)
class FastQuery:
    """``POST /query`` answered synchronously: what the protocol needs from the app.

    ``count``: each refusal, by status; ``observe``: seconds each answered query took, from
    its body read to its answer encoded (as :class:`~kvevents.service.query.LeanQuery`).
    """

    reader: Reader
    auth: TokenCheck
    count: Callable[[int], None]
    observe: Callable[[float], None]

    def admits(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request may be answered here: it needs no token, or carries it (a
        request without it goes to the app, whose Guard refuses it)."""
        if not self.auth.required(False):
            return True
        given = next((v for k, v in headers if k == b"authorization"), None)
        return self.auth.accepts(given)

    def respond(self, body: bytes) -> tuple[int, bytes]:
        """(status, JSON payload) for a whole ``POST /query`` body."""
        try:
            began = perf_counter()
            payload = _encoder.encode(self.reader.answer(body))
            self.observe(perf_counter() - began)
            return 200, payload
        except BadRequest as exc:
            self.count(exc.status)
            return exc.status, _encoder.encode({"error": str(exc)})
        except Exception as exc:
            log.exception("POST /query failed")
            return 500, _encoder.encode({"error": f"internal error: {type(exc).__name__}"})


def _abort(cycle: RequestResponseCycle) -> None:
    """Close the connection of ``cycle``'s request, whose response will not be finished."""
    cycle.disconnected = True  # what uvicorn sets when the client leaves: nothing more is sent
    cycle.transport.close()


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # httptools has refused a content-length that is not a number
    return None


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size, a connection cap,
    and ``POST /query`` answered on the connection when ``fast`` is set.

    The settings come from the subclass :meth:`configured` makes.
    """

    limits: HttpLimits = HttpLimits()
    counters: HttpCounters = HttpCounters()
    fast: FastQuery | None = None

    @classmethod
    def configured(
        cls, limits: HttpLimits, counters: HttpCounters, fast: FastQuery | None = None
    ) -> type[LimitedProtocol]:
        attrs = {"limits": limits, "counters": counters, "fast": fast}
        return type("LimitedProtocol", (cls,), attrs)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._fast_state: FastState = "off"
        self._body: list[bytes] = []
        self._body_size = 0
        self._body_timer: asyncio.TimerHandle | None = None
        self._reading_held = False  # reading paused here until the client reads its answers
        if len(self.connections) > self.limits.max_connections:
            self.counters.add("connections_refused")
            transport.close()  # over the cap: refused before it costs more than the accept
            return
        self._arm()

    def _arm(self) -> None:
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.counters.add("header_timeouts")
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        armed = self._header_timer
        super().data_received(data)
        if self._fast_state == "body" and self._body_timer is None:
            # Armed once the data that completed the headers is parsed: a query whose body
            # came with its headers (the usual case) never needs the timer.
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)
        if self._header_timer is None or self._header_timer is not armed:
            return  # headers complete, or a request was answered and the next one's began
        # Headers still incomplete after this data, so all of it was request line and headers.
        self._header_bytes += len(data)
        if self._header_bytes > self.limits.max_header_bytes:
            self._disarm()
            self.counters.add("headers_too_large")
            self.transport.write(_HEADERS_TOO_LARGE)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm()
        if self._fast_state == "refused":
            return  # pipelined after a refused query: the connection is closing
        if self._takes_query():
            self._begin_query()
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade: a new request
            # An ASGI extension is a dict: this one holds the call that closes the connection.
            extensions = self.scope.setdefault("extensions", {})
            extensions[ABORT] = {"close": functools.partial(_abort, cycle)}

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._header_timer is None:
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._end_body()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ POST /query

    def _takes_query(self) -> bool:
        """Whether this request is a ``POST /query`` the protocol answers itself."""
        return (
            self.fast is not None
            and self.url == _QUERY_PATH
            and self.parser.get_method() == b"POST"
            and self.parser.get_http_version() == "1.1"
            and not self.expect_100_continue
            and not self.parser.should_upgrade()
            # A request pipelined behind one the app still answers waits its turn there.
            and (self.cycle is None or self.cycle.response_complete)
            and self.fast.admits(self.headers)
        )

    def _begin_query(self) -> None:
        self._fast_state = "body"
        declared = _declared_length(self.headers)
        if declared is not None and declared > self.limits.max_body_bytes:
            self._refuse(too_large_error(self.limits))

    def on_body(self, body: bytes) -> None:
        if self._fast_state == "off":
            super().on_body(body)
        elif self._fast_state == "body":
            self._body.append(body)
            self._body_size += len(body)
            if self._body_size > self.limits.max_body_bytes:
                self._refuse(too_large_error(self.limits))

    def on_message_complete(self) -> None:
        if self._fast_state == "off":
            super().on_message_complete()
            return
        if self._fast_state == "refused":
            return
        assert self.fast is not None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._end_body()
        status, payload = self.fast.respond(body)
        self._write(status, payload, close=not self.parser.should_keep_alive())
        self.on_response_complete()
        if self.flow.write_paused and not self.flow.read_paused:
            # The client is not reading its answers: read no more of its requests until it
            # does (the ASGI path waits for the drain the same way), or they pile up here.
            self._reading_held = True
            self.flow.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._reading_held:
            self._reading_held = False
            self.flow.resume_reading()

    def _body_late(self) -> None:
        self._body_timer = None
        if self._fast_state == "body" and not self.transport.is_closing():
            self._refuse(body_timeout_error(self.limits))

    def _refuse(self, exc: BadRequest) -> None:
        """Answer ``exc`` and close: the rest of the body is unread, the connection spent."""
        self._end_body()
        self._fast_state = "refused"
        name = STATUS_FIELDS.get(exc.status)
        if name is not None:
            self.counters.add(name)
        self._write(exc.status, _encoder.encode({"error": str(exc)}), close=True)
        self.server_state.total_requests += 1

    def _end_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body = []
        self._body_size = 0
        if self._fast_state == "body":
            self._fast_state = "off"

    def _write(self, status: int, payload: bytes, *, close: bool) -> None:
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(payload))
        if close:
            head.append(b"connection: close\r\n")
        head += [b"\r\n", payload]
        self.transport.write(b"".join(head))
        if close:
            self.transport.close()
