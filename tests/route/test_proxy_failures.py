"""Never a 5xx while a healthy engine exists: retries before the first byte, health checks
active and passive, and what the client gets when nothing can answer; a client that goes
away cancels its request on the engine."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from kvevents.route import Engine, EngineState, ProxyOptions
from kvevents.testing.openai_engine import Behaviour, StandInEngine
from kvevents.testing.rawhttp import RawConnection, request_bytes
from kvevents.testing.route import RoundRobinPlanner, RunningProxy
from kvevents.testing.sockets import wait_for

Engines = Callable[..., StandInEngine]
Proxy = Callable[..., RunningProxy]

CHAT = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}


def _in_order(pool: Any) -> RoundRobinPlanner:
    return RoundRobinPlanner(pool, rotate=False)


def _refused_url() -> str:
    """A loopback URL nothing listens on (bound then closed, so the port was free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _state(front: RunningProxy, engine: StandInEngine) -> EngineState:
    return front.engine(engine.url).state


def test_a_dead_engine_is_retried_on_the_next(engines: Engines, proxy: Proxy) -> None:
    """An engine that dies after it was checked: the request that finds its port closed is
    answered by the next engine, and the dead one is taken out of routing at once."""
    dying, alive = engines(), engines()
    front = proxy(dying, alive, planner=_in_order)
    dying.close()
    with httpx.Client(base_url=front.url) as client:
        replies = [client.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert [r.status_code for r in replies] == [200] * 3
    assert {r.headers["x-kvevents-engine"] for r in replies} == {alive.url}
    assert _state(front, dying) is EngineState.DOWN
    counts = front.engine(dying.url).counts
    assert counts.connect_errors + counts.resets >= 1
    kinds = [o.kind for o in front.planner.outcomes()]
    assert kinds[-1] == "ok" and set(kinds) <= {"ok", "connect_error", "reset"}
    assert front.app.stats().counts.retries >= 1


def test_a_5xx_is_retried_and_marks_the_engine_down(engines: Engines, proxy: Proxy) -> None:
    """An engine answering 500 (its /health failing too) is skipped: the client gets the
    next engine's 200, the failing one is down until its check passes, and the planner
    hears both attempts."""
    failing = engines(behaviour=Behaviour(status=500))
    alive = engines()
    front = proxy(failing, alive, planner=_in_order)
    failing.behaviour = Behaviour(status=500, health_status=500)
    reply = httpx.post(front.url + "/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200 and reply.headers["x-kvevents-engine"] == alive.url
    assert [(o.kind, o.status) for o in front.planner.outcomes()] == [
        ("http_error", 500),
        ("ok", 200),
    ]
    assert [engine.url for _, engine in front.planner.sent] == [failing.url, alive.url]
    assert _state(front, failing) is EngineState.DOWN
    # Down at once for the request, then still down by its check, which says why.
    checked = "GET /health answered 500"
    wait_for(lambda: front.engine(failing.url).reason == checked, 5, what="the check")
    failing.behaviour = Behaviour()
    wait_for(lambda: _state(front, failing) is EngineState.UP, 5, what="the engine back")


def test_an_engine_failing_one_request_comes_back_at_once(engines: Engines, proxy: Proxy) -> None:
    """A 5xx takes the engine out and checks it again at once: when its /health passes it
    is back long before the next periodic check."""
    flaky, alive = engines(behaviour=Behaviour(status=503)), engines()
    front = proxy(flaky, alive, planner=_in_order, interval=60.0)
    assert httpx.post(front.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert front.engine(flaky.url).counts.marked_down == 1
    wait_for(lambda: _state(front, flaky) is EngineState.UP, 5, what="the engine back")


def test_a_connection_lost_before_the_answer_is_retried(engines: Engines, proxy: Proxy) -> None:
    """An engine that closes the connection without a byte of answer: the next engine
    answers, and the attempt is reported as a reset."""
    rude = engines(behaviour=Behaviour(hang_up=True))
    alive = engines()
    front = proxy(rude, alive, planner=_in_order)
    reply = httpx.post(front.url + "/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200 and reply.headers["x-kvevents-engine"] == alive.url
    assert [o.kind for o in front.planner.outcomes()] == ["reset", "ok"]
    assert front.engine(rude.url).counts.resets == 1


def test_when_every_engine_fails_the_client_gets_a_502(engines: Engines, proxy: Proxy) -> None:
    """Every engine answering 500: one OpenAI-shaped 502 naming each engine and what it
    said, after one attempt on each."""
    first = engines(behaviour=Behaviour(status=500))
    second = engines(behaviour=Behaviour(status=500))
    front = proxy(first, second, planner=_in_order, interval=60.0)
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="stand-in", messages=CHAT["messages"])
    assert caught.value.status_code == 502
    message = caught.value.body["message"]  # type: ignore[index]
    assert message == (
        f"no engine could answer: {first.url}: answered 500; {second.url}: answered 500"
    )
    assert len(front.planner.outcomes()) == 2


def test_no_healthy_engine_is_a_503_and_an_unknown_model_a_404(
    engines: Engines, proxy: Proxy
) -> None:
    """With every engine down the client gets a 503 saying so; a model no engine serves is
    a 404 with code model_not_found, as OpenAI answers."""
    down = engines(behaviour=Behaviour(health_status=500))
    front = proxy(down)
    reply = httpx.post(front.url + "/v1/chat/completions", json=CHAT)
    assert reply.status_code == 503
    assert reply.json() == {
        "error": {
            "message": "no healthy engine serves `stand-in` right now",
            "type": "server_error",
            "param": None,
            "code": "no_healthy_engine",
        }
    }
    up = proxy(engines())
    reply = httpx.post(up.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": "the model `gpt-9` does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_an_engine_down_at_start_is_no_404(engines: Engines, proxy: Proxy) -> None:
    """A model is not called unknown while an engine whose models were never read is down:
    503, then served once that engine comes up with its models read."""
    late = engines("late-model", behaviour=Behaviour(health_status=503))
    front = proxy(late, interval=0.2)
    body = {**CHAT, "model": "late-model"}
    assert httpx.post(front.url + "/v1/chat/completions", json=body).status_code == 503
    late.behaviour = Behaviour()
    wait_for(lambda: _state(front, late) is EngineState.UP, 5, what="the engine up")
    assert httpx.post(front.url + "/v1/chat/completions", json=body).status_code == 200


def test_active_checks_take_engines_out_and_back(engines: Engines, proxy: Proxy) -> None:
    """A failing /health takes an engine out of routing, a passing one puts it back with
    its model list read again; observers hear each change."""
    engine, other = engines("m1"), engines("m1")
    front = proxy(engine, other, interval=0.1)
    heard: list[tuple[str, EngineState]] = []

    def observe(changed: Engine) -> None:
        heard.append((changed.id, changed.state))

    front.pool.subscribe(observe)
    engine.behaviour = Behaviour(health_status=503)
    wait_for(lambda: _state(front, engine) is EngineState.DOWN, 5, what="the engine down")
    with httpx.Client(base_url=front.url) as client:
        replies = [
            client.post("/v1/chat/completions", json={**CHAT, "model": "m1"}) for _ in range(4)
        ]
        assert {r.headers["x-kvevents-engine"] for r in replies} == {other.url}
        engine.models = ("m1", "m2")
        engine.behaviour = Behaviour()
        wait_for(lambda: _state(front, engine) is EngineState.UP, 5, what="the engine up")
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m1", "m2"]
    assert heard == [(engine.url, EngineState.DOWN), (engine.url, EngineState.UP)]


def test_a_health_check_that_hangs_is_bounded(engines: Engines, proxy: Proxy) -> None:
    """A /health that never answers fails its check after the check's timeout."""
    engine, other = engines(), engines()
    front = proxy(engine, other, interval=0.1, timeout=0.2)
    engine.behaviour = Behaviour(health_delay=math.inf)
    wait_for(lambda: _state(front, engine) is EngineState.DOWN, 5, what="the engine down")
    assert front.engine(engine.url).reason == "GET /health did not answer within 0.2 s"


def test_a_slow_health_check_keeps_an_engine_that_answers_requests(
    engines: Engines, proxy: Proxy
) -> None:
    """A /health that misses its deadline while the engine answers requests (a saturated host)
    is slow, not failed: the engine stays in routing (counted); once it answers nothing
    either, the next timed-out check takes it out."""
    engine = engines()
    front = proxy(engine, interval=0.1, timeout=0.2)
    engine.behaviour = Behaviour(health_delay=math.inf)
    counts = front.engine(engine.url).counts
    with httpx.Client(base_url=front.url, timeout=10) as client:
        while counts.checks_slow < 3:  # bounded by the test's timeout
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert _state(front, engine) is EngineState.UP
    assert counts.checks_failed == 0 and counts.marked_down == 0
    wait_for(lambda: _state(front, engine) is EngineState.DOWN, 5, what="the engine down")
    assert front.engine(engine.url).reason == "GET /health did not answer within 0.2 s"


def test_a_failing_observer_or_planner_stops_nothing(engines: Engines, proxy: Proxy) -> None:
    """An observer that raises does not stop the health checks; a planner whose plan()
    raises still gets the request routed to a healthy engine (counted)."""

    class Broken(RoundRobinPlanner):
        async def plan(self, request: Any) -> Any:
            raise RuntimeError("planner bug")

    engine = engines()
    front = proxy(engine, planner=Broken, interval=0.1)

    def fail(changed: Engine) -> None:
        raise RuntimeError("observer bug")

    front.pool.subscribe(fail)
    assert httpx.post(front.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert front.app.stats().counts.planner_errors == 1
    engine.behaviour = Behaviour(health_status=500)
    wait_for(lambda: _state(front, engine) is EngineState.DOWN, 5, what="the engine down")
    engine.behaviour = Behaviour()
    wait_for(lambda: _state(front, engine) is EngineState.UP, 5, what="the engine back")


def test_no_answer_in_time_is_a_504_not_retried(engines: Engines, proxy: Proxy) -> None:
    """An engine that never sends its headers: 504 after first_byte_timeout, no second
    engine asked (it could only double the load), and the engine sees its request closed."""
    stuck, spare = engines(behaviour=Behaviour(delay=math.inf)), engines()
    options = ProxyOptions(first_byte_timeout=0.3)
    front = proxy(stuck, spare, planner=_in_order, options=options)
    reply = httpx.post(front.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "upstream_timeout"
    assert spare.received("/v1/chat/completions") == []
    assert [o.kind for o in front.planner.outcomes()] == ["timeout"]
    stuck.wait_aborted(1)


def test_an_idle_stream_is_cut_off(
    engines: Engines, proxy: Proxy, capfd: pytest.CaptureFixture[str]
) -> None:
    """A stream that goes silent for idle_timeout is cut: the client sees it incomplete,
    the engine sees its connection closed, and the server logs no error of its own (the
    proxy's one warning says what happened)."""
    engine = engines(behaviour=Behaviour(tokens=3, token_delay=30))
    front = proxy(engine, options=ProxyOptions(idle_timeout=0.3))
    with RawConnection(front.port) as conn:
        conn.send(request_bytes("POST", "/v1/chat/completions", b'{"messages":[],"stream":true}'))
        reply = conn.read_response()
    assert reply.status == 200 and not reply.complete
    assert reply.chunks is not None and len(reply.chunks) == 1  # the role event, then silence
    engine.wait_aborted(1)
    assert [o.kind for o in front.planner.outcomes()] == ["timeout"]
    assert front.engine(engine.url).counts.timeouts == 1
    assert "ASGI callable returned without completing response" not in capfd.readouterr().err


def test_a_stream_closed_midway_reaches_the_client_incomplete(
    engines: Engines, proxy: Proxy
) -> None:
    """An engine closing the connection mid-stream: the client's stream ends without its
    last chunk (never a clean end it did not get), the planner hears a reset."""
    engine = engines(behaviour=Behaviour(tokens=10, close_after=4, token_delay=0.001))
    front = proxy(engine)
    with RawConnection(front.port) as conn:
        conn.send(request_bytes("POST", "/v1/completions", b'{"prompt":"x","stream":true}'))
        reply = conn.read_response()
        assert conn.closed_by_peer()
    assert not reply.complete and reply.chunks is not None and len(reply.chunks) == 4
    assert [(o.kind, o.status) for o in front.planner.outcomes()] == [("reset", 200)]
    assert front.app.stats().counts.truncated == 1


def _openai(front: RunningProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0, timeout=10)


def test_a_stream_whose_engine_is_lost_is_continued_on_the_next(
    engines: Engines, proxy: Proxy
) -> None:
    """An engine lost after two tokens of a chat stream: the client's stream goes on from the
    next engine, asked to continue the answer so far, as one answer (one id, one role, the
    whole usage), and the openai client sees no error."""
    dying = engines(behaviour=Behaviour(tokens=10, close_after=3, token_delay=0.001))
    alive = engines()
    front = proxy(dying, alive, planner=_in_order)
    chunks = list(
        _openai(front).chat.completions.create(
            model="stand-in",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=10,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 " + "tok0 tok1 tok2 tok3 "
    assert {c.id for c in chunks} == {f"chatcmpl-stand-in-{dying.port}"}
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 + 4
    (asked,) = alive.received("/v1/chat/completions")
    body = json.loads(asked.body)
    assert body["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8
    assert [o.kind for o in front.planner.outcomes()] == ["reset", "ok"]
    counts = front.app.stats().counts
    assert (counts.continued, counts.truncated) == (1, 0)


def test_a_continuation_that_breaks_goes_on_to_a_third_engine(
    engines: Engines, proxy: Proxy
) -> None:
    """Two engines lost one after the other: the completion stream ends whole on the third,
    each continuation asked with the text the client had by then."""
    first = engines(behaviour=Behaviour(tokens=10, close_after=2, token_delay=0.001))
    second = engines(behaviour=Behaviour(tokens=10, close_after=1, token_delay=0.001))
    third = engines()
    front = proxy(first, second, third, planner=_in_order)
    with RawConnection(front.port) as conn:
        body = b'{"prompt":"once","stream":true}'
        conn.send(request_bytes("POST", "/v1/completions", body))
        reply = conn.read_response()
    assert reply.status == 200 and reply.complete and reply.body.endswith(b"data: [DONE]\n\n")
    assert reply.header("x-kvevents-engine") == first.url.encode()
    asked = (*second.received("/v1/completions"), *third.received("/v1/completions"))
    prompts = [json.loads(r.body)["prompt"] for r in asked]
    assert prompts == ["oncetok0 tok1 ", "oncetok0 tok1 tok0 "]
    assert b"".join(reply.chunks or ()).count(b'"text":"tok') == 2 + 1 + 4
    assert front.app.stats().counts.continued == 1


def test_a_stream_that_lost_only_its_end_is_ended_for_the_client(
    engines: Engines, proxy: Proxy
) -> None:
    """An engine lost after its finishing event: the client has the whole answer, so its
    stream is ended cleanly there (``[DONE]``), and no engine is asked for more."""
    dying = engines(behaviour=Behaviour(tokens=3, close_at_end=True))
    other = engines()
    front = proxy(dying, other, planner=_in_order)
    with RawConnection(front.port) as conn:
        body = b'{"messages":[{"role":"user","content":"hi"}],"stream":true}'
        conn.send(request_bytes("POST", "/v1/chat/completions", body))
        reply = conn.read_response()
    assert reply.status == 200 and reply.complete
    assert reply.body.count(b'"content":"tok') == 3 and b'"finish_reason":"stop"' in reply.body
    assert reply.body.endswith(b"data: [DONE]\n\n")
    assert other.received("/v1/chat/completions") == []
    counts = front.app.stats().counts
    assert (counts.continued, counts.truncated) == (0, 0)


@pytest.mark.parametrize("case", ["switched off", "refused", "not plain text"])
def test_a_stream_that_cannot_be_continued_is_cut_off(
    engines: Engines, proxy: Proxy, case: str
) -> None:
    """Continuing is off, the next engine refuses the continuation (a 4xx, as every engine
    would), or the request asks for what a continuation cannot keep (two choices): the
    client's stream ends incomplete, as without another engine."""
    dying = engines(behaviour=Behaviour(tokens=10, close_after=3, token_delay=0.001))
    other = engines(behaviour=Behaviour(status=400) if case == "refused" else None)
    options = ProxyOptions(continue_streams=case != "switched off")
    front = proxy(dying, other, planner=_in_order, options=options)
    n = ',"n":2' if case == "not plain text" else ""
    with RawConnection(front.port) as conn:
        body = b'{"messages":[{"role":"user","content":"hi"}],"stream":true%s}' % n.encode()
        conn.send(request_bytes("POST", "/v1/chat/completions", body))
        reply = conn.read_response()
    assert reply.status == 200 and not reply.complete
    assert len(other.received("/v1/chat/completions")) == (case == "refused")
    counts = front.app.stats().counts
    assert (counts.continued, counts.truncated) == (0, 1)


def test_a_stream_broken_before_its_first_piece_is_retried_elsewhere(
    engines: Engines, proxy: Proxy
) -> None:
    """An engine that sends a stream's 200 headers and dies before its first piece (as vLLM
    does when killed during a prefill): nothing went to the client, so the request is answered
    whole by the next engine, headers and all."""
    dying = engines(behaviour=Behaviour(tokens=10, close_after=0))
    alive = engines()
    front = proxy(dying, alive, planner=_in_order)
    with RawConnection(front.port) as conn:
        conn.send(request_bytes("POST", "/v1/completions", b'{"prompt":"x","stream":true}'))
        reply = conn.read_response()
    assert reply.status == 200 and reply.complete and b"[DONE]" in reply.body
    assert reply.header("x-kvevents-engine") == alive.url.encode()
    assert [o.kind for o in front.planner.outcomes()] == ["reset", "ok"]
    assert front.engine(dying.url).counts.resets == 1
    assert front.app.stats().counts.truncated == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_the_engine_request(
    engines: Engines, proxy: Proxy, stream: bool
) -> None:
    """A client closing its connection mid-answer (streamed) or while the engine is still
    working (not streamed) closes the request's connection to the engine."""
    behaviour = Behaviour(tokens=1000, token_delay=0.05) if stream else Behaviour(delay=math.inf)
    engine = engines(behaviour=behaviour)
    front = proxy(engine)
    body = b'{"messages":[],"stream":true}' if stream else b'{"messages":[]}'
    conn = RawConnection(front.port)
    conn.send(request_bytes("POST", "/v1/chat/completions", body))
    if stream:
        conn.read_head()
        assert conn.read_chunk()
    else:
        wait_for(lambda: engine.received("/v1/chat/completions"), 5, what="the request")
    conn.close()
    engine.wait_aborted(1)
    wait_for(lambda: front.planner.outcomes(), 5, what="the outcome")
    assert [o.kind for o in front.planner.outcomes()] == ["client_gone"]
    assert front.engine(engine.url).counts.client_gone == 1
    assert front.app.stats().counts.client_disconnects == 1
    wait_for(lambda: front.engine(engine.url).in_flight == 0, 5, what="nothing in flight")
