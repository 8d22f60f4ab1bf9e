"""Fault injection for subscribers: a scriptable raw publisher and engine-shaped wire fixtures.

:class:`RawPublisher` speaks the exact wire contract (WIRE.md sections 2 and 3) with plain
pyzmq: a PUB socket, plus an optional ROUTER replay server on its own thread. The test decides
every sequence number and every fault: drop chosen live messages (they stay in the replay
ring, like a batch lost on the network), send duplicates, restart the counter at 0, answer
replays in 3 frames, forget the oldest batches (a trimmed ring), never answer, or answer
slowly. The PUB socket belongs to the thread that created the publisher.

The ``*_fixture`` functions return payloads shaped like each engine's real output, with the
batch a tolerant decoder must read from them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.subscribe.streams import Delivery, StreamReset, StreamStatus
from kvevents.testing.sockets import unique_inproc
from kvevents.wire import (
    decode_batch,
    encode_batch,
    live_frames,
    pack_seq,
    parse_replay_request,
    replay_end_frames,
)

if TYPE_CHECKING:
    from kvevents.subscribe.subscriber import Subscriber

__all__ = [
    "Collector",
    "RawPublisher",
    "ReplayBehaviour",
    "WireFixture",
    "heartbeat",
    "sglang_array_fixture",
    "sglang_map_fixture",
    "tensorrt_llm_fixture",
    "typical_batch",
    "vllm_array_fixture",
    "vllm_bytes_hash_fixture",
    "vllm_map_fixture",
    "vllm_v09_fixture",
    "wire_fixtures",
]


@dataclass
class ReplayBehaviour:
    """How the replay server answers; change the fields at any time.

    ``answer``: False never answers (requests are still recorded). ``reply_frames``: 4, or 3
    like vLLM up to 0.25. ``delay``: seconds slept before each replayed message. ``end``:
    False omits the end marker.
    """

    answer: bool = True
    reply_frames: int = 4
    delay: float = 0.0
    end: bool = True


@dataclass
class _Ring:
    capacity: int
    items: OrderedDict[int, bytes] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seq: int, payload: bytes) -> None:
        with self.lock:
            self.items[seq] = payload
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)

    def since(self, start: int) -> list[tuple[int, bytes]]:
        with self.lock:
            return [(s, p) for s, p in self.items.items() if s >= start]

    def forget_before(self, seq: int) -> None:
        with self.lock:
            for old in [s for s in self.items if s < seq]:
                del self.items[old]

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


class RawPublisher:
    """A publisher the test scripts message by message; see the module docstring.

    ``published`` records ``(seq, payload)`` of every batch of the current incarnation in
    order (dropped ones included), which is what a subscriber should end up delivering.
    """

    def __init__(
        self,
        *,
        topic: str = "",
        replay: bool = True,
        ring_size: int = 10_000,
        host: str = "127.0.0.1",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.topic = topic.encode()
        self.behaviour = ReplayBehaviour()
        self.requests: list[int] = []
        self.published: list[tuple[int, bytes]] = []
        self._ctx = context or zmq.Context.instance()
        self._ring = _Ring(ring_size)
        self._next = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(f"tcp://{host}:0")
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopper: zmq.Socket[bytes] | None = None
        if replay:
            self._start_replay(host)

    # ------------------------------------------------------------------ live side

    @property
    def next_seq(self) -> int:
        """The sequence the next :meth:`publish` uses."""
        return self._next

    def publish(self, batch: KVEventBatch | bytes, *, drop: bool = False) -> int:
        """Publish the next batch (``drop``: keep it for replay but never send it live)."""
        payload = batch if isinstance(batch, bytes) else encode_batch(batch)
        seq = self._next
        self._next += 1
        self._ring.add(seq, payload)
        self.published.append((seq, payload))
        if not drop:
            self._pub.send_multipart(live_frames(self.topic, seq, payload))
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed messages, end markers...)."""
        self._pub.send_multipart(frames)

    def duplicate(self, seq: int) -> None:
        """Send an already published batch live again."""
        payload = dict(self.published)[seq]
        self._pub.send_multipart(live_frames(self.topic, seq, payload))

    def restart(self) -> None:
        """Behave like a fresh process on the same endpoints: seq back to 0, ring empty."""
        self._next = 0
        self._ring.clear()
        self.published = []

    def forget_before(self, seq: int) -> None:
        """Trim the replay ring: batches below ``seq`` can no longer be replayed."""
        self._ring.forget_before(seq)

    def close(self) -> None:
        """Stop the replay thread and close both sockets."""
        self._stop.set()
        if self._thread is not None and self._stopper is not None:
            self._stopper.send(b"")
            self._thread.join(timeout=5)
            self._stopper.close(linger=0)
        self._pub.close(linger=0)

    def __enter__(self) -> RawPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ replay side

    def _start_replay(self, host: str) -> None:
        ready: list[str] = []
        started = threading.Event()
        control = unique_inproc("raw-replay-stop")
        self._stopper = self._ctx.socket(zmq.PAIR)
        self._stopper.setsockopt(zmq.LINGER, 0)
        self._stopper.bind(control)
        self._thread = threading.Thread(
            target=self._serve, args=(host, control, ready, started), name="raw-replay", daemon=True
        )
        self._thread.start()
        if not started.wait(10) or not ready:
            raise RuntimeError("raw replay server did not start")
        self.replay_endpoint = ready[0]

    def _serve(self, host: str, control: str, ready: list[str], started: threading.Event) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 0)  # a whole reply must fit (WIRE.md section 3)
        router.bind(f"tcp://{host}:0")
        stop = self._ctx.socket(zmq.PAIR)
        stop.setsockopt(zmq.LINGER, 0)
        stop.connect(control)
        ready.append(router.getsockopt_string(zmq.LAST_ENDPOINT))
        started.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if router in dict(poller.poll()):
                    identity, *rest = router.recv_multipart()
                    self._answer(router, identity, rest)
        finally:
            router.close(linger=0)
            stop.close(linger=0)

    def _answer(self, router: zmq.Socket[bytes], identity: bytes, rest: list[bytes]) -> None:
        start = parse_replay_request(rest)
        self.requests.append(start)
        how = self.behaviour
        if not how.answer:
            return
        for seq, payload in self._ring.since(start):
            if how.delay:
                time.sleep(how.delay)
            if self._stop.is_set():
                return
            head = [identity, b""] if how.reply_frames == 3 else [identity, b"", self.topic]
            router.send_multipart([*head, pack_seq(seq), payload])
        if how.end:
            router.send_multipart([identity, *replay_end_frames()])


# ---------------------------------------------------------------------- batches and fixtures


def typical_batch(step: int, *, blocks: int = 16, block_size: int = 16) -> KVEventBatch:
    """One prefill step: ``blocks`` stored blocks of ``block_size`` tokens, and a removal."""
    base = step * 1000
    hashes = [base + i + 1 for i in range(blocks)]
    tokens = list(range(base, base + blocks * block_size))
    stored = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=block_size,
        medium="GPU",
    )
    removed = BlockRemoved(block_hashes=[base - 1000 + 1], medium="GPU")
    return KVEventBatch(ts=time.time(), events=[stored, removed], data_parallel_rank=0)


def heartbeat() -> KVEventBatch:
    """An empty batch (used as a probe: it changes no state)."""
    return KVEventBatch(ts=time.time(), events=[], data_parallel_rank=None)


@dataclass(frozen=True)
class WireFixture:
    """A payload shaped like ``engine`` emits it, and the batch it must decode to."""

    engine: str
    payload: bytes
    expected: KVEventBatch


_U64 = 2**64 - 1
_TS = 1_750_000_000.25


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def vllm_v09_fixture() -> WireFixture:
    """vLLM 0.9: 2-element batch, array events, 5 stored fields, removal without medium."""
    payload = _enc([_TS, [["BlockStored", [_U64, 7], None, list(range(8)), 4, None]]])
    stored = BlockStored(
        block_hashes=[_U64, 7], parent_block_hash=None, token_ids=list(range(8)), block_size=4
    )
    return WireFixture("vllm-0.9", payload, KVEventBatch(_TS, [stored], None))


def vllm_array_fixture() -> WireFixture:
    """vLLM 0.16 array era: tagged arrays with medium and lora_name, unsigned hashes."""
    events = [
        ["BlockStored", [_U64 - 1, _U64], 12, list(range(32)), 16, None, "GPU", None],
        ["BlockRemoved", [12], "GPU"],
        ["AllBlocksCleared"],
    ]
    payload = _enc([_TS, events, 1])
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[_U64 - 1, _U64],
                parent_block_hash=12,
                token_ids=list(range(32)),
                block_size=16,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=[12], medium="GPU"),
            AllBlocksCleared(),
        ],
        1,
    )
    return WireFixture("vllm-array", payload, expected)


def vllm_map_fixture() -> WireFixture:
    """vLLM map era: map events with every always-present key, optional keys set."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [2**63 + 5],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [2**63 + 5], "medium": "GPU"}
    payload = _enc([_TS, [stored, removed], 0])
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[2**63 + 5],
                token_ids=list(range(16)),
                block_size=16,
                medium="GPU",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[2**63 + 5], medium="GPU"),
        ],
        0,
    )
    return WireFixture("vllm-map", payload, expected)


def vllm_bytes_hash_fixture() -> WireFixture:
    """vLLM with integer hashes off: 32-byte digests, read as their last 8 bytes."""
    digest = bytes(range(32))
    as_int = int.from_bytes(digest[-8:], "big")
    events = [["BlockStored", [digest], None, list(range(4)), 4, None, "GPU", None]]
    expected = BlockStored(
        block_hashes=[as_int], token_ids=list(range(4)), block_size=4, medium="GPU"
    )
    return WireFixture("vllm-bytes", _enc([_TS, events, 0]), KVEventBatch(_TS, [expected], 0))


def sglang_map_fixture() -> WireFixture:
    """SGLang map events: signed hashes, no lora_name/medium when nil, salt and session."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [-(2**63), -5],
        "parent_block_hash": -9,
        "token_ids": list(range(2)),
        "block_size": 1,
        "lora_id": None,
        "cache_salt": "tenant-a",
        "session_id": "s1",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [-5]}
    payload = _enc([_TS, [stored, removed], 3])
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[-(2**63), -5], parent_block_hash=-9, token_ids=[0, 1], block_size=1
            ),
            BlockRemoved(block_hashes=[-5]),
        ],
        3,
    )
    return WireFixture("sglang-map", payload, expected)


def sglang_array_fixture() -> WireFixture:
    """SGLang array events: a salted store carries a metadata map where vLLM has lora_name."""
    events = [
        ["BlockStored", [-1, -2], None, list(range(4)), 2, None, "CPU_PINNED", {"salt": "x"}],
        ["BlockRemoved", [-1], "CPU_PINNED"],
        ["NewTagFromTheFuture", 1, 2],
    ]
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[-1, -2], token_ids=list(range(4)), block_size=2, medium="CPU_PINNED"
            ),
            BlockRemoved(block_hashes=[-1], medium="CPU_PINNED"),
        ],
        0,
    )
    return WireFixture("sglang-array", _enc([_TS, events, 0]), expected)


def tensorrt_llm_fixture() -> WireFixture:
    """TensorRT-LLM: map events, signed 64-bit hashes, a cache reset, DP rank set."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [-42, 2**63 - 1],
        "parent_block_hash": 17,
        "token_ids": list(range(64)),
        "block_size": 32,
        "lora_id": 3,
        "medium": "GPU",
        "lora_name": "adapter",
    }
    payload = _enc([_TS, [{"type": "AllBlocksCleared"}, stored], 2])
    expected = KVEventBatch(
        _TS,
        [
            AllBlocksCleared(),
            BlockStored(
                block_hashes=[-42, 2**63 - 1],
                parent_block_hash=17,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=3,
                medium="GPU",
                lora_name="adapter",
            ),
        ],
        2,
    )
    return WireFixture("tensorrt-llm", payload, expected)


def wire_fixtures() -> list[WireFixture]:
    """Every engine-shaped fixture."""
    return [
        vllm_v09_fixture(),
        vllm_array_fixture(),
        vllm_map_fixture(),
        vllm_bytes_hash_fixture(),
        sglang_map_fixture(),
        sglang_array_fixture(),
        tensorrt_llm_fixture(),
    ]


# ---------------------------------------------------------------------- consuming side


class Collector:
    """Drains a subscriber the way a consumer would, for assertions after quiescence.

    Per stream it keeps ``(seq, batch)`` in delivery order and drops them on a
    :class:`~kvevents.subscribe.subscriber.StreamReset`, exactly as an index must; ``resets`` and
    ``statuses`` keep what was reported.
    """

    def __init__(self, subscriber: Subscriber) -> None:
        self.subscriber = subscriber
        self.delivered: dict[tuple[str, int], list[tuple[int, KVEventBatch]]] = {}
        self.resets: list[StreamReset] = []
        self.statuses: list[StreamStatus] = []

    def pump(self, timeout: float = 0.01) -> int:
        """Take every waiting item (waiting up to ``timeout`` for the first); how many."""
        count = 0
        item = self.subscriber.get(timeout)
        while item is not None:
            count += 1
            self._take(item)
            item = self.subscriber.get_nowait()
        return count

    def _take(self, item: Delivery | StreamReset | StreamStatus) -> None:
        if isinstance(item, Delivery):
            self.delivered.setdefault(item.stream.key, []).append((item.seq, item.batch))
        elif isinstance(item, StreamReset):
            self.resets.append(item)
            self.delivered.pop(item.stream.key, None)
        else:
            self.statuses.append(item)

    def seqs(self, key: tuple[str, int]) -> list[int]:
        """Delivered sequence numbers of one stream since its last reset."""
        return [seq for seq, _ in self.delivered.get(key, [])]

    def wait(
        self, predicate: Callable[[Collector], object], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Pump until ``predicate(self)`` holds; TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
            self.pump()

    def handshake(
        self, publisher: RawPublisher, key: tuple[str, int], timeout: float = 10.0
    ) -> None:
        """Publish heartbeats until ``key`` delivered one: the SUB is connected (slow joiner)."""
        deadline = time.monotonic() + timeout
        while not self.delivered.get(key):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no delivery from {key} after {timeout}s of probes")
            publisher.publish(heartbeat())
            self.pump(0.02)

    def caught_up(self, publisher: RawPublisher, key: tuple[str, int]) -> bool:
        """True when ``key`` delivered up to the publisher's last sequence."""
        return self.seqs(key)[-1:] == [publisher.next_seq - 1]

    def matches(self, publisher: RawPublisher, key: tuple[str, int]) -> bool:
        """True when the stream delivered exactly what ``publisher`` published, in order."""
        got = self.delivered.get(key, [])
        want = [(seq, decode_batch(payload).batch) for seq, payload in publisher.published]
        return got == want
