"""``POST /query`` answered on the connection (kvevents.http._protocol): the same answers and
refusals as the app's path, kept-alive and pipelined connections, and every limit kept."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from kvevents.http import (
    AppOptions,
    HttpCounters,
    HttpLimits,
    LimitedProtocol,
    Server,
    TokenCheck,
    create_app,
    serve,
)
from kvevents.http import _protocol as protocol_module
from kvevents.http._pieces import PARSE_PIECE, Unparsed
from kvevents.http._server import _query_handler_of
from kvevents.index import PrefixIndex
from kvevents.service import IndexService
from kvevents.testing.feeds import FakeFeed, fake_specs
from kvevents.testing.index import batch, store_event
from kvevents.testing.sockets import wait_for

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks
LOCAL = "tcp://127.0.0.1:6000"

LIMITS = HttpLimits(max_body_bytes=64 << 10, body_timeout=0.5, max_header_bytes=8 << 10)
QUERY = json.dumps({"token_ids": PROMPT}).encode()
TOKEN = "t0ken"


def _running(options: AppOptions) -> Server:
    feed = FakeFeed()
    service = IndexService(PrefixIndex(), feed=feed, stream_specs=fake_specs)
    server = serve("127.0.0.1", 0, service=service, options=options)
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        headers = {"authorization": f"Bearer {TOKEN}"}
        body = {"worker_id": "w", "endpoint": LOCAL, "block_size": BS}
        assert client.post("/register", json=body, headers=headers).status_code == 200
        feed.deliver("w", 0, batch(store_event(PROMPT, BS)))

        def indexed() -> bool:
            reply = client.post("/query", content=QUERY, headers=headers)
            return bool(reply.status_code == 200 and reply.json()["scores"].get("w"))

        wait_for(indexed, 10.0, interval=0.01, what="the worker's blocks")
    return server


@pytest.fixture
def server() -> Iterator[Server]:
    with _running(AppOptions(limits=LIMITS)) as running:
        yield running


def _request(body: bytes, *, version: str = "1.1", extra: str = "") -> bytes:
    head = f"POST /query HTTP/{version}\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def _response(reader: IO[bytes]) -> tuple[int, dict[str, str], bytes]:
    """One response from ``reader``: (status, lower-cased headers, body)."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().strip()) != b"":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers["content-length"]))


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10.0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def test_the_answer_is_the_apps_answer(server: Server) -> None:
    """A query answered on the connection (HTTP/1.1) gets the same status, content type and
    JSON as one the app answers (HTTP/1.0 goes there)."""
    answers = []
    for version in ("1.1", "1.0"):
        with _connect(server) as sock, sock.makefile("rb") as reader:
            sock.sendall(_request(QUERY, version=version))
            status, headers, body = _response(reader)
            assert status == 200 and headers["content-type"] == "application/json"
            answers.append(json.loads(body))
    assert answers[0]["scores"] == answers[1]["scores"] == {"w": {"0": len(PROMPT) // BS}}
    assert answers[0].keys() == answers[1].keys()


def test_pipelined_queries_are_answered_in_order_on_one_connection(server: Server) -> None:
    """Queries sent back to back in one write, a bad one among them, are answered in order and
    the connection stays open after the 400; bodies past max_header_bytes are not mistaken
    for headers of the next request."""
    big = json.dumps({"token_ids": PROMPT + [1] * 3000}).encode()  # > 8 KB of body
    assert len(big) > LIMITS.max_header_bytes
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(_request(big) + _request(b"{") + _request(QUERY) + _request(big))
        statuses = [_response(reader)[0] for _ in range(4)]
        assert statuses == [200, 400, 200, 200]
        sock.sendall(_request(QUERY))
        assert _response(reader)[0] == 200


def test_app_requests_pipelined_among_queries_are_answered_in_order(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests for the app pipelined among queries the protocol answers (which here wait a
    turn of the event loop each) get their answers in the order they were sent."""
    monkeypatch.setattr(protocol_module, "TURN_SECONDS", 0.0)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    sent = [_request(QUERY)] * 5 + [health, _request(QUERY), _request(b"{"), health]
    sent += [_request(QUERY)] * 3
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(b"".join(sent))
        replies = [_response(reader) for _ in sent]
    kinds = ["health" if "status" in json.loads(body) else s for s, _, body in replies]
    assert kinds == [200] * 5 + ["health", 200, 400, "health", 200, 200, 200]


@pytest.mark.parametrize("path", ["/query", "/register", "/health"])
def test_an_offer_to_upgrade_is_declined_and_the_request_answered(
    server: Server, path: str
) -> None:
    """A request offering to switch to h2c (``curl --http2`` on plain HTTP) is answered over
    HTTP/1.1 as if it made no offer, its body intact, and what is pipelined after it too."""
    offer = (
        "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    )
    register = {"worker_id": "u", "endpoint": "tcp://127.0.0.1:7000", "block_size": BS}
    body = json.dumps(register).encode() if path == "/register" else QUERY
    method = "GET" if path == "/health" else "POST"
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{offer}\r\n"
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(head.encode() + body + _request(QUERY))
        status, headers, reply = _response(reader)
        assert status == 200, reply
        assert "upgrade" not in headers and "upgrade" not in headers.get("connection", "")
        assert _response(reader)[0] == 200
    if path == "/query":
        assert json.loads(reply)["scores"] == {"w": {"0": len(PROMPT) // BS}}


def test_a_bad_query_says_why(server: Server) -> None:
    """Out-of-range tokens are a 400 naming the token and where it is."""
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(_request(b'{"token_ids": [1, 2, -5]}'))
        status, _, body = _response(reader)
    assert status == 400
    assert json.loads(body)["error"] == (
        "/query: token id -5 at `$.token_ids[2]` is outside 0..4294967295"
    )


def test_connection_close_is_honoured(server: Server) -> None:
    """A query asking for ``Connection: close`` gets its answer, then the connection ends."""
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(_request(QUERY, extra="Connection: close\r\n"))
        status, headers, _ = _response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert reader.read() == b""


def test_an_oversized_declared_body_is_refused_before_it_is_sent(server: Server) -> None:
    """A content-length over the limit is a 413 at once (no body sent), the connection
    closed, and a pipelined query after it is not answered."""
    head = f"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMITS.max_body_bytes + 1}\r\n\r\n"
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(head.encode())
        status, headers, body = _response(reader)
        assert status == 413 and headers["connection"] == "close"
        assert "over the limit of 65536 bytes" in json.loads(body)["error"]
        assert reader.read() == b""


def test_a_slow_body_is_cut_off_mid_way(server: Server) -> None:
    """A body that stops arriving after its first bytes is a 408 once body_timeout passes."""
    with _connect(server) as sock, sock.makefile("rb") as reader:
        sock.sendall(_request(QUERY)[: -len(QUERY) + 5])
        status, _, body = _response(reader)
        assert status == 408 and "did not arrive within 0.5 s" in json.loads(body)["error"]
        assert reader.read() == b""


def test_reads_behind_a_token_need_it_on_this_path_too() -> None:
    """With reads protected, a query without the token is a 401 and one with it answered."""
    options = AppOptions(auth=TokenCheck(TOKEN, protect_reads=True), limits=LIMITS)
    with _running(options) as running, _connect(running) as sock, sock.makefile("rb") as reader:
        sock.sendall(_request(QUERY))
        assert _response(reader)[0] == 401
        sock.sendall(_request(QUERY, extra=f"Authorization: Bearer {TOKEN}\r\n"))
        assert _response(reader)[0] == 200
        sock.sendall(_request(QUERY, extra="Authorization: Bearer wrong\r\n"))
        assert _response(reader)[0] == 401


def test_answered_queries_feed_the_latency_histogram(server: Server) -> None:
    """Each query answered on the connection is observed in kvevents_query_duration_seconds,
    and each refusal counted in kvevents_http_*."""

    def counts(client: httpx.Client) -> dict[str, float]:
        lines = client.get("/metrics").text.splitlines()
        return {
            line.split()[0]: float(line.split()[1])
            for line in lines
            if line.startswith("kvevents_")
        }

    with httpx.Client(base_url=server.url, timeout=10.0) as client, _connect(server) as sock:
        before = counts(client)
        with sock.makefile("rb") as reader:
            sock.sendall(_request(QUERY) + _request(QUERY) + _request(b"[]"))
            assert [_response(reader)[0] for _ in range(3)] == [200, 200, 400]
        after = counts(client)
    name = "kvevents_query_duration_seconds_count"
    assert after[name] - before[name] == 2
    bad = "kvevents_http_bad_requests_total"
    assert after[bad] - before[bad] == 1


class _Transport(asyncio.Transport):
    """A transport recording what the protocol does to it. ``stalled``: its peer reads
    nothing, so every write fills the buffer past its mark; :meth:`drain`: the peer read it."""

    def __init__(self, protocol: asyncio.Protocol, *, stalled: bool = False) -> None:
        super().__init__()
        self.protocol = protocol
        self.stalled = stalled
        self.written: list[bytes] = []
        self.reading = True
        self.closed = False
        self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))
        if self.stalled:
            self.protocol.pause_writing()

    def drain(self) -> None:
        self.protocol.resume_writing()

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def statuses(self) -> list[int]:
        """The status of each response written so far."""
        return [int(w.split()[1]) for w in self.written if w.startswith(b"HTTP/1.1 ")]


async def _connected(
    app: Any = None,
    limits: HttpLimits = LIMITS,
    *,
    stalled: bool = False,
    keep_alive: float = 5,
) -> tuple[LimitedProtocol, _Transport, HttpCounters]:
    """A protocol on a :class:`_Transport`, for ``app`` (default: the service's, empty)."""
    if app is None:
        app = create_app(IndexService(PrefixIndex(), feed=FakeFeed(), stream_specs=fake_specs))
    counters = HttpCounters()
    query = _query_handler_of(app) if hasattr(app, "state") else None  # plain ASGI app: none
    cls = LimitedProtocol.configured(limits, counters, query)
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=keep_alive,  # type: ignore[arg-type]
    )
    protocol = cls(config=config, server_state=ServerState(), app_state={})
    transport = _Transport(protocol, stalled=stalled)
    protocol.connection_made(transport)
    return protocol, transport, counters


async def _turns(count: int = 5) -> None:
    """Let the event loop run ``count`` times."""
    for _ in range(count):
        await asyncio.sleep(0)


async def _unfinished_response(scope: Any, receive: Any, send: Any) -> None:
    """An app that starts its response and never ends it (a long dump, say)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.Event().wait()


def test_a_client_that_reads_no_answers_is_read_no_further() -> None:
    """Pipelined queries are answered while the client reads: once an answer fills the write
    buffer, no more are answered or read until it drains, then they go on in order."""

    async def run() -> None:
        protocol, transport, _ = await _connected(stalled=True)
        protocol.data_received(_request(QUERY) * 3)
        assert transport.statuses() == [200]
        assert not transport.reading
        for answered in (2, 3):
            transport.drain()
            await _turns()
            assert transport.statuses() == [200] * answered
            assert not transport.reading
        transport.stalled = False
        transport.drain()
        assert transport.reading
        protocol.connection_lost(None)

    asyncio.run(run())


def test_a_pipelined_flood_lets_the_event_loop_run_between_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pipelined queries are answered a turn of the event loop at a time (here: one a turn),
    so that other connections' callbacks run in between; all are answered, in order."""
    monkeypatch.setattr(protocol_module, "TURN_SECONDS", 0.0)

    async def run() -> None:
        protocol, transport, _ = await _connected()
        protocol.data_received(_request(QUERY) * 20 + _request(b"[]"))
        seen: list[int] = []
        asyncio.get_running_loop().call_soon(lambda: seen.append(len(transport.statuses())))
        for _ in range(100):
            if len(transport.statuses()) == 21:
                break
            await asyncio.sleep(0)
        assert seen and seen[0] < 5, seen
        assert transport.statuses() == [200] * 20 + [400]
        assert transport.reading
        protocol.connection_lost(None)

    asyncio.run(run())


def test_limits_hold_while_the_app_answers() -> None:
    """While a response of the app's is still being sent, the next request's headers are
    bound by the size limit and the deadline too: the connection is cut off (no 431 in the
    middle of that response), and each is counted."""
    limits = HttpLimits(max_header_bytes=8 << 10, header_timeout=0.1)

    async def run() -> None:
        protocol, transport, counters = await _connected(_unfinished_response, limits)
        protocol.data_received(b"GET /dump HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns()
        assert transport.statuses() == [200]
        protocol.data_received(b"GET /health HTTP/1.1\r\n")
        for _ in range(10):
            protocol.data_received(b"X-Pad: " + b"a" * 1000 + b"\r\n")
        assert transport.aborted and counters.stats().headers_too_large == 1
        assert transport.statuses() == [200]
        protocol.connection_lost(None)

        protocol, transport, counters = await _connected(_unfinished_response, limits)
        protocol.data_received(b"GET /dump HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns()
        protocol.data_received(b"GET /health HTTP/1.1\r\nX-Pad: ")
        await asyncio.sleep(0.3)
        assert transport.aborted and counters.stats().header_timeouts == 1
        protocol.connection_lost(None)

    asyncio.run(run())


def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout() -> None:
    """An answer left unread (the write buffer over its mark) for send_timeout aborts the
    connection and is counted; one read in time does not."""
    limits = HttpLimits(send_timeout=0.1)

    async def run() -> None:
        for reads in (False, True):
            protocol, transport, counters = await _connected(limits=limits, stalled=True)
            protocol.data_received(_request(QUERY))
            assert transport.statuses() == [200]
            if reads:
                transport.drain()
            await asyncio.sleep(0.3)
            assert transport.aborted is not reads
            assert counters.stats().send_timeouts == (0 if reads else 1)
            protocol.connection_lost(None)

    asyncio.run(run())


def test_a_request_behind_an_answer_is_not_cut_off_by_the_keep_alive_deadline() -> None:
    """The keep-alive deadline an answer arms does not close the connection while the next
    request, which came with it, is still sending its body: that body gets body_timeout."""
    limits = HttpLimits(body_timeout=5.0)

    async def run() -> None:
        protocol, transport, _ = await _connected(limits=limits, keep_alive=0.05)
        second = _request(QUERY)
        protocol.data_received(_request(QUERY) + second[:-10])
        assert transport.statuses() == [200]
        await asyncio.sleep(0.3)
        assert not transport.closed
        protocol.data_received(second[-10:])
        assert transport.statuses() == [200, 200]
        protocol.connection_lost(None)

    asyncio.run(run())


def test_reading_resumes_only_when_neither_the_protocol_nor_uvicorn_holds_it() -> None:
    """uvicorn resuming reads for its request does not end the protocol's hold, and the
    hold's end does not resume reads uvicorn paused."""

    async def run() -> None:
        protocol, transport, _ = await _connected()
        flow = protocol.flow
        flow.hold(True)
        flow.resume_reading()
        assert not transport.reading
        flow.pause_reading()
        flow.hold(False)
        assert not transport.reading
        flow.resume_reading()
        assert transport.reading
        protocol.connection_lost(None)

    asyncio.run(run())


def test_bytes_are_parsed_in_pieces() -> None:
    """A piece is PARSE_PIECE bytes, plus what is left of a declared body; a request head
    comes alone when the rest does not fit; nothing is lost or repeated."""
    head = b"POST /query HTTP/1.1\r\nContent-Length: 100000\r\n\r\n"
    data = head + b"x" * 100_000 + b"y" * (3 * PARSE_PIECE)
    unparsed = Unparsed()
    unparsed.add(data)
    first = unparsed.take(0, between_requests=True)
    assert bytes(first) == head
    body = unparsed.take(100_000, between_requests=False)
    assert len(body) == 100_000 + PARSE_PIECE
    rest = [unparsed.take(0, between_requests=False) for _ in range(2)]
    assert [len(piece) for piece in rest] == [PARSE_PIECE, PARSE_PIECE]
    assert not unparsed
    assert bytes(first) + bytes(body) + b"".join(map(bytes, rest)) == data


def test_on_disconnect_tells_the_app_once_when_its_client_leaves_mid_answer() -> None:
    """The ABORT extension's on_disconnect: its callback runs once when the client closes
    the connection before the response is complete, and not at all for a request whose
    response completed before the client left."""
    from kvevents.http import ABORT

    called: list[str] = []

    async def answer(scope: Any, send: Any) -> None:
        path, left = scope["path"], asyncio.Event()
        scope["extensions"][ABORT]["on_disconnect"](lambda: (called.append(path), left.set()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if path == "/whole":
            await send({"type": "http.response.body", "body": b"done"})
            return
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        await asyncio.wait_for(left.wait(), 30)  # the client leaves before the end

    server = Server(_lifespan_app(answer)).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /whole HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"done" in sock.recv(4096)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /part HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"part" in sock.recv(4096)
        wait_for(lambda: called == ["/part"], 5, what="the callback")
    finally:
        server.close()
    assert called == ["/part"]


def _lifespan_app(answer: Any) -> Any:
    """An ASGI app whose requests ``answer`` takes (the lifespan handled here)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await answer(scope, send)

    return app


def test_hold_head_writes_the_head_with_the_first_piece_of_the_body() -> None:
    """The ABORT extension's hold_head: the status line and headers wait for the body's first
    piece and go out with it; the rest of the body as before; a HEAD request's head is not
    held (uvicorn writes no body for it), and a response closed with its head held gets its
    head, then the close."""

    from kvevents.http import ABORT

    head_sent, go_on = threading.Event(), threading.Event()

    async def answer(scope: Any, send: Any) -> None:
        abort = scope["extensions"][ABORT]
        abort["hold_head"]()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/closed":
            abort["close"]()
            return
        if scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        head_sent.set()
        await _set_in_time(go_on)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await send({"type": "http.response.body", "body": b"second"})

    server = Server(_lifespan_app(answer)).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
            assert head_sent.wait(10)
            # On loopback a write is in the reader's buffer when the send returns: the head
            # would be here by now had it been written on its own.
            readable, _, _ = select.select([sock], [], [], 0)
            assert readable == []
            go_on.set()
            first = sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n" in first
            data = _recv_until(sock, b"0\r\n\r\n", first)
            assert data.endswith(b"5\r\nfirst\r\n6\r\nsecond\r\n0\r\n\r\n")
            # HEAD on the same kept-alive connection: its head is written, not held.
            sock.sendall(b"HEAD /head HTTP/1.1\r\nHost: x\r\n\r\n")
            head = _recv_until(sock, b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /closed HTTP/1.1\r\nHost: x\r\n\r\n")
            data = _recv_to_close(sock)
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\n")
    finally:
        server.close()


def test_hold_chunks_writes_the_chunks_with_the_next_piece_of_the_body() -> None:
    """The ABORT extension's hold_chunks: the pieces given wait for the body's next message
    and go out with it, each framed as one chunk (an empty one skipped: it would end the
    body); it holds nothing (False) for a body with a declared length or while the head is
    still held; a response closed with chunks held gets them, then the close."""

    from kvevents.http import ABORT

    held, go_on = threading.Event(), threading.Event()
    refused: list[bool] = []

    async def answer(scope: Any, send: Any) -> None:
        abort = scope["extensions"][ABORT]
        if scope["path"] == "/length":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"2")],
                }
            )
            refused.append(abort["hold_chunks"]([b"a"]))
            await send({"type": "http.response.body", "body": b"ok"})
            return
        abort["hold_head"]()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        refused.append(abort["hold_chunks"]([b"a"]))  # the head is held: not now
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        assert abort["hold_chunks"]([b"a", b"", b"bc"])
        if scope["path"] == "/closed":
            abort["close"]()
            return
        held.set()
        await _set_in_time(go_on)
        await send({"type": "http.response.body", "body": b"d"})

    server = Server(_lifespan_app(answer)).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.wait(10)
            _recv_until(sock, b"5\r\nfirst\r\n")
            readable, _, _ = select.select([sock], [], [], 0)
            assert readable == []  # the chunks wait for the next piece
            go_on.set()
            assert _recv_until(sock, b"0\r\n\r\n") == b"1\r\na\r\n2\r\nbc\r\n1\r\nd\r\n0\r\n\r\n"
            sock.sendall(b"GET /length HTTP/1.1\r\nHost: x\r\n\r\n")
            _recv_until(sock, b"\r\n\r\nok")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /closed HTTP/1.1\r\nHost: x\r\n\r\n")
            data = _recv_to_close(sock)
            assert data.endswith(b"5\r\nfirst\r\n1\r\na\r\n2\r\nbc\r\n")
    finally:
        server.close()
    assert refused == [False, False, False]


async def _set_in_time(event: threading.Event, timeout: float = 10.0) -> None:
    """Wait on the server's loop for the test thread to set ``event`` (a bounded wait)."""
    deadline = time.monotonic() + timeout
    while not event.is_set():
        assert time.monotonic() < deadline, "the test never let the answer go on"
        await asyncio.sleep(0.005)


def _recv_until(sock: socket.socket, end: bytes, data: bytes = b"") -> bytes:
    """``data`` and what ``sock`` receives after it until it all ends with ``end``
    (AssertionError if the connection closes first)."""
    while not data.endswith(end):
        more = sock.recv(4096)
        assert more, f"closed after {data!r}"
        data += more
    return data


def _recv_to_close(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until the other side closes."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data
