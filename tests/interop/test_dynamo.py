"""NVIDIA Dynamo's standalone KV indexer reads what kvevents publishes (issue 3, interop).

The indexer runs as a subprocess from the ``ai-dynamo-runtime`` wheel (see
``kvevents.testing.dynamo``); these tests are skipped, with the reason, only where it cannot be
imported (and fail instead when ``KVEVENTS_REQUIRE_DYNAMO`` is set, as CI should). Each scenario runs against two sources: ``raw``, a minimal pyzmq PUB + ROUTER that
speaks ``kvevents.wire`` frames exactly, and ``kvevents``, our publisher (skipped until
``kvevents.publish._publisher`` exists). Dynamo subscribes through a forwarder that can drop chosen live
sequence numbers, so a gap is real on the live path while our replay socket still holds it.

Each test owns its instance ids and token ranges, so one indexer serves the whole module.
Waits are handshakes (poll the indexer until a state appears) bounded by deadlines.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import msgspec
import pytest
import zmq

from kvevents.config import KVEventsConfig
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
from kvevents.testing.dynamo import DynamoIndexer, dynamo_block_hashes, dynamo_unavailable_reason
from kvevents.testing.sockets import wait_for
from kvevents.wire import (
    encode_batch,
    live_frames,
    parse_live,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)

pytestmark = pytest.mark.interop

BLOCK = 4
WAIT = 15.0
_ids = itertools.count(100)
_tokens = itertools.count(10_000, 1_000)


# --------------------------------------------------------------------------- sources


class Source(Protocol):
    endpoint: str
    replay_endpoint: str

    def publish(self, batch: KVEventBatch) -> int: ...

    def replayed(self) -> int:
        """Batches served in replay replies so far."""
        ...

    def close(self) -> None: ...


class RawSource:
    """PUB + ROUTER replay in plain pyzmq, frames from kvevents.wire; the stand-in publisher.

    ``reply_frames=3`` answers replays in the legacy ``[b"", seq, payload]`` shape.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        reply_frames: int = 4,
        bind: str = "tcp://127.0.0.1:0",
        replay_bind: str = "tcp://127.0.0.1:0",
    ) -> None:
        self.reply_frames = reply_frames
        self.requests: list[int] = []
        self.served = 0
        self._ring: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind(self._pub, bind)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = ""
        self._thread = threading.Thread(target=self._serve, args=(ctx, replay_bind), daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT), "replay thread did not bind"

    def publish(self, batch: KVEventBatch) -> int:
        return self.publish_payload(encode_batch(batch))

    def publish_payload(self, payload: bytes) -> int:
        seq, self._seq = self._seq, self._seq + 1
        with self._lock:
            self._ring[seq] = payload
        self._pub.send_multipart(live_frames(b"", seq, payload))
        return seq

    def _serve(self, ctx: zmq.Context[Any], bind: str) -> None:
        router = ctx.socket(zmq.ROUTER)  # owned by this thread only
        router.setsockopt(zmq.LINGER, 0)
        _bind(router, bind)
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if router.poll(20):
                    identity, *request = router.recv_multipart()
                    for frames in self._reply(request):
                        router.send_multipart([identity, *frames])
        finally:
            router.close()

    def _reply(self, request: list[bytes]) -> Iterator[list[bytes]]:
        start = parse_replay_request(request)
        self.requests.append(start)
        with self._lock:
            tail = sorted((seq, p) for seq, p in self._ring.items() if seq >= start)
        for seq, payload in tail:
            self.served += 1
            frames = replay_reply_frames(b"", seq, payload)
            yield frames if self.reply_frames == 4 else [frames[0], *frames[2:]]
        yield replay_end_frames()

    def replayed(self) -> int:
        return self.served

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        self._pub.close()


class KVEventsSource:
    """Our publisher (kvevents.publish._publisher, API.md) on ephemeral ports."""

    def __init__(self) -> None:
        publisher = pytest.importorskip("kvevents.publish._publisher")
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
        )
        self._publisher = publisher.create_publisher(config)
        self._publisher.start()
        self.endpoint: str = self._publisher.endpoint
        self.replay_endpoint: str = self._publisher.replay_endpoint

    def publish(self, batch: KVEventBatch) -> int:
        seq = self._publisher.publish(batch)
        assert seq is not None
        return int(seq)

    def replayed(self) -> int:
        return int(self._publisher.stats().replay_batches_served)

    def close(self) -> None:
        self._publisher.shutdown()


def _bind(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Bind, retrying while a just-closed socket still holds the port (zmq closes async)."""

    def attempt() -> bool:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            return False
        return True

    wait_for(attempt, timeout=WAIT, interval=0.01, what=f"{endpoint} to be free again")


class LossyForwarder:
    """SUB from a source, PUB to the indexer, dropping the live messages whose seq is listed."""

    def __init__(self, ctx: zmq.Context[Any], upstream: str) -> None:
        self._drop: set[int] = set()
        self.dropped: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, args=(ctx, upstream), daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT), "forwarder did not bind"

    def drop(self, seq: int) -> None:
        with self._lock:
            self._drop.add(seq)

    def _run(self, ctx: zmq.Context[Any], upstream: str) -> None:
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        for sock in (sub, pub):
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(upstream)
        pub.bind("tcp://127.0.0.1:0")
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(20):
                    self._forward(sub.recv_multipart(), pub)
        finally:
            sub.close()
            pub.close()

    def _forward(self, frames: list[bytes], pub: zmq.Socket[Any]) -> None:
        seq = parse_live(frames).seq
        with self._lock:
            if seq in self._drop:
                self._drop.discard(seq)
                self.dropped.append(seq)
                return
        pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def indexer() -> Iterator[DynamoIndexer]:
    reason = dynamo_unavailable_reason()
    if reason is not None and os.environ.get("KVEVENTS_REQUIRE_DYNAMO"):
        pytest.fail(f"KVEVENTS_REQUIRE_DYNAMO is set but {reason}")
    if reason is not None:
        pytest.skip(reason)
    with DynamoIndexer(model_name="kvevents-interop", threads=1) as running:
        yield running


class Net:
    """The sockets of one test: sources and forwarders, all closed at teardown."""

    def __init__(self, ctx: zmq.Context[Any], stack: contextlib.ExitStack) -> None:
        self.ctx = ctx
        self._stack = stack

    def raw(self, **options: Any) -> RawSource:
        return self.closing(RawSource(self.ctx, **options))

    def forwarder(self, upstream: str) -> LossyForwarder:
        return self.closing(LossyForwarder(self.ctx, upstream))

    def closing(self, thing: Closable) -> Any:
        self._stack.callback(thing.close)
        return thing


class Closable(Protocol):
    def close(self) -> None: ...


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)  # each test's Net has closed its sockets by now


@pytest.fixture
def net(ctx: zmq.Context[Any]) -> Iterator[Net]:
    with contextlib.ExitStack() as stack:
        yield Net(ctx, stack)


@pytest.fixture(params=["raw", "kvevents"])
def source(request: pytest.FixtureRequest, net: Net) -> Source:
    if request.param == "raw":
        return net.raw()
    made: Source = net.closing(KVEventsSource())
    return made


# --------------------------------------------------------------------------- helpers


def batch(*events: Event) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)


class Chain:
    """Token ids and engine hashes of one prefix, cut into blocks."""

    def __init__(self, blocks: int, tokens: Sequence[int] | None = None) -> None:
        first = next(_tokens)
        self.tokens = list(tokens or range(first, first + blocks * BLOCK))
        self.hashes = [first * 7 + i for i in range(blocks)]  # opaque, distinct per chain

    def store(self, start: int, stop: int) -> BlockStored:
        """The stored event of blocks [start, stop) of this chain."""
        return BlockStored(
            block_hashes=self.hashes[start:stop],
            parent_block_hash=self.hashes[start - 1] if start else None,
            token_ids=self.tokens[start * BLOCK : stop * BLOCK],
            block_size=BLOCK,
        )


def attach(
    indexer: DynamoIndexer, net: Net, src: Source, root: Chain
) -> tuple[int, LossyForwarder]:
    """Register ``src`` through a forwarder; publish ``root``'s block 0 until it is indexed.

    Repeating the probe covers both slow-joiner hops; whatever the indexer missed meanwhile
    it fetches from our replay socket.
    """
    worker = next(_ids)
    forwarder = net.forwarder(src.endpoint)
    indexer.register(
        worker, forwarder.endpoint, block_size=BLOCK, replay_endpoint=src.replay_endpoint
    )

    def probe() -> bool:
        src.publish(batch(root.store(0, 1)))
        return matched(indexer, worker, root.tokens) == 1

    wait_for(probe, timeout=WAIT, interval=0.05, what=f"worker {worker} probe indexed")
    return worker, forwarder


def matched(indexer: DynamoIndexer, worker: int, tokens: Sequence[int]) -> int:
    return indexer.matched_blocks(tokens, BLOCK).get((worker, 0), 0)


def held(indexer: DynamoIndexer, worker: int) -> set[int]:
    return indexer.held_blocks().get((worker, 0), set())


def settle(indexer: DynamoIndexer, worker: int, tokens: Sequence[int], blocks: int) -> None:
    """Wait until the indexer matches exactly ``blocks`` of ``tokens`` for ``worker``."""
    wait_for(
        lambda: matched(indexer, worker, tokens) == blocks,
        timeout=WAIT,
        what=f"worker {worker} to match {blocks} blocks (now {matched(indexer, worker, tokens)})",
    )


def marker(indexer: DynamoIndexer, src: Source, worker: int) -> None:
    """Publish a fresh root block until it is indexed: what was published before is settled.

    Dynamo applies a stream in sequence order, so by then each earlier batch was applied or
    rejected. Repeats cover a subscriber that is still (re)connecting.
    """
    probe = Chain(1)

    def seen() -> bool:
        src.publish(batch(probe.store(0, 1)))
        return matched(indexer, worker, probe.tokens) == 1

    wait_for(seen, timeout=WAIT, interval=0.05, what=f"worker {worker} marker indexed")


# --------------------------------------------------------------------------- behaviour


def test_indexes_what_we_publish(indexer: DynamoIndexer, net: Net, source: Source) -> None:
    """Dynamo finds our worker with every block we stored, and only a prefix for a prefix."""
    chain = Chain(6)
    worker, _ = attach(indexer, net, source, chain)
    source.publish(batch(chain.store(1, 4)))
    source.publish(batch(chain.store(4, 6)))
    settle(indexer, worker, chain.tokens, 6)
    assert matched(indexer, worker, chain.tokens[: 3 * BLOCK + 1]) == 3
    assert held(indexer, worker) == set(chain.hashes)
    assert indexer.query(chain.tokens)["scores"][str(worker)] == {"0": 6 * BLOCK}


def test_removes_what_we_remove(indexer: DynamoIndexer, net: Net, source: Source) -> None:
    """A BlockRemoved of the tail shortens Dynamo's match; AllBlocksCleared empties it."""
    chain = Chain(5)
    worker, _ = attach(indexer, net, source, chain)
    source.publish(batch(chain.store(1, 5)))
    settle(indexer, worker, chain.tokens, 5)
    source.publish(batch(BlockRemoved(block_hashes=chain.hashes[3:])))
    settle(indexer, worker, chain.tokens, 3)
    assert held(indexer, worker) == set(chain.hashes[:3])
    source.publish(batch(AllBlocksCleared()))
    settle(indexer, worker, chain.tokens, 0)
    assert held(indexer, worker) == set()


def test_recovers_a_gap_through_our_replay(
    indexer: DynamoIndexer, net: Net, source: Source
) -> None:
    """A live batch lost on the way is replayed from our ROUTER and the final state is exact.

    Without the replay the next store's parent is unknown and Dynamo drops it too, so the
    match would stop at 2 blocks.
    """
    chain = Chain(6)
    worker, forwarder = attach(indexer, net, source, chain)
    last = source.publish(batch(chain.store(1, 2)))
    settle(indexer, worker, chain.tokens, 2)
    forwarder.drop(last + 1)  # sequence numbers are dense: this is the next batch's
    lost = source.publish(batch(chain.store(2, 4)))
    source.publish(batch(chain.store(4, 6)))  # its parent is in the lost batch
    settle(indexer, worker, chain.tokens, 6)
    source.publish(batch(BlockRemoved(block_hashes=[chain.hashes[5]])))
    settle(indexer, worker, chain.tokens, 5)
    assert held(indexer, worker) == set(chain.hashes[:5])
    assert forwarder.dropped == [lost]
    wait_for(source.replayed, timeout=WAIT, what="the replay to be counted")


# --------------------------------------------------------------------------- peer facts
# What Dynamo (ai-dynamo-runtime 1.6.1) does with inputs we never emit, pinned because
# WIRE.md and LANDSCAPE.md rely on them. If one fails after a Dynamo upgrade, update the docs.


def test_dynamo_keys_blocks_by_unchained_xxh3_of_their_tokens(
    indexer: DynamoIndexer, net: Net
) -> None:
    """Dynamo's block key is XXH3-64 (seed 1337) of each block's u32 tokens, not chained."""
    chain = Chain(3)
    src = net.raw()
    worker, _ = attach(indexer, net, src, chain)
    src.publish(batch(chain.store(1, 3)))
    settle(indexer, worker, chain.tokens, 3)
    keys = dynamo_block_hashes(chain.tokens, BLOCK)
    assert indexer.query_by_hash(keys)["scores"][str(worker)] == {"0": 3 * BLOCK}
    tree = indexer.dump()[f"{indexer.model_name}:default"]["events"]
    stored = {
        b["block_hash"]: b["tokens_hash"]
        for item in tree
        if item["worker_id"] == worker
        for b in item["event"]["data"]["stored"]["blocks"]
    }
    assert stored == dict(zip(chain.hashes, keys, strict=True))


def test_dynamo_rejects_a_whole_batch_with_a_bytes_hash(indexer: DynamoIndexer, net: Net) -> None:
    """One bytes hash costs Dynamo every event of its batch: why we only emit int hashes."""
    chain = Chain(3)
    src = net.raw()
    worker, _ = attach(indexer, net, src, chain)
    good = msgspec.to_builtins(chain.store(1, 2))
    bad = {**msgspec.to_builtins(Chain(1).store(0, 1)), "block_hashes": [b"\x01" * 32]}
    src.publish_payload(msgspec.msgpack.encode([time.time(), [good, bad], 0]))
    marker(indexer, src, worker)
    assert matched(indexer, worker, chain.tokens) == 1
    src.publish(batch(chain.store(1, 3)))
    settle(indexer, worker, chain.tokens, 3)


def _payload(ts: float, events: list[Any], *rest: Any) -> bytes:
    return msgspec.msgpack.encode([ts, events, *rest])


@pytest.mark.parametrize(
    "shape",
    ["2-element batch", "4-element batch", "unknown tag"],
)
def test_dynamo_rejects_whole_batches_of_other_shapes(
    indexer: DynamoIndexer, net: Net, shape: str
) -> None:
    """Dynamo drops the whole batch for these shapes: why we emit exactly [ts, events, rank]."""
    chain = Chain(2)
    src = net.raw()
    worker, _ = attach(indexer, net, src, chain)
    good = msgspec.to_builtins(chain.store(1, 2))
    payload = {
        "2-element batch": _payload(time.time(), [good]),
        "4-element batch": _payload(time.time(), [good], 0, "extra"),
        "unknown tag": _payload(time.time(), [{"type": "BlockMoved"}, good], 0),
    }[shape]
    src.publish_payload(payload)
    marker(indexer, src, worker)
    assert matched(indexer, worker, chain.tokens) == 1


@pytest.mark.parametrize("engine_hash", [2**64 - 1, 2**63, -(2**63), -1])
def test_dynamo_takes_signed_and_unsigned_64_bit_hashes(
    indexer: DynamoIndexer, net: Net, engine_hash: int
) -> None:
    """vLLM's uint64 and SGLang's int64 hashes both work as parents and removal keys."""
    chain = Chain(3)
    chain.hashes[1] = engine_hash
    src = net.raw()
    worker, _ = attach(indexer, net, src, chain)
    src.publish(batch(chain.store(1, 3)))
    settle(indexer, worker, chain.tokens, 3)
    src.publish(batch(BlockRemoved(block_hashes=[chain.hashes[2], engine_hash])))
    settle(indexer, worker, chain.tokens, 1)


def test_dynamo_drops_other_block_sizes_silently(indexer: DynamoIndexer, net: Net) -> None:
    """Stores whose block_size differs from the registered one vanish with only a log line."""
    chain = Chain(5)
    src = net.raw()
    worker, _ = attach(indexer, net, src, chain)
    wide = BlockStored(
        block_hashes=chain.hashes[1:3],
        parent_block_hash=chain.hashes[0],
        token_ids=chain.tokens[BLOCK:],
        block_size=2 * BLOCK,
    )
    src.publish(batch(wide))
    marker(indexer, src, worker)
    assert matched(indexer, worker, chain.tokens) == 1
    assert indexer.matched_blocks(chain.tokens, 2 * BLOCK).get((worker, 0), 0) == 0


def test_dynamo_accepts_legacy_three_frame_replay_replies(indexer: DynamoIndexer, net: Net) -> None:
    """Dynamo recovers a gap from a replay server answering [b"", seq, payload]."""
    chain = Chain(4)
    src = net.raw(reply_frames=3)
    worker, forwarder = attach(indexer, net, src, chain)
    last = src.publish(batch(chain.store(1, 2)))
    settle(indexer, worker, chain.tokens, 2)
    forwarder.drop(last + 1)
    src.publish(batch(chain.store(2, 3)))
    src.publish(batch(chain.store(3, 4)))
    settle(indexer, worker, chain.tokens, 4)
    assert forwarder.dropped == [last + 1]


def test_dynamo_cannot_extend_equal_tokens_under_other_engine_hashes(
    indexer: DynamoIndexer, net: Net
) -> None:
    """A second worker storing the same tokens under its own engine hashes cannot extend them.

    Dynamo keeps one engine hash per token block, the first writer's, so the second worker's
    parent lookup fails and its child store is dropped (and /dump shows it the first's hashes).
    """
    first = Chain(3)
    second = Chain(3, tokens=first.tokens)  # same tokens, other engine hashes
    a, b = net.raw(), net.raw()
    worker_a, _ = attach(indexer, net, a, first)
    worker_b, _ = attach(indexer, net, b, second)
    a.publish(batch(first.store(1, 3)))
    b.publish(batch(second.store(1, 3)))
    settle(indexer, worker_a, first.tokens, 3)
    marker(indexer, b, worker_b)
    assert matched(indexer, worker_b, first.tokens) == 1
    assert held(indexer, worker_b) & {*first.hashes, *second.hashes} == {first.hashes[0]}


def test_dynamo_ignores_a_restarted_publisher_until_reregistered(
    indexer: DynamoIndexer, net: Net
) -> None:
    """After a publisher restart Dynamo keeps stale blocks and drops seqs up to its watermark.

    Only /unregister + /register (which replays from 0) rebuilds the worker correctly.
    """
    old, new = Chain(3), Chain(2)
    src = net.raw()
    worker = next(_ids)
    indexer.register(worker, src.endpoint, block_size=BLOCK, replay_endpoint=src.replay_endpoint)
    wait_for(
        lambda: src.publish(batch(old.store(0, 1))) >= 0 and matched(indexer, worker, old.tokens),
        timeout=WAIT,
        interval=0.05,
        what="first probe",
    )
    src.publish(batch(old.store(1, 3)))
    settle(indexer, worker, old.tokens, 3)
    watermark = src.publish(batch())
    src.close()
    src = net.raw(bind=src.endpoint, replay_bind=src.replay_endpoint)
    src.publish(batch(AllBlocksCleared()))
    src.publish(batch(new.store(0, 2)))
    while src.publish(batch()) < watermark:
        pass
    marker(indexer, src, worker)  # a seq past the watermark, so Dynamo applies it
    assert matched(indexer, worker, old.tokens) == 3
    assert matched(indexer, worker, new.tokens) == 0
    indexer.unregister(worker)
    indexer.register(worker, src.endpoint, block_size=BLOCK, replay_endpoint=src.replay_endpoint)
    wait_for(
        lambda: src.publish(batch()) >= 0 and matched(indexer, worker, new.tokens) == 2,
        timeout=WAIT,
        interval=0.05,
        what="rebuild from replay after re-registration",
    )
    assert matched(indexer, worker, old.tokens) == 0
