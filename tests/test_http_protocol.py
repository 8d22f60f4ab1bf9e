"""``POST /query`` answered on the connection (kvevents.service.protocol): the same answers and
refusals as the app's path, kept-alive and pipelined connections, and every limit kept."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import IO, Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from kvevents.index.prefix import PrefixIndex
from kvevents.service.access import TokenCheck
from kvevents.service.app import create_app
from kvevents.service.core import IndexService
from kvevents.service.http import AppOptions, HttpLimits, Server, serve
from kvevents.service.limits import HttpCounters
from kvevents.service.protocol import LimitedProtocol
from kvevents.service.server import _fast_query_of
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


class _StalledTransport(asyncio.Transport):
    """A transport whose peer reads nothing: every write fills the buffer past its mark."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.written: list[bytes] = []
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))
        self.protocol.pause_writing()

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def test_a_client_that_reads_no_answers_is_read_no_further() -> None:
    """Once answers back up in the write buffer, the connection stops reading requests, and
    reads again when the buffer drains: pipelined queries cannot pile answers up unbounded."""

    async def run() -> None:
        service = IndexService(PrefixIndex(), feed=FakeFeed(), stream_specs=fake_specs)
        app = create_app(service)
        cls = LimitedProtocol.configured(LIMITS, HttpCounters(), _fast_query_of(app))
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        protocol = cls(config=config, server_state=ServerState(), app_state={})
        transport = _StalledTransport(protocol)
        protocol.connection_made(transport)
        protocol.data_received(_request(QUERY) + _request(QUERY))
        assert len(transport.written) == 2 and transport.written[0].startswith(b"HTTP/1.1 200")
        assert not transport.reading
        protocol.resume_writing()
        assert transport.reading
        protocol.connection_lost(None)

    asyncio.run(run())
