"""The proxy's pure parts, without sockets: usage readers, SSE events,
header filters, request parsing, options and the pool's answers about models."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvevents.route import Engine, EnginePool, EngineState, OpenAIError, ProxyOptions, Usage
from kvevents.route._forward import request_headers, response_headers
from kvevents.route._parse import model_of, route_request
from kvevents.route._sse import SseUsage
from kvevents.route._usage import BodyUsage, usage_of

USAGE = b'"usage":{"prompt_tokens":9,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":4}}'


def _feed(reader: BodyUsage | SseUsage, data: bytes, size: int) -> Usage | None:
    for at in range(0, len(data), size):
        reader.feed(data[at : at + size])
    return reader.result()


@pytest.mark.parametrize("size", [1, 7, 1 << 20])
def test_the_usage_of_a_json_answer_in_any_pieces(size: int) -> None:
    """A JSON answer's top-level usage is read whatever the pieces; a nested or absent one,
    null details, and a body that is not JSON give what they say."""
    body = b'{"id":"x","choices":[{"usage":{"prompt_tokens":1}}],' + USAGE + b"}"
    assert _feed(BodyUsage(), body, size) == Usage(9, 4)
    assert _feed(
        BodyUsage(), b'{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}', size
    ) == Usage(3, None)
    assert _feed(BodyUsage(), b'{"choices":[]}', size) is None
    assert _feed(BodyUsage(), b"not json" + USAGE, size) is None
    assert usage_of(b'{"usage":{"prompt_tokens":"many"}}') is None
    assert usage_of(b'{"usage":{"prompt_tokens":9,"completion_tokens":3}}') == Usage(9, None, 3)


def test_the_usage_at_the_end_of_a_huge_answer() -> None:
    """Past a megabyte only the answer's end is kept, and its last usage member is read
    there (even with fields after it); a usage key inside a string never counts."""
    filler = (
        b'{"choices":[{"text":"' + b"x" * (3 << 20) + b' \\"usage\\":{\\"prompt_tokens\\":1}"}],'
    )
    body = filler + USAGE + b',"kv_transfer_params":null}'
    reader = BodyUsage()
    assert _feed(reader, body, 64 << 10) == Usage(9, 4)
    assert reader._size < (64 << 10) * 2  # what it holds: the tail, not the answer
    assert _feed(BodyUsage(), filler + b'"usage": {broken', 64 << 10) is None


def _events(*payloads: bytes, end: bytes = b"\n\n") -> bytes:
    return b"".join(b"data: " + p + end for p in payloads)


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n"])
def test_the_usage_of_a_stream_in_any_pieces(size: int, end: bytes) -> None:
    """The usage event of a stream is found across any split of the pieces and either line
    ending; null usage in other events is ignored; [DONE] is seen."""
    stream = _events(
        b'{"choices":[{"delta":{"content":"a"}}],"usage":null}',
        b'{"choices":[],' + USAGE + b"}",
        b"[DONE]",
        end=end,
    )
    reader = SseUsage()
    assert _feed(reader, stream, size) == Usage(9, 4)
    assert reader.done


def test_a_stream_reports_its_last_usage_and_skips_what_it_cannot_read() -> None:
    """With usage in every event (continuous usage stats) the last one wins; an event split
    over data lines is joined; a broken one is skipped, never raised."""
    reader = SseUsage()
    reader.feed(_events(b'{"usage":{"prompt_tokens":1}}', b'{"usage":{"prompt_tokens":2}}'))
    reader.feed(b'data: {"usage":\ndata: {"prompt_tokens":5}}\n\n')
    reader.feed(_events(b'{"usage": {not json'))
    assert reader.result() == Usage(5, None) and not reader.done
    assert SseUsage().result() is None


def test_hop_by_hop_headers_stay_on_their_hop() -> None:
    """Requests lose hop-by-hop headers, those a Connection header names, Host, Expect and
    Content-Length; answers lose hop-by-hop headers, Date and Server; the rest keep their
    order, case and bytes."""
    request = [
        (b"host", b"front"),
        (b"connection", b"keep-alive, X-Trace"),
        (b"x-trace", b"1"),
        (b"authorization", b"Bearer \xe9"),
        (b"transfer-encoding", b"chunked"),
        (b"expect", b"100-continue"),
        (b"content-length", b"5"),
        (b"x-request-id", b"r1"),
    ]
    assert request_headers(request) == [
        (b"authorization", b"Bearer \xe9"),
        (b"x-request-id", b"r1"),
    ]
    answer = [
        (b"Date", b"today"),
        (b"Server", b"uvicorn"),
        (b"Content-Type", b"application/json"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"close, X-Engine-Secret"),
        (b"X-Engine-Secret", b"s"),
        (b"Content-Length", b"12"),
        (b"X-Stand-In", b"a"),
    ]
    assert response_headers(answer) == [
        (b"Content-Type", b"application/json"),
        (b"Content-Length", b"12"),
        (b"X-Stand-In", b"a"),
    ]


def test_a_planned_body_is_read_once_with_its_routing_fields() -> None:
    """route_request keeps the body's bytes and gives the parsed document, model and stream
    flag; a passed-through body's model is read when it has one."""
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}'
    request = route_request("/v1/chat/completions", body, [(b"x-a", b"1")])
    assert (request.body, request.model, request.stream) == (body, "m", True)
    assert request.json == json.loads(body) and request.headers == [(b"x-a", b"1")]
    assert route_request("/v1/completions", b'{"prompt":[1,2]}', []).model is None
    assert model_of(b' {"model": "m2"}') == "m2"
    for body in (b"", b"[1]", b"{", b'{"model": 5}', b"[" * 5000 + b"]" * 5000):
        assert model_of(body) is None


def test_options_name_the_field_they_refuse() -> None:
    """A bound that is not positive is refused with the field's name."""
    with pytest.raises(ValueError, match=r"ProxyOptions.idle_timeout must be > 0, got 0"):
        ProxyOptions(idle_timeout=0)
    with pytest.raises(ValueError, match=r"ProxyOptions.max_response_bytes must be > 0"):
        ProxyOptions(max_response_bytes=-1)


def test_a_pool_is_refused_when_it_cannot_work() -> None:
    """No engine, duplicate ids, a URL that is not http(s), bad check timings: each refused
    with what is wrong."""
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])
    with pytest.raises(ValueError, match="engine ids must be unique"):
        EnginePool(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match=r"engine URL 'a:1': expected http://HOST:PORT"):
        Engine("a:1")
    with pytest.raises(ValueError, match="interval and timeout must be > 0"):
        EnginePool(["http://a:1"], interval=0)


def _up(engine: Engine, *models: str) -> Engine:
    cards = tuple(msgspec.Raw(msgspec.json.encode({"id": m, "owner": engine.id})) for m in models)
    engine.models, engine.cards, engine.listed = frozenset(models), cards, True
    engine.state = EngineState.UP
    return engine


def test_the_pool_says_404_only_for_a_model_nobody_serves() -> None:
    """A model served by an up engine is available; one only a down engine serves is a 503;
    one no engine lists is a 404, unless an engine's list was never read (then a 503)."""
    first, second, unread = Engine("http://a:1"), Engine("http://b:1"), Engine("http://c:1")
    pool = EnginePool([first, second, unread])
    _up(first, "m1")
    _up(second, "m2").state = EngineState.DOWN
    assert pool.unavailable("m1") is None and pool.healthy("m1") == [first]
    assert _status(pool.unavailable("m2")) == 503
    assert _status(pool.unavailable("m9")) == 503  # the unread engine may serve it
    _up(unread, "m3")
    assert _status(pool.unavailable("m9")) == 404
    assert pool.unavailable(None) is None
    cards = [json.loads(bytes(card)) for card in pool.model_cards()]
    assert cards == [{"id": "m1", "owner": "http://a:1"}, {"id": "m3", "owner": "http://c:1"}]


def _status(error: OpenAIError | None) -> int:
    assert error is not None
    return error.status


def test_only_an_up_engine_is_marked_down_and_observers_hear_it() -> None:
    """mark_down takes an up engine out once (counted, observed); an engine already down or
    never checked stays as it is."""
    engine, other = _up(Engine("http://a:1"), "m"), Engine("http://b:1")
    pool = EnginePool([engine, other])
    heard: list[Any] = []
    pool.subscribe(lambda e: heard.append((e.id, e.state)))
    pool.mark_down(engine, "POST /v1/completions: answered 500")
    pool.mark_down(engine, "again")
    pool.mark_down(other, "never up")
    assert heard == [("http://a:1", EngineState.DOWN)]
    assert (engine.reason, engine.counts.marked_down) == ("POST /v1/completions: answered 500", 1)
    assert other.state is EngineState.UNKNOWN
    view = engine.view()
    assert (view["state"], view["models"], view["in_flight"]) == ("down", ["m"], 0)
