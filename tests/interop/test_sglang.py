"""The SGLang plugin (kvevents.integrations.sglang) with SGLang's real publisher-side code.

SGLang's wheel (``make sglang``: ``.venv-sglang``) runs ``sglang_publisher.py``: its own
``load_plugins()`` finds our entry point, its ``EventPublisherFactory`` builds our publisher from
its own config JSON, and its own event classes make the events. Our ``Subscriber`` and NVIDIA
Dynamo's indexer read what ours publishes, and SGLang's own ZeroMQ publisher, fed the same
batches, sends the same frames. Skipped with the reason where the wheel is not installed; failed
instead when ``KVEVENTS_REQUIRE_SGLANG`` is set.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from sglang_peer import REQUIRE_ENV, SGLang, find_sglang_python, sglang_unavailable_reason

from kvevents.deadline import Deadline
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.subscribe import Delivery, StreamSpec, Subscriber
from kvevents.testing.dynamo import DynamoIndexer, dynamo_unavailable_reason
from kvevents.wire import decode_batch, pack_seq, replay_end_frames, replay_request_frames

pytestmark = [pytest.mark.interop, pytest.mark.sglang, pytest.mark.timeout(300)]

BLOCK = 4
TS = 1700000000.25
PLUGIN = "kvevents.integrations.sglang.SGLangPublisher"
SGLANG_OWN = "sglang.srt.disaggregation.kv_events.ZmqEventPublisher"


def config(publisher: str = "kvevents", **fields: Any) -> str:
    """SGLang's --kv-events-config JSON, on loopback ports the system picks."""
    base = {
        "publisher": publisher,
        "endpoint": "tcp://127.0.0.1:0",
        "bind": True,
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": "kv",
        "format": "dynamo",
    }
    return json.dumps({**base, **fields})


def stored(first: int, count: int = 1, parent: int | None = None, **extra: Any) -> dict[str, Any]:
    """SGLang's BlockStored fields for ``count`` blocks of tokens from ``first * BLOCK``."""
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first, first + count)),
        "parent_block_hash": parent,
        "token_ids": list(range(first * BLOCK, (first + count) * BLOCK)),
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        **extra,
    }


def ours(first: int, count: int = 1, parent: int | None = None) -> BlockStored:
    """Our BlockStored for :func:`stored`'s blocks."""
    return BlockStored(
        block_hashes=list(range(first, first + count)),
        parent_block_hash=parent,
        token_ids=list(range(first * BLOCK, (first + count) * BLOCK)),
        block_size=BLOCK,
        medium="GPU",
    )


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """SGLang's interpreter; skip without it, or fail when KVEVENTS_REQUIRE_SGLANG is set."""
    reason = sglang_unavailable_reason()
    if reason is not None and os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but {reason}")
    if reason is not None:
        pytest.skip(reason)
    python = find_sglang_python()
    assert python is not None
    return python


@pytest.fixture
def sglang(sglang_python: str) -> Iterator[SGLang]:
    """SGLang's kv-events module after SGLang's own ``load_plugins()``."""
    with SGLang(sglang_python, plugins=True) as peer:
        yield peer


def test_sglang_loads_our_plugin_into_its_factory(sglang: SGLang) -> None:
    """SGLang's load_plugins() runs our entry point: its factory knows "kvevents"."""
    hello = sglang.ready()
    assert hello["version"] == "0.5.23"
    assert hello["registry"] == ["kvevents", "null", "zmq"]


def test_sglangs_factory_builds_our_publisher_from_its_config(sglang: SGLang) -> None:
    """SGLang's own JSON (bind, format, a DP rank) builds ours; it describes its local source."""
    made = sglang.call("create", config=config(), rank=1, block_size=BLOCK)
    assert made["class"] == PLUGIN
    source = made["source"]
    assert source["dp_rank"] == 1 and source["topic"] == "kv" and source["block_size"] == BLOCK
    assert source["endpoint"].startswith("tcp://127.0.0.1:")
    assert source["replay_endpoint"].startswith("tcp://127.0.0.1:")


def test_without_the_plugin_sglang_does_not_know_the_name(sglang_python: str) -> None:
    """Without load_plugins() SGLang refuses "kvevents": the entry point is what registers it."""
    with SGLang(sglang_python, plugins=False) as bare:
        assert "kvevents" not in bare.ready()["registry"]
        reply = bare.try_call("create", config=config(), rank=0)
    assert "Unknown event publisher 'kvevents'" in reply["error"]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"bind": False}, "bind is false"),
        ({"endpoint": "tcp://127.0.0.1:5557", "bind": None}, "a concrete host and no bind"),
    ],
)
def test_configs_ours_cannot_honour_fail_at_start(
    sglang: SGLang, fields: dict[str, Any], words: str
) -> None:
    """A config SGLang would connect with fails SGLang's factory naming bind and the way out."""
    reply = sglang.try_call("create", config=config(**fields), rank=0)
    assert "ValidationError" in reply["error"] and words in reply["error"]
    assert "set bind to true" in reply["error"]


def test_sglang_events_reach_our_subscriber_through_ours(sglang: SGLang) -> None:
    """SGLang's events, published by ours, arrive decoded and rank-stamped; an EAGLE bigram
    store arrives as its tokens plus the one after them; an event we cannot read (pairs that
    do not chain) is skipped and counted, its batch's other events delivered."""
    made = sglang.call("create", config=config(), rank=0)
    source = made["source"]
    bigram = {**stored(9), "token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]]}
    broken = {**stored(8), "token_ids": [[1, 2], [7, 8], [3, 4], [4, 5]]}
    batches = [
        [stored(0, 2)],
        [stored(2, 1, parent=1), {"type": "BlockRemoved", "block_hashes": [0], "medium": "GPU"}],
        [bigram, broken, stored(3, 1, parent=2)],
        [{"type": "AllBlocksCleared"}],
    ]
    read_bigram = BlockStored(
        block_hashes=[9],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=BLOCK,
        medium="GPU",
        lookahead_token_ids=[5],
    )
    expected = [
        [ours(0, 2)],
        [ours(2, 1, parent=1), BlockRemoved(block_hashes=[0], medium="GPU")],
        [read_bigram, ours(3, 1, parent=2)],
        [AllBlocksCleared()],
    ]
    spec = StreamSpec("sg", 0, source["endpoint"], source["replay_endpoint"], topic="kv")
    with Subscriber([spec]) as subscriber:
        got = _drain(sglang, made["id"], subscriber, batches)
    stats = sglang.call("shutdown", id=made["id"])
    assert [b.events for b in got] == expected
    assert {b.data_parallel_rank for b in got} == {0}
    assert stats["skipped"] == 1 and stats["published"] >= len(batches)


def _drain(
    sglang: SGLang, pid: int, subscriber: Subscriber, batches: list[list[Any]]
) -> list[KVEventBatch]:
    """Publish ``batches``, then empty ones until the subscriber has them all: it joined late,
    so a later batch reveals the gap and our replay ring fills it."""
    sglang.call("publish", id=pid, batches=batches, ts=TS)
    got: dict[int, KVEventBatch] = {}
    deadline = Deadline(20.0)
    while any(s not in got for s in range(len(batches))) and not deadline.expired:
        sglang.call("publish", id=pid, batches=[[]], ts=TS)
        while (item := subscriber.get(timeout=0.05)) is not None:
            if isinstance(item, Delivery):
                got[item.seq] = item.batch
    return [got[s] for s in range(len(batches)) if s in got]


@pytest.fixture(scope="module")
def dynamo() -> Iterator[DynamoIndexer]:
    """NVIDIA Dynamo's indexer (``.venv-dynamo``), skipped or failed like tests/interop/test_dynamo.py."""
    reason = dynamo_unavailable_reason()
    if reason is not None and os.environ.get("KVEVENTS_REQUIRE_DYNAMO"):
        pytest.fail(f"KVEVENTS_REQUIRE_DYNAMO is set but {reason}")
    if reason is not None:
        pytest.skip(reason)
    with DynamoIndexer(model_name="kvevents-sglang", threads=1) as running:
        yield running


def test_sglang_events_through_ours_reach_dynamo(sglang: SGLang, dynamo: DynamoIndexer) -> None:
    """Dynamo's indexer, subscribed to ours, indexes SGLang's stores and drops its removals."""
    made = sglang.call("create", config=config(), rank=0)
    source = made["source"]
    dynamo.register(
        7, source["endpoint"], block_size=BLOCK, replay_endpoint=source["replay_endpoint"]
    )
    try:
        sglang.call(
            "publish", id=made["id"], ts=TS, batches=[[stored(0, 2)], [stored(2, 1, parent=1)]]
        )
        tokens = list(range(3 * BLOCK))
        assert _dynamo_sees(sglang, made["id"], dynamo, tokens, 3)
        removal = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
        sglang.call("publish", id=made["id"], ts=TS, batches=[[removal]])
        assert _dynamo_sees(sglang, made["id"], dynamo, tokens, 2)
    finally:
        dynamo.unregister(7)
        sglang.call("shutdown", id=made["id"])


def _dynamo_sees(
    sglang: SGLang, pid: int, dynamo: DynamoIndexer, tokens: list[int], blocks: int
) -> bool:
    """True once Dynamo matches ``blocks`` blocks of ``tokens``; empty batches meanwhile let it
    notice what it missed while joining (it replays from our ring)."""
    deadline = Deadline(20.0)
    while not deadline.expired:
        if dynamo.matched_blocks(tokens, BLOCK).get((7, 0), 0) == blocks:
            return True
        sglang.call("publish", id=pid, batches=[[]], ts=TS)
        time.sleep(0.05)
    return False


# Batches whose bytes are the same from both publishers, then those whose bytes differ while
# their content is the same: SGLang omits a nil lora_name, ours writes it (vLLM-typed decoders
# need the key), and ours writes session_id and cache_salt after lora_name.
SAME_BYTES = [
    [],
    [{"type": "AllBlocksCleared"}],
    [{"type": "BlockRemoved", "block_hashes": [5, -6], "medium": "GPU"}],
    [stored(0, 2, lora_name="adapter-a")],
]
SAME_CONTENT = [
    [stored(4, 1)],
    [stored(2, 1, parent=1, lora_name="adapter-a", session_id="s1")],
    [stored(5, 1, cache_salt="salt", namespace={"extra_key": None, "cache_salt": "salt"})],
]


def test_our_frames_equal_sglangs_own(sglang: SGLang) -> None:
    """SGLang's own ZeroMQ publisher and ours, fed the same SGLang batches, replay the same
    frames (topic, seq, payload, end marker); where the payload bytes differ, the content
    does not."""
    theirs = sglang.call("create", config=config("zmq"), rank=0)
    mine = sglang.call("create", config=config(), rank=0)
    assert theirs["class"] == SGLANG_OWN and mine["class"] == PLUGIN
    batches = SAME_BYTES + SAME_CONTENT
    replies = {}
    for made in (theirs, mine):
        sglang.call("publish", id=made["id"], batches=batches, ts=TS)
        replies[made["class"]] = _replay_all(made["source"]["replay_endpoint"], len(batches))
        sglang.call("shutdown", id=made["id"])
    sg, kv = replies[SGLANG_OWN], replies[PLUGIN]
    assert len(sg) == len(kv) == len(batches) + 1
    assert sg[-1] == kv[-1] == replay_end_frames()
    assert [f[:3] for f in sg] == [f[:3] for f in kv]  # delimiter, topic, seq
    assert [f[2] for f in kv[:-1]] == [pack_seq(s) for s in range(len(batches))]
    same = len(SAME_BYTES)
    assert [f[3] for f in sg[:same]] == [f[3] for f in kv[:same]]
    for theirs_frames, our_frames in zip(sg[same:-1], kv[same:-1], strict=True):
        assert theirs_frames[3] != our_frames[3]
        assert decode_batch(theirs_frames[3]) == decode_batch(our_frames[3])
    stored_event = msgspec.msgpack.decode(kv[3][3])[1][0]
    assert stored_event["lora_name"] == "adapter-a" and stored_event["medium"] == "GPU"


def _replay_all(endpoint: str, count: int) -> list[list[bytes]]:
    """Every buffered batch from seq 0 and the end marker, as a DEALER receives them; asked
    again until the publisher has buffered all ``count`` (its thread may still be sending)."""
    context = zmq.Context.instance()
    deadline = Deadline(20.0)
    while not deadline.expired:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart(replay_request_frames(0))
            frames = _until_end(dealer, deadline)
        finally:
            dealer.close(linger=0)
        if len(frames) == count + 1:
            return frames
        time.sleep(0.05)
    raise AssertionError(f"no full replay of {count} batches from {endpoint}")


def _until_end(dealer: zmq.Socket[Any], deadline: Deadline) -> list[list[bytes]]:
    frames: list[list[bytes]] = []
    while dealer.poll(max(1, int(deadline.remaining() * 1000))):
        frames.append(dealer.recv_multipart())
        if frames[-1] == replay_end_frames():
            break
    return frames


def test_our_live_frames_equal_sglangs_own(sglang: SGLang) -> None:
    """Live, as on replay: the same topic and payload frames from both, sequence numbers
    counting up from the same place."""
    live = {}
    for name in ("zmq", "kvevents"):
        made = sglang.call("create", config=config(name), rank=0)
        try:
            live[name] = _live_frames(sglang, made, SAME_BYTES)
        finally:
            sglang.call("shutdown", id=made["id"])
    assert live["zmq"] == live["kvevents"]
    assert [f[:2] for f in live["zmq"]] == [(b"kv", s) for s in range(len(SAME_BYTES))]


def _live_frames(
    sglang: SGLang, made: dict[str, Any], batches: list[list[Any]]
) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq after the handshake, payload) of ``batches`` as a SUB receives them.

    Empty batches are published until one arrives (a SUB misses what precedes its
    subscription); the batches then come after the probes still on their way, numbered from
    the number of probes published."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    real: list[tuple[bytes, int, bytes]] = []
    try:
        sub.connect(made["source"]["endpoint"])
        probes, deadline = 0, Deadline(20.0)
        while not sub.poll(50):
            assert not deadline.expired, "no probe arrived"
            sglang.call("publish", id=made["id"], batches=[[]], ts=TS)
            probes += 1
        sglang.call("publish", id=made["id"], batches=batches, ts=TS)
        while len(real) < len(batches):
            assert sub.poll(max(1, int(deadline.remaining() * 1000))), "a batch did not arrive"
            topic, seq, payload = sub.recv_multipart()
            if int.from_bytes(seq, "big") >= probes:
                real.append((topic, int.from_bytes(seq, "big") - probes, payload))
    finally:
        sub.close(linger=0)
    return real
