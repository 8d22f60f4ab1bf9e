"""The front door's planner in front of stand-in engines: predicted blocks, the load bound,
multimodal and fallback prompts, LoRA keys, stale streams, engines going away."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvevents.config import KVEventsConfig
from kvevents.events import BlockRemoved, KVEventBatch
from kvevents.publish import Publisher, create_publisher
from kvevents.route._frontdoor import EngineSpec, FrontDoor
from kvevents.route._plan import PlannerOptions
from kvevents.route._tokens import ModelTokenizer
from kvevents.testing.openai_engine import Behaviour, StandInEngine
from kvevents.testing.sockets import wait_for

MODEL = "tiny"
BLOCK = 16
SYSTEM = "You answer questions about the kvevents front door, briefly and exactly. " * 8

Door = Callable[..., FrontDoor]


@pytest.fixture
def tokenizer(chat_model_tokenizer: Path) -> ModelTokenizer:
    return ModelTokenizer.load(chat_model_tokenizer, model_name=MODEL)


@pytest.fixture
def door(tokenizer: ModelTokenizer) -> Iterator[Door]:
    """A factory of started front doors over stand-in engines (or specs), closed after."""
    with contextlib.ExitStack() as stack:

        def make(*engines: StandInEngine | EngineSpec, **options: Any) -> FrontDoor:
            specs = [
                e if isinstance(e, EngineSpec) else EngineSpec(e.url, f"e{i}")
                for i, e in enumerate(engines)
            ]
            planner = PlannerOptions(block_size=BLOCK, **options)
            front = FrontDoor(
                specs, {None: tokenizer}, planner_options=planner, health_interval=0.2
            )
            return stack.enter_context(front)

        yield make


@pytest.fixture
def engines() -> Iterator[Callable[..., StandInEngine]]:
    made: list[StandInEngine] = []

    def make(**options: Any) -> StandInEngine:
        engine = StandInEngine((MODEL,), **options).start()
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def ask(front: FrontDoor, user: str, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        **extra,
    }
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=30)


def predicted(response: httpx.Response) -> int:
    return int(response.headers["x-kvevents-predicted-cached-tokens"])


def in_background(
    call: Callable[[], httpx.Response],
) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    return thread, out


def burst(front: FrontDoor, pool: list[StandInEngine]) -> list[httpx.Response]:
    """A first question, then three more sent once it is at an engine (all slow to answer):
    the answers, the first one's first."""
    first, answers = in_background(lambda: ask(front, "first question"))
    wait_for(lambda: sum(len(e.received("/v1/chat/completions")) for e in pool) == 1, 5)
    followers = [in_background(lambda i=i: ask(front, f"question {i}")) for i in range(3)]
    for thread, _ in [(first, answers), *followers]:
        thread.join(10)
    return answers + [r for _, out in followers for r in out]


def test_a_burst_sharing_a_new_prefix_lands_where_the_first_was_sent(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """Before any engine announced the prefix, the blocks of a request in flight are
    credited to its engine: the requests after it follow it there, predicted as cached."""
    slow = Behaviour(delay=0.6)
    pool = [engines(behaviour=slow) for _ in range(3)]
    front = door(*pool, policy="longest_prefix")
    replies = burst(front, pool)
    assert len({r.headers["x-kvevents-engine"] for r in replies}) == 1
    assert predicted(replies[0]) == 0
    assert all(predicted(r) > 0 for r in replies[1:])
    assert all(r.status_code == 200 for r in replies)


def test_a_replaying_stream_keeps_the_front_doors_own_credit(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """While the engines' streams replay, the index's matches there are not trusted (they
    may be the engines' past); the blocks of the requests the front door sent itself are:
    a burst sharing a new prefix still lands where its first request went, predicted."""
    replaying = "replaying: the index is behind the stream"
    slow = Behaviour(delay=0.6)
    pool = [engines(behaviour=slow) for _ in range(3)]
    front = door(*pool)
    assert front.service is not None
    for i in range(3):
        front.service.router.mark_degraded(f"e{i}", 0, replaying)
    replies = burst(front, pool)
    assert len({r.headers["x-kvevents-engine"] for r in replies}) == 1
    assert all(predicted(r) > 0 for r in replies[1:])
    record = front.planner.decisions()[0]
    assert {row["degraded"] for row in record["scores"]} == {replaying}


def test_predicted_blocks_expire_after_the_grace_period(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """An answered request's blocks stay predicted for ``grace`` seconds only: the index of
    the engine's own events speaks for them after that (none here: no credit)."""
    front = door(engines(), engines(), grace=0.3)
    assert predicted(ask(front, "once")) == 0
    assert predicted(ask(front, "twice")) > 0
    predictions = front.planner.predictions

    def expired() -> bool:
        predictions.expire()
        return predictions.stats().keys_held == 0

    wait_for(expired, 5)
    assert predicted(ask(front, "after the grace")) == 0


def test_the_load_bound_spills_a_hot_prefix_over_to_other_engines(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """bounded_prefix: concurrent requests sharing a prefix follow it while the engine is
    within the bound of requests in flight (twice the mean or eight more than it), then
    spill to another, which the next one then shares (its predicted blocks); no third engine
    is touched."""
    slow = Behaviour(delay=3.0)
    pool = [engines(behaviour=slow) for _ in range(3)]
    front = door(*pool, policy="bounded_prefix")
    started = []
    for i in range(15):
        started.append(in_background(lambda i=i: ask(front, f"hot {i}")))
        wait_for(lambda n=i + 1: sum(len(e.received("/v1/chat/completions")) for e in pool) >= n, 5)
    for thread, _ in started:
        thread.join(10)
    per_engine = [len(e.received("/v1/chat/completions")) for e in pool]
    # Bounds max(ceil(2 x mean), ceil(mean) + 8), the mean over in flight + 1: the 14th
    # finds the first engine at its bound of 13 and spills; the 15th follows it (the first
    # is still at its bound), and the third engine stays out of it.
    assert sorted(per_engine) == [0, 2, 13]


def test_a_multimodal_request_gets_no_credit_and_no_tokenize_call(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """An image the router cannot key is a miss, never a false hit: predicted 0, no
    /tokenize call, counted."""
    pool = [engines(tokenize=[1, 2, 3]) for _ in range(2)]
    front = door(*pool)
    ask(front, "warm up")
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
        ],
    }
    reply = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200 and predicted(reply) == 0
    assert sum(len(e.received("/tokenize")) for e in pool) == 0
    assert front.planner.stats().counts.multimodal == 1


def test_a_prompt_that_needs_the_engine_asks_one_engine_once(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """What cannot be exact in process costs one /tokenize call to one engine (never one
    per engine), and its ids are routed on like any others."""
    ids = list(range(100, 100 + 5 * BLOCK))
    pool = [engines(tokenize=ids) for _ in range(3)]
    front = door(*pool)
    for _ in range(2):
        reply = ask(front, "coerced", add_generation_prompt="yes")  # pydantic would coerce it
        assert reply.status_code == 200
    assert sum(len(e.received("/tokenize")) for e in pool) == 2
    counts = front.planner.stats().counts
    assert (counts.tokens_fallback, counts.tokenize_calls, counts.tokenize_errors) == (2, 2, 0)
    assert predicted(reply) == 4 * BLOCK  # the first's blocks, credited; never the last token's


def test_a_lora_adapter_is_keyed_apart_from_its_base_model(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """A model listed with a parent is a LoRA adapter: tokenized as its base model, and its
    blocks keyed apart (the base model's do not count for it)."""
    pool = [engines(adapters={"tiny-lora": MODEL}) for _ in range(2)]
    front = door(*pool)
    ask(front, "base")
    lora = ask(front, "base", model="tiny-lora")
    assert lora.status_code == 200 and predicted(lora) == 0
    assert predicted(ask(front, "base", model="tiny-lora")) > 0


_EVENTS = KVEventsConfig(
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:0",
    replay_endpoint="tcp://127.0.0.1:0",
)


def _streamed_door(door: Door, engine: StandInEngine, publisher: Publisher) -> FrontDoor:
    """A front door (stale_after 0.3 s) over ``engine`` whose event stream is ``publisher``,
    once a batch of it has been applied and the stream is live."""
    spec = EngineSpec(engine.url, "e0", publisher.endpoint, publisher.replay_endpoint)
    front = door(spec, stale_after=0.3)
    service = front.service
    assert service is not None

    def applied() -> bool:  # again until one is: a subscriber still joining misses it
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        return any(s.batches for s in service.stream_infos())

    wait_for(applied, 10, interval=0.05)
    wait_for(lambda: not service.degraded(), 10)  # a late join replays first
    return front


def test_a_stream_whose_events_stop_loses_its_credit_and_health_says_so(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """An answered request not followed by a batch from the engine's stream within
    stale_after: that stream gets no credit, /health says degraded naming it; a batch
    brings it back."""
    with create_publisher(_EVENTS) as publisher:
        engine = engines()
        front = _streamed_door(door, engine, publisher)
        ask(front, "is anyone listening")
        deadline = time.monotonic() + 5
        while not front.planner.stale and time.monotonic() < deadline:
            ask(front, "still there?")
            time.sleep(0.1)
        health = httpx.get(f"{front.url}/health").json()
        assert health["status"] == "degraded" and health["streams_without_credit"] == ["e0"]
        assert front.planner.stats().counts.stale_marks == 1
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_for(lambda: ask(front, "back") is not None and not front.planner.stale, 10)
        wait_for(lambda: httpx.get(f"{front.url}/health").json()["status"] == "ok", 10)


def test_answers_that_store_no_block_leave_the_stream_trusted(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """An engine that found every prompt whole in its cache and answered too briefly to fill
    a block stored nothing and publishes nothing: its stream is not marked stale for it, for
    as long as the test above takes to mark one (a prompt with one block more to compute,
    asked of the same stream, arms the watch)."""
    cached = Behaviour(prompt_tokens=4 * BLOCK, cached_tokens=4 * BLOCK, tokens=1)
    with create_publisher(_EVENTS) as publisher:
        engine = engines(behaviour=cached)
        front = _streamed_door(door, engine, publisher)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert ask(front, "all of it cached").status_code == 200
            assert not front.planner.stale and not front.planner._watch
            time.sleep(0.1)
        assert front.planner.stats().counts.stale_marks == 0
        engine.behaviour = Behaviour(prompt_tokens=4 * BLOCK, cached_tokens=3 * BLOCK, tokens=1)
        ask(front, "one block to compute")
        assert list(front.planner._watch) == [("e0", 0)]


def test_an_engine_that_goes_down_loses_its_predicted_blocks(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """A down engine may come back with an empty cache: its credit goes at once."""
    pool = [engines(), engines()]
    front = door(*pool)
    reply = ask(front, "before")
    assert front.planner.predictions.stats().keys_held > 0
    chosen = int(reply.headers["x-kvevents-engine"].removeprefix("e"))
    pool[chosen].close()
    engine = front.pool.engines[chosen]
    wait_for(lambda: not engine.up, 5)
    assert front.planner.predictions.stats().keys_held == 0


def test_the_status_page_and_its_json_show_engines_streams_and_decisions(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """GET / is the page (its script allowed by hash); /status has the engines, streams and
    the last decisions with what the engines reported."""
    front = door(engines(behaviour=Behaviour(cached_tokens=0)))
    ask(front, "status please")
    page = httpx.get(f"{front.url}/")
    assert page.status_code == 200 and "sha256-" in page.headers["content-security-policy"]
    status = httpx.get(f"{front.url}/status").json()
    assert [e["id"] for e in status["engines"]] == ["e0"]
    decision = status["decisions"][0]
    assert decision["winner"] == "e0" and decision["reported_cached_tokens"] == 0
    assert decision["tokens"]["source"] == "chat" and decision["tokens"]["count"] > 0
    assert status["planner"]["counts"]["compared"] == 1


def test_each_answer_says_how_it_was_decided(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """The response headers explain the decision: matched blocks per engine, the policy and
    why the winner won."""
    front = door(engines(), engines(), policy="longest_prefix")
    ask(front, "explain yourself")
    reply = ask(front, "explain yourself")
    winner = reply.headers["x-kvevents-engine"]
    matched = dict(
        part.split("=") for part in reply.headers["x-kvevents-matched-blocks"].split(", ")
    )
    assert set(matched) == {"e0", "e1"} and int(matched[winner]) > 0
    assert reply.headers["x-kvevents-policy"] == "longest_prefix"
    assert reply.headers["x-kvevents-reason"].startswith("most matched blocks")


def test_a_decision_is_explained_once_its_request_is_on_its_way(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """The plan leaves its explanation (and the headers made of it) to ``started``, which the
    proxy calls once the request is sent; a plan no attempt followed is explained when the
    status page asks. Either way the record is the same decision, made once."""
    import asyncio
    import json

    from kvevents.route._parse import route_request

    front = door(engines(), engines(), policy="longest_prefix")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "explain later"}]}
    request = route_request("/v1/chat/completions", json.dumps(body).encode(), [])
    planner = front.planner
    sent, unsent = asyncio.run(planner.plan(request)), asyncio.run(planner.plan(request))
    assert sent.explain == {} and sent.headers == () and sent.candidates
    planner.started(sent, sent.candidates[0])
    assert sent.explain["policy"] == "longest_prefix" and sent.explain["tokens"]["count"] > 0
    assert dict(sent.headers)[b"x-kvevents-policy"] == b"longest_prefix"
    explained = dict(sent.explain)
    planner.started(sent, sent.candidates[0])  # a retry on the next engine: not again
    assert sent.explain == explained
    newest, older = planner.decisions()[:2]
    assert older == {"time": older["time"], **explained}

    def foreseen(scores: list[dict[str, Any]]) -> dict[str, Any]:
        return {row["engine"]: row["prefill_hit_blocks"] for row in scores}

    def rest(scores: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k != "prefill_hit_blocks"} for row in scores]

    # What the prefill will find is foreseen for the engine a request is sent to, alone.
    sent_to = sent.candidates[0].id
    assert foreseen(explained["scores"]) == {"e0": None, "e1": None, sent_to: 0}
    assert foreseen(newest["scores"]) == {"e0": None, "e1": None}
    assert newest["policy"] == "longest_prefix"
    assert rest(newest["scores"]) == rest(explained["scores"])
    assert unsent.explain is not None and unsent.explain["winner"] == newest["winner"]


def _blocks_of(tokenizer: ModelTokenizer, system: str, user: str) -> int:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = tokenizer.chat({"model": MODEL, "messages": messages})
    assert prompt.token_ids is not None
    return len(prompt.token_ids) // BLOCK


def ask_as(front: FrontDoor, system: str, user: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=30)


def test_the_engines_cache_size_keeps_a_new_prefix_off_an_engine_it_would_overfill(
    door: Door, engines: Callable[..., StandInEngine], tokenizer: ModelTokenizer
) -> None:
    """Each engine's cache size comes from its /metrics (vLLM's num_gpu_blocks, less the
    null block). One engine runs a long prompt, the other two short ones: a new long prompt
    goes to the one with more requests in flight, because on the other it would push blocks
    out of a cache that cannot hold both long prompts (fewer requests would have won)."""
    other = "You translate short notes about caches into plain words, nothing else. " * 8
    long_blocks = _blocks_of(tokenizer, SYSTEM, "long one")
    # It overfills the long one's engine, and fits beside the short ones.
    assert 2 < _blocks_of(tokenizer, other, "new long one") <= long_blocks + 1
    assert _blocks_of(tokenizer, "", "hi") <= 1
    slow = Behaviour(delay=3.0)
    pool = [engines(behaviour=slow, num_gpu_blocks=long_blocks + 3) for _ in range(2)]
    front = door(*pool)
    assert [e.cache_blocks for e in front.pool.engines] == [long_blocks + 2] * 2

    def arrived(n: int) -> bool:
        return sum(len(e.received("/v1/chat/completions")) for e in pool) >= n

    started = [in_background(lambda: ask_as(front, SYSTEM, "long one"))]
    wait_for(lambda: arrived(1), 5)
    for n in (2, 3):
        started.append(in_background(lambda: ask_as(front, "", "hi")))
        wait_for(lambda n=n: arrived(n), 5)
    started.append(in_background(lambda: ask_as(front, other, "new long one")))
    for thread, _ in started:
        thread.join(10)
    replies = [out[0] for _, out in started]
    long_engine, new_engine = (r.headers["x-kvevents-engine"] for r in (replies[0], replies[3]))
    assert {r.headers["x-kvevents-engine"] for r in replies[1:3]} == {"e0", "e1"} - {long_engine}
    assert new_engine != long_engine


def test_an_over_prediction_the_engines_evictions_account_for_is_an_eviction_race(
    door: Door, engines: Callable[..., StandInEngine]
) -> None:
    """An engine that served fewer cached tokens than predicted: counted over; and evicted
    too (an eviction race, which the drift alert leaves out) only when its stream announced
    at least as many blocks removed while the request was in flight as it came short."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
    )
    with create_publisher(config) as publisher:
        engine = engines(behaviour=Behaviour(cached_tokens=0, delay=1.5))
        spec = EngineSpec(engine.url, "e0", publisher.endpoint, publisher.replay_endpoint)
        front = door(spec, grace=60.0)
        service = front.service
        assert service is not None
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_for(lambda: any(s.batches for s in service.stream_infos()), 10)
        assert predicted(ask(front, "twice")) == 0  # nothing credited yet: exact
        quiet = ask(front, "twice")  # its blocks credited by the first: the engine says 0
        counts = front.planner.stats().counts
        assert predicted(quiet) > 0 and (counts.over, counts.evicted) == (1, 0)
        thread, out = in_background(lambda: ask(front, "twice"))
        wait_for(lambda: len(engine.received("/v1/chat/completions")) == 3, 5)
        removed = BlockRemoved(block_hashes=list(range(1, 65)))
        publisher.publish(KVEventBatch(ts=time.time(), events=[removed]))
        wait_for(lambda: service.removed_blocks("e0", 0) == 64, 5)
        thread.join(10)
        counts = front.planner.stats().counts
        assert predicted(out[0]) > 0 and (counts.over, counts.evicted) == (2, 1)
        decisions = httpx.get(f"{front.url}/status").json()["decisions"]
        assert [d.get("eviction_race", False) for d in decisions].count(True) == 1


def test_blocks_the_requests_ahead_will_evict_are_not_predicted(
    door: Door, engines: Callable[..., StandInEngine], tokenizer: ModelTokenizer
) -> None:
    """A prompt whose blocks an earlier request freed, sent behind a request that needs
    nearly the whole cache: its prediction counts only the blocks that request's prefill
    leaves (the newest of the free queue: the prompt's first ones), and says so; an engine
    that kept more than that (no more than matched) is not a misprediction of tokens."""
    other = "You translate short notes about caches into plain words, nothing else. " * 8
    blocks, theirs = _blocks_of(tokenizer, SYSTEM, "again"), _blocks_of(tokenizer, other, "x")
    # The engine says it served the whole prompt from cache every time (it kept them all).
    kept = Behaviour(delay=1.0, cached_tokens=blocks * BLOCK)
    engine = engines(behaviour=kept, num_gpu_blocks=blocks + 3)
    front = door(engine, grace=60.0)
    capacity = blocks + 2
    assert front.pool.engines[0].cache_blocks == capacity
    first = ask_as(front, SYSTEM, "again")  # ends: its blocks join the free queue
    assert predicted(first) == 0
    assert predicted(ask_as(front, SYSTEM, "again")) == blocks * BLOCK  # nothing ahead of it
    thread, _ = in_background(lambda: ask_as(front, other, "x"))
    wait_for(lambda: len(engine.received("/v1/chat/completions")) == 3, 5)
    behind = ask_as(front, SYSTEM, "again")
    thread.join(10)
    room = capacity - theirs - 1  # the request ahead pins its blocks and a partial one
    assert 0 < room < blocks
    assert predicted(behind) == room * BLOCK
    counts = front.planner.stats().counts
    assert counts.foreseen_evictions == 1
    # The first answer's report and the other prompt's are more than was matched (nothing):
    # misses. The last one's is no more than was matched: blocks the forecast gave up, which
    # the engine kept.
    assert (counts.exact, counts.under, counts.kept_foreseen) == (1, 3, 1)
    decision = httpx.get(f"{front.url}/status").json()["decisions"][0]
    [row] = decision["scores"]
    assert (row["matched_blocks"], row["prefill_hit_blocks"]) == (blocks, room)
    assert decision["kept_foreseen"] is True
