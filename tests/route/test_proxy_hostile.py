"""Nothing a client or an engine does stops the front door: malformed, huge, slow and
pipelined requests get their OpenAI-shaped 4xx; engines that drip, hang, answer 200 MB or
close mid-stream, and clients that never read, cost bounded memory and time."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvevents.http import HttpLimits
from kvevents.route import ProxyOptions
from kvevents.testing.openai_engine import Behaviour, StandInEngine
from kvevents.testing.rawhttp import RawConnection, request_bytes
from kvevents.testing.route import RunningProxy
from kvevents.testing.sockets import Deadline, wait_for

Engines = Callable[..., StandInEngine]
Proxy = Callable[..., RunningProxy]

LIMITS = HttpLimits(max_body_bytes=64 << 10, header_timeout=0.5, body_timeout=0.5)
# Memory growth allowed in this process (proxy, engines and clients together) over a hostile
# run: what passes through must not be kept.
RSS_CEILING = 64 << 20
MB = 1 << 20


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _error(reply: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a reply (asserting its shape)."""
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


BAD = [
    (b"{", 400, None, "the request body is not valid JSON"),
    (b'["a list"]', 400, None, "the request body must be a JSON object"),
    (b'{"model": 7, "messages": []}', 400, "model", "`model` must be a string"),
    (b'{"messages": [], "stream": "yes"}', 400, "stream", "`stream` must be a boolean"),
    (b'{"model": "stand-in"}', 400, "messages", "`messages` is required"),
    (b'{"messages": "hi"}', 400, "messages", "`messages` must be a list"),
    (b'{"messages": ["\xff\xfe"]}', 400, None, "the request body is not valid JSON"),
    (b"[" * 30_000 + b"]" * 30_000, 400, None, "the request body is nested too deeply"),
    (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, 400, None, "the request body is nested too deeply"),
]


@pytest.mark.parametrize(("body", "status", "param", "message"), BAD)
def test_malformed_requests_get_openai_errors(
    engines: Engines, proxy: Proxy, body: bytes, status: int, param: str | None, message: str
) -> None:
    """A body that is not a JSON object, or whose routing fields are missing or mistyped,
    is refused with an OpenAI-shaped 400 naming the field; the engine never sees it."""
    engine = engines()
    front = proxy(engine, options=ProxyOptions(limits=LIMITS))
    reply = httpx.post(front.url + "/v1/chat/completions", content=body)
    assert reply.status_code == status
    error = _error(reply)
    assert error["message"].startswith(message) and error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert engine.received("/v1/chat/completions") == []


def test_wrong_methods_paths_and_sizes(engines: Engines, proxy: Proxy) -> None:
    """GET on a planned route is a 405, an unknown path a 404, a body over the limit a 413
    (by its content-length or as it streams in), a body slower than the limit a 408: all
    OpenAI-shaped, all counted, none reaching the engine."""
    engine = engines()
    front = proxy(engine, options=ProxyOptions(limits=LIMITS))
    big = b'{"messages": ["' + b"x" * (80 << 10) + b'"]}'
    with httpx.Client(base_url=front.url) as client:
        assert client.get("/v1/chat/completions").status_code == 405
        assert _error(client.get("/admin"))["message"] == "no such endpoint: GET /admin"
        too_large = client.post("/v1/chat/completions", content=big)
        assert too_large.status_code == 413 and too_large.headers["connection"] == "close"
        assert "over the limit of 65536 bytes" in _error(too_large)["message"]
        chunked = client.post("/v1/completions", content=iter([big[:40000], big[40000:]]))
        assert chunked.status_code == 413
        assert client.post("/tokenize", content=big).status_code == 413
    with RawConnection(front.port) as slow:
        slow.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reply = slow.read_response()
    assert reply.status == 408 and b"did not arrive within 0.5 s" in reply.body
    assert engine.received("/v1/chat/completions") == []
    http = front.app.http_counters.stats()
    assert (http.not_found, http.bodies_too_large, http.body_timeouts) == (2, 3, 1)


def test_slow_and_oversized_headers_are_cut_off(engines: Engines, proxy: Proxy) -> None:
    """The service's client limits hold on the front door: headers never finished are cut
    after the header timeout, headers over the size limit get a 431."""
    front = proxy(engines(), options=ProxyOptions(limits=LIMITS))
    with RawConnection(front.port) as stalled, RawConnection(front.port) as huge:
        stalled.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        huge.send(b"GET /health HTTP/1.1\r\n" + (b"X-Pad: " + b"a" * 1000 + b"\r\n") * 70)
        assert stalled.closed_by_peer()
        assert huge.read_head()[0] == 431


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([0, -1, 2**64, 1e308, 1.5, True, None, ""])
    if kind == 1:
        return rng.choice(["stand-in", "x" * rng.randrange(3000), "\u0000\ud7ff", "gpt-9"])
    if kind in (2, 3):
        return [rng.randrange(-5, 2**40) for _ in range(rng.randrange(40))]
    if kind == 4:
        return {"role": rng.choice(["user", "system", 5]), "content": _value(rng, depth + 1)}
    if kind in (5, 6):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "n"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _fuzz_body(rng: random.Random) -> bytes:
    shape = rng.randrange(8)
    if shape == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(300)))
    if shape == 1:
        return b'{"messages": [' + b'"x",' * rng.randrange(20_000, 30_000) + b'"x"]}'
    if shape == 2:
        depth = rng.randrange(500, 5000)
        return b'{"model": "stand-in", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    document = _value(rng)
    if isinstance(document, dict) and rng.random() < 0.7:
        document.setdefault("messages", [{"role": "user", "content": "x"}])
        document.setdefault("prompt", "x")
    return json.dumps(document).encode()


def test_seeded_fuzz_never_gets_a_5xx(engines: Engines, proxy: Proxy) -> None:
    """Random JSON shapes, wrong types, deep nesting, raw bytes and oversized bodies on
    every route: never a 5xx while the engine is healthy, memory under a ceiling."""
    engine = engines()
    front = proxy(engine, options=ProxyOptions(limits=LIMITS))
    rng = random.Random(20261202)
    routes = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/embeddings"]
    statuses: dict[int, int] = {}
    before = _rss()
    with httpx.Client(base_url=front.url, timeout=30) as client:
        for _ in range(300):
            method = rng.choice(["POST", "POST", "POST", "GET", "PUT"])
            reply = client.request(method, rng.choice(routes), content=_fuzz_body(rng))
            statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
            assert reply.status_code < 500, reply.text
        assert client.get("/health").json()["status"] == "ok"
    assert {200, 400, 413} <= set(statuses), statuses
    assert _rss() - before < RSS_CEILING


def test_a_pipelined_flood_is_answered_in_order(engines: Engines, proxy: Proxy) -> None:
    """2,000 requests pipelined on one connection are answered in order while /health on
    another connection answers within a second; memory stays under the ceiling."""
    engine = engines()
    front = proxy(engine)
    body = b'{"model":"stand-in","prompt":"x"}'
    one = request_bytes("POST", "/v1/completions", body)
    before = _rss()
    with RawConnection(front.port, timeout=30) as flood, httpx.Client(base_url=front.url) as probe:
        flood.send(one * 2000)
        slowest = 0.0
        for i in range(2000):
            assert flood.read_response().status == 200, i
            if i % 400 == 0:
                began = time.monotonic()
                assert probe.get("/health").status_code == 200
                slowest = max(slowest, time.monotonic() - began)
    assert slowest < 1.0
    assert len(engine.received("/v1/completions")) == 2000
    assert _rss() - before < RSS_CEILING


def _plateau(read: Callable[[], int], settle: float = 0.3, timeout: float = 10.0) -> int:
    """The value ``read`` settles at: unchanged for ``settle`` seconds (within ``timeout``).

    Proving that nothing more is read takes a quiet interval; it is the only sleep here.
    """
    deadline = Deadline(timeout)
    value = read()
    while not deadline.expired:
        time.sleep(settle)
        now = read()
        if now == value:
            return now
        value = now
    raise TimeoutError(f"still moving after {timeout} s: {value}")


def test_a_client_that_never_reads_holds_the_engine_back(engines: Engines, proxy: Proxy) -> None:
    """A 200 MB stream to a client that reads nothing: the proxy reads from the engine only
    what the socket buffers hold (the engine stalls under 32 MB sent), memory stays under
    the ceiling; each MB the client then reads lets about a MB more through; when the client
    leaves, the engine's request is closed."""
    engine = engines(behaviour=Behaviour(tokens=3200, token_bytes=64 << 10))
    front = proxy(engine)
    before = _rss()
    body = b'{"messages":[],"stream":true}'
    with RawConnection(front.port, rcvbuf=64 << 10) as client:
        client.send(request_bytes("POST", "/v1/chat/completions", body))
        client.read_head()
        stalled = _plateau(lambda: engine.bytes_sent)
        assert stalled < 32 * MB
        assert _rss() - before < RSS_CEILING
        taken = 0
        while taken < 8 * MB:
            size = len(client.read_chunk() or b"")
            assert size
            taken += size
        moved = _plateau(lambda: engine.bytes_sent) - stalled
        assert 4 * MB < moved < 8 * MB + 8 * MB  # what was read, plus buffers it refilled
    engine.wait_aborted(1)
    assert _rss() - before < RSS_CEILING


@pytest.mark.parametrize("length", [True, False])
def test_a_200_mb_answer_is_refused_or_cut_off(
    engines: Engines, proxy: Proxy, length: bool
) -> None:
    """A 200 MB non-streamed answer: refused with a 502 when its content-length says so,
    cut off at max_response_bytes (64 MiB) when chunked; bounded memory and time, and the
    engine sees its connection closed either way."""
    engine = engines(behaviour=Behaviour(tokens=3200, token_bytes=64 << 10, length=length))
    front = proxy(engine)
    before, began = _rss(), time.monotonic()
    with RawConnection(front.port, timeout=60) as client:
        client.send(request_bytes("POST", "/v1/chat/completions", b'{"messages":[]}'))
        if length:
            reply = client.read_response()
            assert reply.status == 502
            assert json.loads(reply.body)["error"]["code"] == "upstream_too_large"
        else:
            status, size, complete = client.count_response()
            assert status == 200 and not complete
            assert 63 * MB < size <= 64 * MB
    assert time.monotonic() - began < 30
    assert _rss() - before < RSS_CEILING
    engine.wait_aborted(1)
    assert front.engine(engine.url).counts.too_large == 1


def test_dripping_and_hanging_engines_cost_bounded(engines: Engines, proxy: Proxy) -> None:
    """Fifty streams dripping a byte-sized event every 20 ms and fifty requests an engine
    never answers: /health still answers within a second, memory stays under the ceiling,
    and when the clients leave every engine request is closed and nothing stays in flight."""
    dripping = engines(behaviour=Behaviour(tokens=10_000, token_delay=0.02))
    hanging = engines("hang", behaviour=Behaviour(delay=math.inf))
    front = proxy(dripping, hanging)
    before = _rss()
    clients = []
    for i in range(100):
        conn = RawConnection(front.port)
        model = b'"model":"stand-in","stream":true' if i % 2 else b'"model":"hang"'
        body = b'{"messages":[],' + model + b"}"
        conn.send(request_bytes("POST", "/v1/chat/completions", body))
        clients.append(conn)
    wait_for(lambda: front.app.upstream.in_flight == 100, 10, what="100 requests in flight")
    began = time.monotonic()
    assert httpx.get(front.url + "/health").status_code == 200
    assert time.monotonic() - began < 1.0
    assert _rss() - before < RSS_CEILING
    for conn in clients:
        conn.close()
    dripping.wait_aborted(50)
    hanging.wait_aborted(50)
    wait_for(lambda: front.app.upstream.in_flight == 0, 10, what="nothing in flight")
    assert front.app.stats().counts.client_disconnects == 100
