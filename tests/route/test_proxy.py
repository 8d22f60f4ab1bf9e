"""The front door passes the OpenAI API through unchanged: request bytes and headers to the
engine, the answer's status, headers, body and SSE chunks back, plus the decision headers;
the usage in the answer reaches the planner; the engines' routes and the proxy's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvevents.testing.openai_engine import Behaviour, StandInEngine
from kvevents.testing.rawhttp import RawConnection, RawResponse, request_bytes
from kvevents.testing.route import RoundRobinPlanner, RunningProxy

Engines = Callable[..., StandInEngine]
Proxy = Callable[..., RunningProxy]

# Spacing, key order, escapes and raw UTF-8 that any re-serialization would change.
ODD_BODY = (
    b'{ "zeta":1,  "model" : "stand-in",\n "messages":[{"role":"user",'
    b'"content":"caf\\u00e9 \xe2\x82\xac \\"q\\""}],"alpha":[1.0e3,-0.0, 1E-7] }'
)
CHAT = b'{"model":"stand-in","messages":[{"role":"user","content":"hi"}]}'
STREAM = (
    b'{"model":"stand-in","messages":[{"role":"user","content":"hi"}],"stream":true,'
    b'"stream_options":{"include_usage":true}}'
)


def _exchange(port: int, raw: bytes) -> RawResponse:
    with RawConnection(port) as conn:
        conn.send(raw)
        return conn.read_response()


def _key(labels: dict[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a /metrics text, by name and labels."""
    return {
        (sample.name, _key(sample.labels)): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _post(path: str, body: bytes, *headers: tuple[str, str]) -> bytes:
    return request_bytes("POST", path, body, [("Content-Type", "application/json"), *headers])


def test_the_request_reaches_the_engine_byte_for_byte(engines: Engines, proxy: Proxy) -> None:
    """The engine gets the client's body unchanged, its headers in order (Authorization and
    X-Request-Id included), its own Host, and none of the hop-by-hop headers."""
    engine = engines()
    front = proxy(engine)
    headers = [
        ("Authorization", "Bearer sk-client"),
        ("X-Request-Id", "req-7"),
        ("X-Custom", 'spaced  value;q="a,b"'),
        ("X-Repeated", "one"),
        ("X-Repeated", "two"),
        ("Connection", "keep-alive, X-Hop"),
        ("X-Hop", "dropped: named by Connection"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Proxy-Authorization", "Basic secret"),
    ]
    reply = _exchange(front.port, _post("/v1/chat/completions", ODD_BODY, *headers))
    assert reply.status == 200
    (got,) = engine.received("/v1/chat/completions")
    assert got.body == ODD_BODY
    names = [name.lower() for name, _ in got.headers]
    for dropped in (b"connection", b"x-hop", b"keep-alive", b"te", b"proxy-authorization"):
        assert dropped not in names
    assert got.header("host") == f"127.0.0.1:{engine.port}".encode()
    assert got.header("content-length") == str(len(ODD_BODY)).encode()
    passed = [(k.lower(), v) for k, v in got.headers if k.lower().startswith((b"x-", b"auth"))]
    assert passed == [
        (b"authorization", b"Bearer sk-client"),
        (b"x-request-id", b"req-7"),
        (b"x-custom", b'spaced  value;q="a,b"'),
        (b"x-repeated", b"one"),
        (b"x-repeated", b"two"),
    ]
    # Nothing the client did not send: no user-agent, accept or encoding added by the proxy.
    assert set(names) == {
        b"host", b"content-type", b"authorization", b"x-request-id", b"x-custom",
        b"x-repeated", b"content-length",
    }  # fmt: skip


def test_the_answer_comes_back_unchanged_with_the_decision(engines: Engines, proxy: Proxy) -> None:
    """Status, the engine's own headers, content-length and body are the engine's; the
    decision headers name the engine and the planner's predicted cached tokens."""
    engine = engines()
    front = proxy(engine, planner=lambda pool: RoundRobinPlanner(pool, {engine.url: 42}))
    direct = _exchange(engine.port, _post("/v1/chat/completions", CHAT))
    proxied = _exchange(front.port, _post("/v1/chat/completions", CHAT))
    assert (proxied.status, proxied.body) == (direct.status, direct.body)
    assert proxied.header("content-length") == direct.header("content-length")
    assert proxied.header("x-stand-in-engine") == direct.header("x-stand-in-engine")
    assert proxied.header("x-kvevents-engine") == engine.url.encode()
    assert proxied.header("x-kvevents-predicted-cached-tokens") == b"42"
    assert proxied.chunks is None  # a body with a length stays one with a length


@pytest.mark.parametrize(
    "behaviour",
    [
        Behaviour(tokens=12),
        Behaviour(tokens=12, token_delay=0.002),
        Behaviour(tokens=12, torn=True),
    ],
    ids=["together", "one-by-one", "torn"],
)
def test_sse_chunks_pass_one_for_one(engines: Engines, proxy: Proxy, behaviour: Behaviour) -> None:
    """A streamed answer reaches the client as the same HTTP chunks, byte for byte, as the
    engine sends them (one SSE event each), ending with data: [DONE]: whether they arrive
    together (written at once), one by one, or each torn across two TCP segments."""
    engine = engines(behaviour=behaviour)
    front = proxy(engine)
    direct = _exchange(engine.port, _post("/v1/chat/completions", STREAM))
    proxied = _exchange(front.port, _post("/v1/chat/completions", STREAM))
    assert direct.chunks is not None and len(direct.chunks) == 12 + 4
    assert proxied.chunks == direct.chunks
    assert proxied.complete and proxied.chunks[-1] == b"data: [DONE]\n\n"
    assert proxied.header("content-type") == b"text/event-stream; charset=utf-8"


def test_a_chunked_json_answer_keeps_its_chunks(engines: Engines, proxy: Proxy) -> None:
    """A non-streamed answer the engine sends chunked comes back in the same chunks."""
    engine = engines(behaviour=Behaviour(length=False, tokens=5, token_delay=0.001))
    front = proxy(engine)
    direct = _exchange(engine.port, _post("/v1/completions", b'{"prompt":"x"}'))
    proxied = _exchange(front.port, _post("/v1/completions", b'{"prompt":"x"}'))
    assert direct.chunks is not None and len(direct.chunks) == 7
    assert proxied.chunks == direct.chunks and proxied.complete


def test_usage_reaches_the_planner_unchanged_bytes(engines: Engines, proxy: Proxy) -> None:
    """The planner's outcome carries prompt and cached tokens from a JSON answer and from a
    stream's usage event; a stream without include_usage reports none."""
    engine = engines(behaviour=Behaviour(prompt_tokens=9, cached_tokens=5))
    front = proxy(engine)
    with httpx.Client(base_url=front.url) as client:
        client.post("/v1/chat/completions", content=CHAT)
        client.post("/v1/chat/completions", content=STREAM)
        client.post("/v1/completions", json={"prompt": "x", "stream": True})
    outcomes = front.planner.outcomes()
    assert [(o.kind, o.status) for o in outcomes] == [("ok", 200)] * 3
    assert [(o.prompt_tokens, o.cached_tokens) for o in outcomes] == [
        (9, 5),
        (9, 5),
        (None, None),
    ]
    assert all(o.first_byte_s is not None and 0 < o.first_byte_s <= o.total_s for o in outcomes)


def test_usage_of_an_answer_over_a_megabyte(engines: Engines, proxy: Proxy) -> None:
    """An answer too large to keep whole still has its usage read, from its end."""
    engine = engines(behaviour=Behaviour(tokens=40, token_bytes=64 << 10, cached_tokens=3))
    front = proxy(engine)
    with httpx.Client(base_url=front.url, timeout=30) as client:
        reply = client.post("/v1/chat/completions", content=CHAT)
    assert reply.status_code == 200 and len(reply.content) > 40 * (64 << 10)
    (outcome,) = front.planner.outcomes()
    assert (outcome.prompt_tokens, outcome.cached_tokens) == (8, 3)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_openai_client_streamed_and_not(engines: Engines, proxy: Proxy, path: str) -> None:
    """The OpenAI Python client, as users drive the front door, gets the engine's answers
    streamed and not, with usage, and the decision headers."""
    engine = engines(behaviour=Behaviour(tokens=6, cached_tokens=2))
    front = proxy(engine)
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="sk-test", max_retries=0)
    chat = path == "/v1/chat/completions"
    messages: Any = [{"role": "user", "content": "hello"}]
    if chat:
        raw = client.chat.completions.with_raw_response.create(model="stand-in", messages=messages)
        whole = raw.parse().choices[0].message.content
        stream = client.chat.completions.create(
            model="stand-in",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        raw = client.completions.with_raw_response.create(model="stand-in", prompt="hello")
        whole = raw.parse().choices[0].text
        stream = client.completions.create(
            model="stand-in", prompt="hello", stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = "".join(f"tok{i} " for i in range(6))
    assert whole == streamed == expected
    assert raw.headers["x-kvevents-engine"] == engine.url
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == 8
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_models_are_the_union_of_the_healthy_engines(engines: Engines, proxy: Proxy) -> None:
    """GET /v1/models lists each model of the healthy engines once, as the engine described
    it; a down engine's models are left out."""
    first, second = engines("m1"), engines("m1", "m2")
    third = engines("m3", behaviour=Behaviour(health_status=503))
    front = proxy(first, second, third)
    listing = httpx.get(front.url + "/v1/models").json()
    assert listing["object"] == "list"
    assert [card["id"] for card in listing["data"]] == ["m1", "m2"]
    assert listing["data"][0] == {
        "id": "m1", "object": "model", "created": 0, "owned_by": "stand-in", "root": "m1",
    }  # fmt: skip


def test_other_routes_go_to_an_engine_serving_the_model(engines: Engines, proxy: Proxy) -> None:
    """/tokenize, /detokenize and other /v1/* routes go to a healthy engine serving the
    body's model, with the query string as sent; an unknown model is a 404."""
    first, second = engines("m1", name="first"), engines("m2", name="second")
    front = proxy(first, second)
    with httpx.Client(base_url=front.url) as client:
        for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
            for model, name in (("m1", "first"), ("m2", "second"), ("m2", "second")):
                echo = client.post(path, json={"model": model, "prompt": "x"}).json()
                assert (echo["engine"], echo["target"]) == (name, path)
        odd = _exchange(front.port, request_bytes("GET", "/v1/files?a=%2F&b=%zz&c"))
        assert odd.status == 200 and b'"target":"/v1/files?a=%2F&b=%zz&c"' in odd.body
        missing = client.post("/tokenize", json={"model": "m9", "prompt": "x"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_health_says_which_engines_are_up(engines: Engines, proxy: Proxy) -> None:
    """GET /health is 200 while one engine is up (degraded when some are down), 503 when
    none is, and lists each engine's state."""
    up, down = engines(), engines(behaviour=Behaviour(health_status=500))
    front = proxy(up, down)
    reply = httpx.get(front.url + "/health")
    assert reply.status_code == 200
    body = reply.json()
    assert (body["status"], body["engines_up"]) == ("degraded", 1)
    states = {e["url"]: (e["state"], e["reason"]) for e in body["engines"]}
    assert states == {up.url: ("up", None), down.url: ("down", "GET /health answered 500")}
    lonely = proxy(down)
    reply = httpx.get(lonely.url + "/health")
    assert (reply.status_code, reply.json()["status"]) == (503, "unavailable")


def test_metrics_count_requests_by_route_engine_and_status(engines: Engines, proxy: Proxy) -> None:
    """/metrics has the requests by route, engine and status, the engines' health and
    counters, and the time to first token of streams."""
    engine = engines()
    front = proxy(engine)
    with httpx.Client(base_url=front.url) as client:
        for _ in range(3):
            client.post("/v1/chat/completions", content=CHAT)
        client.post("/v1/chat/completions", content=STREAM)
        client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        text = client.get("/metrics").text
    samples = _samples(text)
    chat = {"route": "/v1/chat/completions", "engine": engine.url, "status": "200"}
    assert samples["kvevents_route_requests_total", _key(chat)] == 4
    unknown = {"route": "/v1/completions", "engine": "", "status": "404"}
    assert samples["kvevents_route_requests_total", _key(unknown)] == 1
    on_engine = _key({"engine": engine.url})
    assert samples["kvevents_route_engine_up", on_engine] == 1
    assert samples["kvevents_route_engine_requests_total", on_engine] == 4
    assert samples["kvevents_route_ttft_seconds_count", on_engine] == 1
    assert samples["kvevents_route_planned_total", _key({})] == 5
    assert samples["kvevents_route_unknown_models_total", _key({})] == 1
    assert samples["kvevents_route_in_flight", _key({})] == 0


def test_the_status_page_hook_answers_other_paths(engines: Engines, proxy: Proxy) -> None:
    """Paths the proxy does not own go to the ``pages`` app when one is given (the status
    page), else they are an OpenAI-shaped 404."""

    async def page(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"status page " + scope["path"].encode()})

    engine = engines()
    with_page = proxy(engine, pages=page)
    without = proxy(engine)
    assert httpx.get(with_page.url + "/").text == "status page /"
    missing = httpx.get(without.url + "/")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no such endpoint: GET /"
