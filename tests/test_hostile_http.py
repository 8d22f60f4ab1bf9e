"""Nothing an HTTP client sends stops the index service: authentication, the endpoint
allow-list, slow and oversized requests, and a seeded fuzz pass over every endpoint."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from kvevents.errors import LayoutError
from kvevents.http import (
    AppOptions,
    EndpointPolicy,
    HttpLimits,
    Server,
    TokenCheck,
    load_token,
    serve,
)
from kvevents.index.prefix import PrefixIndex
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.subscribe.streams import StreamSpec, worker_streams
from kvevents.testing.index import batch, store_event
from kvevents.testing.service import ServiceIndexer
from kvevents.testing.sockets import wait_for
from test_service import BS, LOCAL, PROMPT, FakeFeed

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
LIMITS = HttpLimits(
    max_body_bytes=64 << 10,
    header_timeout=0.5,
    body_timeout=0.5,
    max_connections=16,
    max_header_bytes=8 << 10,
)
# Memory growth allowed over the fuzz pass (in this process, which also runs the service):
# nothing a refused request sent may be kept.
RSS_GROWTH_CEILING = 64 << 20


def _specs(reg: WorkerRegistration) -> list[StreamSpec]:
    return worker_streams(reg.worker_id, reg.endpoint, reg.replay_endpoint, ranks=reg.ranks)


def _serve(feed: FakeFeed, options: AppOptions) -> Server:
    service = IndexService(PrefixIndex(), feed=feed, stream_specs=_specs, poll_interval=0.01)
    return serve("127.0.0.1", 0, service=service, options=options)


@pytest.fixture
def feed() -> FakeFeed:
    return FakeFeed()


@pytest.fixture
def guarded(feed: FakeFeed) -> Iterator[tuple[Server, httpx.Client]]:
    """A service with a token, the default (loopback) allow-list and tight client limits."""
    options = AppOptions(auth=TokenCheck(TOKEN), limits=LIMITS)
    with _serve(feed, options) as running, httpx.Client(base_url=running.url, timeout=10.0) as c:
        yield running, c


def _register(client: httpx.Client, worker: str, endpoint: str, **more: Any) -> httpx.Response:
    body = {"worker_id": worker, "endpoint": endpoint, "block_size": BS, **more}
    return client.post("/register", json=body, headers=AUTH)


# ----------------------------------------------------------------- authentication


def test_mutating_endpoints_need_the_token(guarded: tuple[Server, httpx.Client]) -> None:
    """/register and /unregister without the token, or with a wrong one, are a 401 JSON error
    and change nothing; with it they work. Reads stay open."""
    _, client = guarded
    body = {"worker_id": "a", "endpoint": LOCAL, "block_size": BS}
    for headers in (
        {},
        {"authorization": "Bearer nope"},
        {"authorization": TOKEN},
        {"authorization": f"Basic {TOKEN}"},
    ):
        for path in ("/register", "/unregister"):
            reply = client.post(path, json=body, headers=headers)
            assert reply.status_code == 401, (path, headers)
            assert reply.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer" in reply.json()["error"]
    assert client.get("/workers").json() == {"workers": []}
    assert _register(client, "a", LOCAL).status_code == 200
    assert client.post("/query", json={"token_ids": PROMPT}).status_code == 200
    for path in ("/workers", "/health", "/metrics", "/dump"):
        assert client.get(path).status_code == 200, path
    assert client.post("/unregister", json={"worker_id": "a"}, headers=AUTH).status_code == 200


def test_reads_can_be_closed_too(feed: FakeFeed) -> None:
    """With protect_reads every endpoint needs the token, unknown ones included."""
    options = AppOptions(auth=TokenCheck(TOKEN, protect_reads=True))
    with _serve(feed, options) as running, httpx.Client(base_url=running.url) as client:
        for method, path in [
            ("POST", "/query"),
            ("GET", "/workers"),
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("GET", "/dump"),
            ("GET", "/nope"),
        ]:
            assert client.request(method, path).status_code == 401, path
        assert client.get("/health", headers=AUTH).status_code == 200


def test_the_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    """A token file wins over $KVEVENTS_AUTH_TOKEN; an empty token is refused, not open."""
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert load_token(str(path), {"KVEVENTS_AUTH_TOKEN": "other"}) == TOKEN
    assert load_token(None, {"KVEVENTS_AUTH_TOKEN": "other"}) == "other"
    assert load_token(None, {}) is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="the auth token is empty"):
        load_token(str(path), {})
    with pytest.raises(ValueError, match="KVEVENTS_AUTH_TOKEN: the auth token is empty"):
        load_token(None, {"KVEVENTS_AUTH_TOKEN": " "})
    assert TokenCheck(None).accepts(None) and not TokenCheck(TOKEN).accepts(None)


# ----------------------------------------------------------------- where it may connect


def test_the_default_allow_list_is_loopback_only(guarded: tuple[Server, httpx.Client]) -> None:
    """A registration naming another host, an ipc path, or the service's own HTTP port is a
    403 naming the field; nothing is subscribed."""
    running, client = guarded
    refused = [
        ({"endpoint": "tcp://10.1.2.3:5557"}, "endpoint", "host 10.1.2.3 not allowed"),
        ({"endpoint": "tcp://example.com:5557"}, "endpoint", "host example.com not allowed"),
        ({"endpoint": "tcp://[fe80::1]:5557"}, "endpoint", "host [fe80::1] not allowed"),
        ({"endpoint": "ipc:///tmp/x"}, "endpoint", "ipc:// endpoints not allowed"),
        ({"endpoint": "inproc://x"}, "endpoint", "inproc:// endpoints not allowed"),
        (
            {"endpoint": LOCAL, "replay_endpoint": "tcp://192.168.0.1:5600"},
            "replay_endpoint",
            "host 192.168.0.1 not allowed",
        ),
        ({"endpoint": f"tcp://127.0.0.1:{running.port}"}, "endpoint", "own HTTP port"),
        (
            {"endpoint": f"tcp://127.0.0.1:{running.port - 1}", "ranks": 2},
            "endpoint",
            "own HTTP port",
        ),
    ]
    for body, field, error in refused:
        reply = _register(client, "a", **body)
        assert reply.status_code == 403, (body, reply.text)
        assert reply.json()["field"] == field and error in reply.json()["error"], reply.json()
    assert client.get("/workers").json() == {"workers": []}
    for endpoint in (
        "tcp://127.0.0.1:5557",
        "tcp://127.9.9.9:5557",
        "tcp://[::1]:5557",
        "tcp://localhost:5557",
    ):
        assert _register(client, "a", endpoint).status_code == 200, endpoint


def test_the_allow_list_takes_addresses_cidrs_names_and_ipc() -> None:
    """Entries are matched as networks (an address is a /32 or /128) or literal names."""
    policy = EndpointPolicy(("10.0.0.0/8", "2001:db8::/32", "Engine-A", "ipc"))
    for endpoint in (
        "tcp://10.9.8.7:1",
        "tcp://[2001:db8::5]:1",
        "tcp://engine-a:1",
        "ipc:///run/kv",
    ):
        policy.check("endpoint", endpoint, [0])
    for endpoint in ("tcp://11.0.0.1:1", "tcp://127.0.0.1:1", "tcp://engine-b:1", "inproc://x"):
        with pytest.raises(LayoutError) as refused:
            policy.check("endpoint", endpoint, [0])
        assert refused.value.rule == "allowed_host" and "at `$.endpoint`" in str(refused.value)
    EndpointPolicy(("*",)).check("endpoint", "tcp://203.0.113.9:1", [0, 1])
    with pytest.raises(LayoutError, match="own HTTP port"):
        EndpointPolicy(("*",)).with_forbidden_port(8090).check("e", "tcp://h:8089", [0, 1])


# ----------------------------------------------------------------- slow and large requests


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10.0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_idle_and_slow_header_connections_are_closed(
    guarded: tuple[Server, httpx.Client],
) -> None:
    """A connection that sends nothing, or never finishes its headers, is closed after the
    header timeout; so is a kept-alive one that starts a second request and stalls."""
    running, _ = guarded
    with _connect(running) as idle, _connect(running) as partial, _connect(running) as kept:
        partial.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\n")
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        assert _read_all(idle) == b""
        assert _read_all(partial) == b""
        assert _read_all(kept) == b""


def test_slow_and_oversized_bodies_are_refused(guarded: tuple[Server, httpx.Client]) -> None:
    """A body slower than the body timeout is a 408, one over the size limit a 413 (by its
    content-length, or as it arrives when chunked); both close the connection."""
    running, client = guarded
    with _connect(running) as slow:
        slow.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reply = _read_all(slow)
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply
    big = b'{"token_ids": [' + b"1," * (40 << 10) + b"1]}"
    for path in ("/query", "/register"):
        reply = client.post(path, content=big, headers=AUTH)
        assert reply.status_code == 413, path
        assert "over the limit of 65536 bytes" in reply.json()["error"]
        chunked = client.post(path, content=iter([big[:40000], big[40000:]]), headers=AUTH)
        assert chunked.status_code == 413, path
    assert client.get("/health").status_code == 200


def test_huge_headers_are_refused(guarded: tuple[Server, httpx.Client]) -> None:
    """Request headers over max_header_bytes get a 431 and the connection is closed."""
    running, _ = guarded
    pad = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    with _connect(running) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + pad * 9)  # 9 KB, never ends
        assert _read_all(sock).startswith(b"HTTP/1.1 431")


def test_connections_past_the_cap_are_closed_at_once(feed: FakeFeed) -> None:
    """Past max_connections a new connection is closed as it is accepted; once the idle ones
    time out the service answers again."""
    # A header timeout long enough that the held connections are all still open when the
    # extra one is accepted, even on a loaded machine.
    limits = HttpLimits(max_connections=8, header_timeout=2.0)
    with _serve(feed, AppOptions(limits=limits)) as running:
        _past_the_cap(running, limits.max_connections)


def _past_the_cap(running: Server, cap: int) -> None:
    held = [_connect(running) for _ in range(cap)]
    try:
        # The server has accepted them all once the next one is refused.
        with _connect(running) as extra:
            assert _read_all(extra) == b""
        for sock in held:
            assert _read_all(sock) == b""  # closed by the header timeout
    finally:
        for sock in held:
            sock.close()
    with httpx.Client(base_url=running.url, timeout=10.0) as client:
        assert client.get("/health").status_code == 200
        assert "kvevents_http_connections_refused_total 1.0" in client.get("/metrics").text


# ----------------------------------------------------------------- fuzz


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


_NUMBERS = [0, 1, -1, 2**31, 2**32, 2**53 + 1, 2**63, 2**64, 2**70, -(2**70), 1.5, 1e308]
_KEYS = [
    "worker_id",
    "instance_id",
    "endpoint",
    "replay_endpoint",
    "block_size",
    "ranks",
    "dp_size",
    "topic",
    "model_name",
    "rank",
    "dp_rank",
    "token_ids",
    "block_hashes",
    "policy",
    "lora_name",
    "lora_id",
]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(_NUMBERS)
    if kind == 1:
        return rng.choice(
            [
                "",
                "x" * rng.randrange(2000),
                "tcp://127.0.0.1:6000",
                "\u0000",
                "tcp://*:0",
                "ipc://" + "p" * 200,
                "longest_prefix",
            ]
        )
    if kind == 2:
        return rng.choice([None, True, False])
    if kind in (3, 4, 5):
        return [rng.randrange(-5, 2**33) for _ in range(rng.randrange(50))]
    if kind in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(_KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _body(rng: random.Random) -> bytes:
    shape = rng.randrange(10)
    if shape == 0:
        return b"[" * 50_000 + b"]" * 50_000
    if shape == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if shape == 2:
        return b'{"token_ids": [' + b"7," * rng.randrange(40_000, 60_000) + b"7]}"  # > limit
    fields = {rng.choice(_KEYS): _value(rng) for _ in range(rng.randrange(1, 7))}
    return json.dumps(fields).encode()


def test_seeded_fuzz_never_gets_a_5xx(guarded: tuple[Server, httpx.Client], feed: FakeFeed) -> None:
    """Random JSON shapes, huge numbers, wrong types, deep nesting, oversized bodies and bad
    auth on every endpoint: never a 5xx, /health still ok, memory under a ceiling, and a
    worker registered before still indexed."""
    _, client = guarded
    assert _register(client, "keep", LOCAL).status_code == 200
    feed.deliver("keep", 0, batch(store_event(PROMPT, BS)))
    service_stats = client.get("/metrics")
    assert service_stats.status_code == 200
    rss_before = _rss()
    rng = random.Random(20261201)
    routes = [
        ("POST", "/register"),
        ("POST", "/unregister"),
        ("POST", "/query"),
        ("GET", "/dump"),
        ("GET", "/workers"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("PUT", "/query"),
        ("GET", "/../etc"),
        ("DELETE", "/register"),
    ]
    statuses: dict[int, int] = {}
    for _ in range(400):
        method, path = rng.choice(routes)
        headers = rng.choice([AUTH, {}, {"authorization": "Bearer " + "x" * 64}])
        reply = client.request(method, path, content=_body(rng), headers=headers)
        statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (method, path, reply.text)
        assert reply.headers["content-type"].startswith(("application/json", "text/plain"))
    assert {400, 401, 405, 413} <= set(statuses), statuses
    assert client.get("/health").json()["status"] == "ok"
    assert _rss() - rss_before < RSS_GROWTH_CEILING
    assert any(w["worker_id"] == "keep" for w in client.get("/workers").json()["workers"])

    def kept() -> bool:
        scores = client.post("/query", json={"token_ids": PROMPT}).json()["scores"]
        return scores.get("keep") == {"0": 6}

    wait_for(kept, 10.0, interval=0.01, what="the blocks of the worker registered before")


def test_every_refusal_is_counted_in_metrics(guarded: tuple[Server, httpx.Client]) -> None:
    """Each kind of refused request or cut-off connection has its kvevents_http_* counter."""
    running, client = guarded
    client.post("/register", json={})  # 401
    _register(client, "a", "tcp://10.0.0.1:1")  # 403
    client.post("/query", content=b"{")  # 400
    client.get("/nope")  # 404
    client.post("/query", content=b"x" * (LIMITS.max_body_bytes + 1))  # 413
    with _connect(running) as slow:
        slow.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        assert _read_all(slow).startswith(b"HTTP/1.1 408")
    with _connect(running) as huge:
        huge.sendall(b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * (LIMITS.max_header_bytes + 1))
        assert _read_all(huge).startswith(b"HTTP/1.1 431")
    with _connect(running) as idle:
        assert _read_all(idle) == b""
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("kvevents_http_")
    }
    for name in (
        "unauthorized",
        "forbidden_endpoints",
        "bad_requests",
        "not_found",
        "bodies_too_large",
        "body_timeouts",
        "headers_too_large",
    ):
        assert counts[f"kvevents_http_{name}_total"] == 1.0, (name, counts)
    assert counts["kvevents_http_header_timeouts_total"] >= 1.0
    assert counts["kvevents_http_connections_refused_total"] == 0.0


# ----------------------------------------------------------------- a dump nobody reads


def test_a_dump_nobody_reads_is_abandoned_after_the_send_timeout(feed: FakeFeed) -> None:
    """A client that asks for /dump and stops reading holds it (others get 429) only until
    send_timeout: then its connection is cut off, counted, and the next dump is served."""
    options = AppOptions(limits=HttpLimits(send_timeout=0.5))
    with _serve(feed, options) as running, httpx.Client(base_url=running.url) as client:
        assert _register(client, "w", LOCAL).status_code == 200
        _hold_blocks(client, feed, 300_000)  # a 12 MB dump: more than socket buffers hold
        with _connect(running) as stalled:
            stalled.sendall(b"GET /dump HTTP/1.1\r\nHost: x\r\n\r\n")
            assert stalled.recv(12, socket.MSG_WAITALL) == b"HTTP/1.1 200"
            assert client.get("/dump").status_code == 429

            def free() -> bool:
                return client.get("/dump").status_code == 200

            wait_for(free, 10.0, interval=0.05, what="the unread dump to be abandoned")
        assert "kvevents_http_send_timeouts_total 1.0" in client.get("/metrics").text


def _hold_blocks(client: httpx.Client, feed: FakeFeed, blocks: int) -> None:
    """Worker "w" holds ``blocks`` blocks, in prefixes of 60,000."""
    for n in range(blocks // 60_000):
        first = n * 10**6
        feed.deliver("w", 0, batch(store_event(range(first, first + 60_000 * BS), BS)), seq=n)

    def held() -> bool:
        return f"kvevents_index_entries {blocks}.0" in client.get("/metrics").text

    wait_for(held, 30.0, interval=0.05, what=f"{blocks} blocks indexed")


# ----------------------------------------------------------------- pipelined floods

# Each flood: FLOOD_CONNECTIONS connections send their requests pipelined, in one write each,
# and read nothing while GET /health is timed from another connection; then they read every
# answer. Measured in a service process of its own (RSS is the process's). Before the bounds
# the /query flood below took the service +530 MB and stalled /health for 6 s.
FLOOD_CONNECTIONS = 8
FLOOD_RSS_CEILING = 64 << 20  # RSS growth over a flood
STALL_CEILING = 1.0  # seconds a GET /health may take during a flood
PROBE_SECONDS = 1.5  # how long the flooding clients read nothing
FLOOD_TARGETS = 50  # registered workers: each adds to a query's answer (about 9 KB for 50)


def _post(path: str, body: Any) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


@pytest.fixture(scope="module")
def flood_servers() -> Iterator[dict[str, ServiceIndexer]]:
    """A service of each API, each with FLOOD_TARGETS workers registered."""
    with ServiceIndexer() as ours, ServiceIndexer(args=["--api", "dynamo"]) as dynamo:
        for n in range(FLOOD_TARGETS):
            ours.register(f"w{n}", f"tcp://127.0.0.1:{30000 + n}", block_size=BS)
            body = {
                "instance_id": n,
                "endpoint": f"tcp://127.0.0.1:{31000 + n}",
                "model_name": "m",
                "block_size": BS,
            }
            dynamo.call("POST", "/register", body)
        yield {"kvevents": ours, "dynamo": dynamo}


_FLOODS = {
    # name: (server, request, bytes sent on each connection, status of every answer)
    "query": ("kvevents", _post("/query", {"token_ids": [1]}), 250_000, 200),
    "app": ("kvevents", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 64_000, 200),
    "register": (
        "kvevents",
        _post("/register", {"worker_id": "x", "endpoint": "tcp://10.0.0.1:5557", "block_size": BS}),
        64_000,
        403,
    ),
    "load": (
        "kvevents",
        _post("/load", {"loads": [{"worker_id": "w1", "queued_blocks": 3, "active_blocks": 5}]}),
        64_000,
        200,
    ),
    "dynamo_query": (
        "dynamo",
        _post("/query", {"token_ids": [1], "model_name": "m"}),
        250_000,
        200,
    ),
}


@pytest.mark.parametrize("name", list(_FLOODS))
def test_a_pipelined_flood_costs_bounded_memory_and_stalls_nobody(
    flood_servers: dict[str, ServiceIndexer], name: str
) -> None:
    """Requests pipelined by the thousand on several connections whose clients do not read:
    the service's memory stays under a ceiling, another connection's GET /health is answered
    promptly throughout, and every request is answered, in order, once the clients read."""
    server_name, request, size, status = _FLOODS[name]
    server = flood_servers[server_name]
    count = size // len(request)
    rss_before = server.rss_bytes()
    clients = [_connect_to(server.port) for _ in range(FLOOD_CONNECTIONS)]
    senders = [threading.Thread(target=c.sendall, args=(request * count,)) for c in clients]
    try:
        for sender in senders:
            sender.start()
        stall, rss_peak = _probe(server, PROBE_SECONDS)
        answers = [_statuses(client, count) for client in clients]
    finally:
        for sender in senders:
            sender.join(30.0)
        for client in clients:
            client.close()
    assert stall < STALL_CEILING, f"GET /health took {stall:.2f} s during the flood"
    growth = rss_peak - rss_before
    assert growth < FLOOD_RSS_CEILING, f"RSS grew {growth >> 20} MB"
    assert answers == [[status] * count] * FLOOD_CONNECTIONS


def _connect_to(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30.0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def _probe(server: ServiceIndexer, seconds: float) -> tuple[float, int]:
    """(the longest GET /health round trip, the highest RSS) over ``seconds``."""
    worst, peak = 0.0, server.rss_bytes()
    deadline = time.monotonic() + seconds
    with _connect_to(server.port) as sock, sock.makefile("rb") as reader:
        while time.monotonic() < deadline:
            began = time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(reader)[0] == 200
            worst = max(worst, time.perf_counter() - began)
            peak = max(peak, server.rss_bytes())
            time.sleep(0.02)
    return worst, peak


def _statuses(sock: socket.socket, count: int) -> list[int]:
    with sock.makefile("rb") as reader:
        return [_read_response(reader)[0] for _ in range(count)]


def _read_response(reader: IO[bytes]) -> tuple[int, bytes]:
    """One response: (status, body); every response here has a content-length."""
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline().strip()) != b"":
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, reader.read(length)
