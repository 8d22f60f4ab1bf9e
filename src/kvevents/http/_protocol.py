"""The HTTP connection protocol: client limits, and ``POST /query`` answered on the connection.

uvicorn keeps a connection that never finishes its request headers open forever and accepts
any number of them (200 idle connections stayed open against the previous server). Its
httptools protocol is extended here by :class:`LimitedProtocol`: a connection must finish each
request's headers within ``header_timeout`` and in ``max_header_bytes`` (also while a response
is still being sent to it), must read what it is sent (``send_timeout``), and connections past
``max_connections`` are closed as soon as they are accepted.

Pipelined requests cost bounded memory and time. The parser takes whatever it is given, and
one read can hold thousands of small requests: before, 122 KB of pipelined queries were all
answered in one callback (+220 MB, every other connection stalled 7 s). Bytes read are parsed
a piece at a time (:mod:`._pieces`); parsing stops while answers wait to be written, the
client does not read them (the write buffer over its high-water mark) or the connection has had
its turn of the event loop (:data:`TURN_SECONDS`); reading stops while bytes wait to be parsed.
An offer to switch protocols (``Upgrade: h2c``, as ``curl --http2`` sends on plain HTTP) is
declined: the request is answered over HTTP/1.1, its body intact.

``POST /query`` is answered by the protocol itself, with the app's handler
(:class:`~._query.QueryHandler`): its body is gathered from the parser's callbacks and the
answer written from ``on_message_complete``, without an ASGI task, receive/send messages or
middleware. Those took about 130 us of the ~330 us of CPU a kept-alive 8k-token query cost the
server (docs/native.md, "/query on the connection"), and every query pays them on the one
thread that answers them all. The protections stay: the
body is bounded in size (413, also by its content-length) and in time (408), the bearer token
is checked where reads need it, and every refusal is counted as on the ASGI path. A request
this path does not take on (``Expect: 100-continue``, HTTP/1.0, a token that does not pass, a
request pipelined behind one the app still answers) goes to the app, whose ``/query`` route
answers it with the same handler; one pipelined behind answers of ours waits for them.

Each request the app answers carries :data:`ABORT` in ``scope["extensions"]``: ``"close"``,
a call that closes the connection mid-response (the front door's answer from an engine that
broke off); ``"on_disconnect"``, which takes a callback called once if the client goes
away before the response is complete (what a watcher task waiting for ``http.disconnect``
tells, without a task a request: the front door's watcher cost about 55 us of every request's
latency); and ``"hold_head"``, a call that holds the response's status line and headers until
the first piece of its body and writes them together (the front door's answers: one send and
one segment fewer each, about 45 us of the front door's CPU a streamed answer); and
``"hold_chunks"``, a call that holds pieces of a chunked body, each framed as one chunk, and
writes them with the body's next message (a proxy passing on every event an engine's answer
brought in one read: one write for all of them instead of one each, with the chunks the
engine sent).

The uvicorn internals this relies on are imported from :mod:`._uvicorn` only, which says what
they are and how the pinned versions are checked.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from time import perf_counter
from typing import Literal, cast

import httptools

from kvevents.http._errors import BadRequest
from kvevents.http._flow import HeldFlow
from kvevents.http._json import encode
from kvevents.http._limits import HttpCounters, HttpLimits, body_timeout_error, too_large_error
from kvevents.http._pieces import Unparsed
from kvevents.http._query import QueryHandler
from kvevents.http._uvicorn import HttpToolsProtocol, RequestResponseCycle
from kvevents.http._wire import (
    HEADERS_TOO_LARGE,
    declared_length,
    head_without_upgrade,
    json_response_bytes,
)

__all__ = ["ABORT", "TURN_SECONDS", "LimitedProtocol"]

_QUERY_PATH = b"/query"
#: The ASGI extension (in ``scope["extensions"]``) whose ``"close"`` closes the connection
#: mid-response: a proxy whose upstream broke after its answer began calls it, so the client
#: sees the answer incomplete (returning an unfinished response does the same, but uvicorn
#: then logs an error of its own for what is not an error of the app); ``"on_disconnect"``
#: takes a callback called once if the connection is lost before the response is complete;
#: ``"hold_head"`` holds the response's head until the first piece of its body, written with it;
#: ``"hold_chunks"`` takes pieces of a chunked body written, each as one chunk, with the next
#: body message (False where it cannot: a body not chunked, a head or chunks still held).
ABORT = "kvevents.abort"
#: Seconds of the event loop one connection may take before the others get theirs: it answers
#: and parses on for this long, then the rest waits for the loop's next turn.
TURN_SECONDS = 0.005


class _AnswersWaiting:
    """What stands in for a request in flight while answers of ours wait (see _to_app)."""

    response_complete = False


# Typed as what it stands in for: uvicorn only reads its response_complete.
_ANSWERS_WAITING = cast("RequestResponseCycle", _AnswersWaiting())

#: Where a connection is in a ``POST /query`` the protocol answers itself: not in one, reading
#: its body, or refused (the connection is closing; what is left of the request is dropped).
FastState = Literal["off", "body", "refused"]


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size, a send deadline, a
    connection cap, pipelining within bounds, and ``POST /query`` answered on the connection
    when ``query`` is set.

    Bytes read are parsed :data:`~._pieces.PARSE_PIECE` at a time, and parsing stops while answers wait
    to be written: behind a request the app still answers (uvicorn's pipeline), behind answers
    of ours not yet written, while the write buffer is over its high-water mark (the client
    does not read), or once the connection has had :data:`TURN_SECONDS` of this turn of the
    event loop. Reading stops while bytes wait to be parsed. The settings come from the
    subclass :meth:`configured` makes.
    """

    limits: HttpLimits = HttpLimits()
    counters: HttpCounters = HttpCounters()
    query: QueryHandler | None = None

    @classmethod
    def configured(
        cls, limits: HttpLimits, counters: HttpCounters, query: QueryHandler | None = None
    ) -> type[LimitedProtocol]:
        """The protocol class for a server: uvicorn makes one instance per connection, with
        its own arguments only, so the settings are class attributes of a subclass."""
        attrs = {"limits": limits, "counters": counters, "query": query}
        return type("LimitedProtocol", (cls,), attrs)

    # uvicorn declares the transport an asyncio.Transport, asyncio's Protocol a BaseTransport:
    # a stream server only ever hands a Transport.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow: HeldFlow = HeldFlow(transport)
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._in_message = False  # the parser is inside a request (between its begin and end)
        self._in_headers = False  # ... and inside its request line and headers
        self._messages_begun = 0
        self._body_left = 0  # bytes of the request's declared body not parsed yet
        self._unparsed = Unparsed()
        self._waiting: deque[Callable[[], None]] = deque()  # our answers, to write in order
        self._next_turn: asyncio.Handle | None = None
        self._turn_began = 0.0
        self._replay: bytes | None = None  # a request's head again, without its upgrade offer
        self._fast_state: FastState = "off"
        # The app's callback for the request whose client may go away (on_disconnect).
        self._watch: tuple[RequestResponseCycle, Callable[[], None]] | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._body_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            self.counters.connections_refused += 1
            transport.close()  # over the cap: refused before it costs more than the accept
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._end_body()
        for timer in (self._send_timer, self._next_turn):
            if timer is not None:
                timer.cancel()
        self._drop_pending()
        super().connection_lost(exc)
        watch, self._watch = self._watch, None
        if watch is not None and not watch[0].response_complete:
            watch[1]()

    # ------------------------------------------------------------------ reading in turns

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._unparsed.add(data)
        self._turn()

    def _scheduled_turn(self) -> None:
        self._next_turn = None
        self._turn()

    def _turn(self) -> None:
        """This connection's turn of the event loop: write the answers waiting, then parse
        on, while nothing stops it (see the class); the rest waits for a later turn."""
        self._turn_began = perf_counter()
        if self._waiting:
            self._write_waiting()
        first = True  # one piece at least, whatever the time: every turn gets on
        while self._unparsed and self._may_parse(first):
            first = False
            self._parse(self._unparsed.take(self._body_left, not self._in_message))
        self._settle()

    def _over_time(self) -> bool:
        return perf_counter() - self._turn_began > TURN_SECONDS

    def _may_parse(self, first: bool) -> bool:
        return not (
            self._waiting
            or self.pipeline
            or self.flow.write_paused
            or self.transport.is_closing()
            or (not first and self._over_time())
        )

    def _parse(self, piece: bytes | memoryview) -> None:
        begun, between = self._messages_begun, not self._in_message
        self._feed(piece)
        if self._in_headers and not self.transport.is_closing():
            # All of the piece is request line and headers if it began in them, or began
            # between requests and only one began in it. Else the bytes before this request
            # are unknown, and the piece counts as none: the limit holds within a piece.
            whole = begun == self._messages_begun or (between and self._messages_begun == begun + 1)
            self._count_header_bytes(len(piece) if whole else 0)

    def _feed(self, data: bytes | memoryview) -> None:
        """uvicorn's parse of ``data``, except that an offer to switch protocols (``Upgrade:
        h2c``) is declined: the request is parsed again without it and answered over
        HTTP/1.1, its body and what follows it intact (RFC 9110 7.8: a server may ignore it)."""
        pending = [data]
        while pending:
            chunk = pending.pop()
            try:
                self.parser.feed_data(chunk)
            except httptools.HttpParserError:
                self.logger.warning("Invalid HTTP request received.")
                self._end_with(partial(self.send_400_response, "Invalid HTTP request received."))
                return
            except httptools.HttpParserUpgrade as upgrade:
                head, self._replay = self._replay, None
                if head is None:  # a WebSocket uvicorn takes, or CONNECT: uvicorn's way
                    self._upgrade_not_declined()
                    return
                pending += [memoryview(chunk)[upgrade.args[0] :], head]

    def _upgrade_not_declined(self) -> None:
        # What follows the request is another protocol's (uvicorn drops it): not parsed.
        self._unparsed.clear()
        if self._should_upgrade():
            self._drop_pending()  # the connection is the WebSocket protocol's from here
            self.handle_websocket_upgrade()
        else:
            self.logger.warning("Unsupported upgrade request.")

    def _settle(self) -> None:
        """After a turn: hold reading while anything waits, and come back for it."""
        if self.transport.is_closing():
            self._drop_pending()
            return
        flow = self.flow
        if self._unparsed or self._waiting or flow.write_paused or flow.held:
            self._hold_or_release()
        if self._fast_state == "body" and not self._unparsed and self._body_timer is None:
            # Armed once the bytes read are parsed: a query whose body came with its headers
            # (the usual case) never needs the timer.
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)

    def _hold_or_release(self) -> None:
        pending = bool(self._unparsed or self._waiting)
        self.flow.hold(pending or self.flow.write_paused)
        # Waiting for the client to read, or for the app's answer, calls a turn when it ends.
        blocked = self.flow.write_paused or (bool(self.pipeline) and not self._waiting)
        if pending and not blocked:
            self._schedule_turn()

    def _schedule_turn(self) -> None:
        if self._next_turn is None:
            self._next_turn = self.loop.call_soon(self._scheduled_turn)

    def _drop_pending(self) -> None:
        self._unparsed.clear()
        self._waiting.clear()

    # ------------------------------------------------------------------ writing

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self._unparsed or self._waiting:
            self._schedule_turn()
        else:
            self.flow.hold(False)

    def _send_late(self) -> None:
        """The client has read nothing for send_timeout: drop what it was sent, and it."""
        self._send_timer = None
        if not self.transport.is_closing():
            self.counters.send_timeouts += 1
        self.transport.abort()

    def _write_waiting(self) -> None:
        """Write the answers waiting, in order, until the client stops reading or the turn
        is up (one at least, so that every turn gets on)."""
        while self._waiting and not self.flow.write_paused and not self.transport.is_closing():
            self._waiting.popleft()()
            if self._over_time():
                return

    def _over_budget(self) -> bool:
        """Whether the next answer must wait: the client is not reading, or the turn is up."""
        return self.flow.write_paused or self._over_time()

    def _in_order(self, answer: Callable[[], None]) -> None:
        """Write ``answer`` now, or after the answers waiting before it."""
        if self._waiting or self._over_budget():
            self._waiting.append(answer)
        else:
            answer()

    def on_response_complete(self) -> None:
        """An app's response ended (uvicorn starts the next request of its pipeline)."""
        super().on_response_complete()
        if self.transport.is_closing():
            return
        self._after_response()
        if self._unparsed and not self.pipeline:
            self._schedule_turn()  # parsing stopped behind this response: go on

    def _answered(self) -> None:
        """One of our answers was written: counted as uvicorn counts its responses."""
        if self.pipeline and not self._waiting:
            # The last answer an app request was queued behind (see _to_app): uvicorn counts
            # it and starts that request, as after a response of its own.
            super().on_response_complete()
        else:
            self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self._after_response()

    def _after_response(self) -> None:
        busy = self._in_message or self._unparsed or self._waiting or self._app_answering()
        if busy or self.pipeline:
            # The client's next requests are here already: not idle, no keep-alive deadline.
            self._unset_keepalive_if_required()
            return
        if self.timeout_keep_alive_task is None:  # uvicorn's, armed as it arms it
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
        if self._header_timer is None:
            self._arm()  # the next request on this connection gets its own deadline

    # ------------------------------------------------------------------ header limits

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._unparsed or self.flow.read_paused:  # waiting for us, not for the client
            self._arm()
            return
        self.counters.header_timeouts += 1
        self._cut_off()

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self._disarm()
            self.counters.headers_too_large += 1
            self._end_with(partial(self._write_and_close, HEADERS_TOO_LARGE))

    def _end_with(self, refusal: Callable[[], None]) -> None:
        """Parse no more; write ``refusal`` (which closes the connection) after the answers
        waiting before it, or cut the connection off if the app is answering."""
        self._unparsed.clear()
        self._fast_state = "refused"
        if self._app_answering():
            self.transport.abort()
        else:
            self._in_order(refusal)

    def _write_and_close(self, response: bytes) -> None:
        self.transport.write(response)
        self.transport.close()

    def _app_answering(self) -> bool:
        """Whether the app has a request in hand whose response is not complete."""
        return self.cycle is not None and not self.cycle.response_complete

    def _cut_off(self) -> None:
        """Close the connection; at once if the app is answering, for a response cut short
        is no use and nothing else may be written in its place."""
        if self._app_answering():
            self.transport.abort()
        else:
            self.transport.close()

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._messages_begun += 1
        self._in_message = self._in_headers = True
        self._header_bytes = 0
        self._unset_keepalive_if_required()
        if self._header_timer is None:
            # A request begun while the previous response is still being sent gets its
            # deadline too (otherwise it could send headers for as long as that takes).
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_headers = False
        self._body_left = declared_length(self.headers) or 0
        if self.transport.is_closing():
            self._fast_state = "refused"  # after a Connection: close answer: nothing more
        if self._fast_state == "refused":
            return  # pipelined after a refused query: the connection is closing
        if self.parser.should_upgrade() and self._declines_upgrade():
            self._replay = self._head_without_upgrade()
            return  # the parser stops here; _feed parses the request again
        if self._takes_query():
            self._begin_query()
            return
        self._to_app()

    def _to_app(self) -> None:
        """Hand the request to uvicorn. While answers of ours wait to be written it must wait
        for them, so they stand in for a request in flight: uvicorn queues this one behind
        them, as behind one of its own (its pipeline), and _answered starts it."""
        previous = self.cycle
        if self._waiting:
            self.cycle = _ANSWERS_WAITING
        super().on_headers_complete()
        if self.cycle is _ANSWERS_WAITING:  # it took no request (a WebSocket upgrade)
            self.cycle = previous
            return
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade: a new request
            # An ASGI extension is a dict: this one holds the call that closes the connection.
            extensions = self.scope.setdefault("extensions", {})
            extensions[ABORT] = {
                "close": functools.partial(_abort, cycle),
                "on_disconnect": functools.partial(self._on_disconnect, cycle),
                "hold_head": functools.partial(_hold_head, cycle),
                "hold_chunks": functools.partial(_hold_chunks, cycle),
            }

    def _on_disconnect(self, cycle: RequestResponseCycle, callback: Callable[[], None]) -> None:
        """Call ``callback`` once if the connection is lost before ``cycle``'s response is
        complete (one request at a time: the latest one's callback)."""
        self._watch = (cycle, callback)

    def on_body(self, body: bytes) -> None:
        if self._body_left:  # a declared length (a chunked body has none)
            self._body_left -= len(body)
        if self._fast_state == "off":
            super().on_body(body)
        elif self._fast_state == "body":
            self._body.append(body)
            self._body_size += len(body)
            if self._body_size > self.limits.max_body_bytes:
                self._refuse(too_large_error(self.limits))

    def on_message_complete(self) -> None:
        self._in_message = False
        self._body_left = 0
        if self._replay is not None:
            return  # the upgrade offer's message, parsed again without it
        if self._fast_state == "off":
            super().on_message_complete()
            return
        if self._fast_state == "refused":
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._end_body()
        close = not self.parser.should_keep_alive()
        if self._waiting or self._over_budget():
            self._waiting.append(partial(self._answer, body, close))
        else:
            self._answer(body, close)

    # ------------------------------------------------------------------ upgrade offers

    def _declines_upgrade(self) -> bool:
        """Whether the request's ``Upgrade`` offer is declined: anything but a WebSocket
        uvicorn can run (and CONNECT, a tunnel rather than an offer, which uvicorn takes)."""
        return self.parser.get_method() != b"CONNECT" and not self._should_upgrade()

    def _head_without_upgrade(self) -> bytes:
        method, version = self.parser.get_method(), self.parser.get_http_version()
        return head_without_upgrade(method, self.url, version, self.headers)

    # ------------------------------------------------------------------ POST /query

    def _takes_query(self) -> bool:
        """Whether this request is a ``POST /query`` the protocol answers itself."""
        return (
            self.query is not None
            and self.url == _QUERY_PATH
            and self.parser.get_method() == b"POST"
            and self.parser.get_http_version() == "1.1"
            and not self.expect_100_continue
            and not self.parser.should_upgrade()
            # A request pipelined behind one the app still answers waits its turn there.
            and (self.cycle is None or self.cycle.response_complete)
            and self.query.admits(self.headers)
        )

    def _begin_query(self) -> None:
        self._fast_state = "body"
        if self._body_left > self.limits.max_body_bytes:
            self._refuse(too_large_error(self.limits))

    def _answer(self, body: bytes, close: bool) -> None:
        assert self.query is not None
        status, payload = self.query.respond(body)
        self._write(status, payload, close=close)
        self._answered()

    def _body_late(self) -> None:
        self._body_timer = None
        if self._fast_state != "body" or self.transport.is_closing():
            return
        if self._unparsed or self.flow.read_paused:  # waiting for us, not for the client
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)
            return
        self._turn_began = perf_counter()  # a turn of its own: the refusal may be written now
        self._refuse(body_timeout_error(self.limits))
        self._settle()

    def _refuse(self, exc: BadRequest) -> None:
        """Answer ``exc`` and close: the rest of the body is unread, the connection spent."""
        self._end_body()
        self._fast_state = "refused"
        self.counters.refused(exc.status)
        self.server_state.total_requests += 1
        payload = encode(exc.payload())
        self._in_order(partial(self._write, exc.status, payload, close=True))

    def _end_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body = []
        self._body_size = 0
        if self._fast_state == "body":
            self._fast_state = "off"

    def _write(self, status: int, payload: bytes, *, close: bool) -> None:
        if self.transport.is_closing():
            return  # after a Connection: close answer, or a cut-off
        default_headers = self.server_state.default_headers
        self.transport.write(json_response_bytes(status, payload, default_headers, close=close))
        if close:
            self.transport.close()


class _Held:
    """What stands in for a response's transport while bytes are held for its next write.

    For ``hold_head`` (``held`` None): the status line and headers (uvicorn writes them on
    ``http.response.start``) are held and written with the first piece of the body (its next
    write) in one write, so that a proxy's answer reaches its client as one segment instead of
    two (one send, one wake-up of the client fewer). For ``hold_chunks``: the chunks given go
    with the body's next write. Then the response's own transport is back. Closed before
    that, it writes what it holds first, as the connection would have had it."""

    def __init__(self, cycle: RequestResponseCycle, held: bytes | None = None) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._held = held

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = data
            return
        self._cycle.transport = self._transport
        self._transport.write(self._held + data)

    def close(self) -> None:
        self._cycle.transport = self._transport
        if self._held is not None:
            self._transport.write(self._held)
        self._transport.close()

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)


def _hold_head(cycle: RequestResponseCycle) -> None:
    """Hold ``cycle``'s response head until its body's first write (see :class:`_Held`);
    not for a HEAD request, whose body uvicorn never writes, nor once the head is out."""
    if cycle.scope["method"] == "HEAD" or cycle.response_started:
        return
    if not isinstance(cycle.transport, _Held):
        cycle.transport = cast("asyncio.Transport", _Held(cycle))


def _hold_chunks(cycle: RequestResponseCycle, pieces: Sequence[bytes]) -> bool:
    """Hold ``pieces``, each framed as one chunk of ``cycle``'s chunked body, for the body's
    next write (the app's next ``http.response.body`` message: it must send one). False, and
    nothing held, unless the head is out, the body chunked and not ended, nothing else held."""
    if (
        not cycle.response_started
        or not cycle.chunked_encoding
        or cycle.response_complete
        or cycle.disconnected
        or isinstance(cycle.transport, _Held)
    ):
        return False
    framed: list[bytes] = []
    for piece in pieces:
        if piece:  # an empty chunk would end the body
            framed += (b"%x\r\n" % len(piece), piece, b"\r\n")
    cycle.transport = cast("asyncio.Transport", _Held(cycle, b"".join(framed)))
    return True


def _abort(cycle: RequestResponseCycle) -> None:
    """Close the connection of ``cycle``'s request, whose response will not be finished."""
    cycle.disconnected = True  # what uvicorn sets when the client leaves: nothing more is sent
    cycle.transport.close()
