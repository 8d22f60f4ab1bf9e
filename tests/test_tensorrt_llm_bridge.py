"""The TensorRT-LLM bridge (kvevents.integrations.tensorrt_llm): mapping, counters, streams.

The fixtures are built to the shapes TensorRT-LLM's ``KVCacheEventSerializer`` documents:
``{"event_id", "data": {"type": ...}, "window_size"[, "attention_dp_rank"]}``.
"""

from __future__ import annotations

import http.server
import json
import queue
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from kvevents.config import KVEventsConfig
from kvevents.errors import PublisherError
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.index.prefix import HolderKey, PrefixIndex
from kvevents.integrations.tensorrt_llm import (
    DEFAULT_MAX_POLL_BYTES,
    TensorRTLLMBridge,
    http_poll,
    map_event,
)
from kvevents.metrics import stats_samples
from kvevents.publish.records import PublisherOptions
from kvevents.subscribe import Delivery, StreamSpec, Subscriber
from kvevents.testing.hostile_http import dripping, flooding
from kvevents.testing.sockets import Deadline

BS = 4


# ---------------------------------------------------------------------- serializer shapes


def block(
    block_hash: int, tokens: list[int], *, level: int = 0, priority: int = 35, **extra: Any
) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": level,
        "priority": priority,
        **extra,
    }


def entry(event_id: int, data: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": 32}
    if rank is not None:
        out["attention_dp_rank"] = rank
    return out


def stored(
    event_id: int, blocks: list[dict[str, Any]], parent: int | None = None, rank: int | None = None
) -> dict[str, Any]:
    return entry(event_id, {"type": "stored", "parent_hash": parent, "blocks": blocks}, rank)


def removed(event_id: int, hashes: list[int], rank: int | None = None) -> dict[str, Any]:
    return entry(event_id, {"type": "removed", "block_hashes": hashes}, rank)


def created(event_id: int, rank: int | None = None) -> dict[str, Any]:
    data = {"type": "created", "num_blocks_per_cache_level": [128, 0]}
    return entry(event_id, data, rank)


def updated(event_id: int, block_hash: int, *, old: int = 35, new: int = 90) -> dict[str, Any]:
    diff = {"type": "event_diff", "new_value": new, "old_value": old}
    level = {"type": "event_diff", "new_value": 0, "old_value": 0}
    data = {"type": "updated", "block_hash": block_hash, "cache_level": level, "priority": diff}
    return entry(event_id, data)


def chain(first_hash: int, tokens: list[int], **kw: Any) -> list[dict[str, Any]]:
    """Blocks of BS tokens (the last may be partial), hashes first_hash, first_hash + 1, ..."""
    return [
        block(first_hash + i, tokens[start : start + BS], **kw)
        for i, start in enumerate(range(0, len(tokens), BS))
    ]


# ---------------------------------------------------------------------- the mapping


def test_stored_maps_to_block_stored_with_tokens_flattened() -> None:
    """A store: hashes in order, its parent, tokens flattened, medium GPU, size from the tokens."""
    (event,) = map_event(stored(7, chain(10, list(range(8))), parent=3)).events
    assert event == BlockStored(
        block_hashes=[10, 11],
        parent_block_hash=3,
        token_ids=list(range(8)),
        block_size=4,
        medium="GPU",
    )


def test_event_id_and_rank_are_read() -> None:
    """The entry's event_id and attention_dp_rank (absent: rank 0) are kept."""
    assert map_event(created(5, rank=1), world_size=2).rank == 1
    mapped = map_event(created(6))
    assert (mapped.rank, mapped.event_id, mapped.events) == (0, 6, (AllBlocksCleared(),))


def test_partial_last_block_is_not_announced() -> None:
    """A store's partial last block is left out (WIRE.md section 7) and counted."""
    mapped = map_event(stored(1, chain(10, list(range(10)))), block_size=BS)
    (event,) = mapped.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [10, 11] and event.token_ids == list(range(8))
    assert mapped.partial_blocks == 1


def test_a_store_of_one_partial_block_publishes_nothing() -> None:
    """With the engine's block size known, a lone partial block is not taken for a full one."""
    mapped = map_event(stored(1, chain(10, [1, 2])), block_size=BS)
    assert (mapped.events, mapped.partial_blocks) == ((), 1)


def test_a_short_block_before_the_last_is_malformed() -> None:
    """Only the last block may be partial: a short one in the middle names its index."""
    blocks = [block(1, [1, 2]), block(2, [3, 4, 5, 6])]
    with pytest.raises(ValueError, match=r"data\.blocks\[0\] has 2 tokens"):
        map_event(stored(1, blocks), block_size=BS)


def test_cache_level_is_the_medium_and_a_mixed_store_is_split_and_chained() -> None:
    """cache_level 0 is GPU, 1 is CPU; runs of one medium become events chained by parent."""
    blocks = [*chain(10, [1, 2, 3, 4]), *chain(11, [5, 6, 7, 8], level=1)]
    first, second = map_event(stored(1, blocks, parent=9)).events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.medium, first.parent_block_hash, first.block_hashes) == ("GPU", 9, [10])
    assert (second.medium, second.parent_block_hash, second.block_hashes) == ("CPU", 10, [11])
    assert second.token_ids == [5, 6, 7, 8]


def test_lora_id_is_kept() -> None:
    """A block's lora_id (newer serializers write it) becomes the event's lora_id."""
    (event,) = map_event(stored(1, chain(10, [1, 2, 3, 4], lora_id=7))).events
    assert isinstance(event, BlockStored) and event.lora_id == 7


def test_priorities_change_nothing_on_the_wire() -> None:
    """Blocks of different priorities are one store; an update (priority) is no wire event."""
    blocks = [block(10, [1, 2, 3, 4], priority=35), block(11, [5, 6, 7, 8], priority=90)]
    (event,) = map_event(stored(1, blocks)).events
    assert isinstance(event, BlockStored) and event.block_hashes == [10, 11]
    mapped = map_event(updated(2, 10))
    assert (mapped.kind, mapped.events) == ("updated", ())


def test_removed_and_created() -> None:
    """removed is BlockRemoved (default tier); created, a (re)created cache, AllBlocksCleared."""
    assert map_event(removed(1, [10, 11])).events == (BlockRemoved(block_hashes=[10, 11]),)
    assert map_event(created(2)).events == (AllBlocksCleared(),)


def test_hashes_are_signed_64_bit() -> None:
    """Unsigned hashes above 2**63 - 1 become their two's complement; signed ones are kept."""
    blocks = [block(2**64 - 1, [1, 2, 3, 4]), block(2**63, [5, 6, 7, 8])]
    (event,) = map_event(stored(1, blocks, parent=2**63 + 1)).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [-1, -(2**63)]
    assert event.parent_block_hash == -(2**63) + 1
    assert map_event(removed(2, [-5, 2**63 - 1])).events[0] == BlockRemoved(
        block_hashes=[-5, 2**63 - 1]
    )


def test_token_extra_ids_go_to_extra_keys() -> None:
    """Non-zero token_extra_id (prompt-tuning tokens) are kept per block in extra_keys."""
    first = block(10, [1, 2, 3, 4])
    second = block(11, [5, 6, 7, 8])
    second["tokens"][1]["token_extra_id"] = 42
    (event,) = map_event(stored(1, [first, second])).events
    assert isinstance(event, BlockStored) and event.extra_keys == [None, [0, 42, 0, 0]]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("not an object", "entry is str"),
        ({"event_id": 1}, "entry.data is missing"),
        (entry(1, {"type": "moved"}), "data.type = 'moved'"),
        (stored(1, [block(2**64, [1, 2, 3, 4])]), r"data.blocks\[0\].block_hash"),
        (stored(1, [block(1.5, [1, 2, 3, 4])]), r"data.blocks\[0\].block_hash is float"),
        (stored(1, [block(1, [1, 2, 3, 4], level=2)]), r"cache_level = 2"),
        (stored(1, []), "data.blocks is empty"),
        (removed(1, ["x"]), r"data.block_hashes\[0\]"),
        (created(1, rank=2), "attention_dp_rank = 2"),
        (stored(1, [{"block_hash": 1, "tokens": [{"token_id": "a"}]}]), "token_id is str"),
        (stored(1, [block(1, [1, True, 3, 4])]), r"tokens\[1\].token_id is bool"),
        (stored(1, [block(1, [1, 2, 2**64, 4])]), r"tokens\[2\].token_id = .* outside"),
    ],
)
def test_malformed_entries_name_the_field_and_the_rule(bad: Any, field: str) -> None:
    """Each malformed shape raises a ValueError saying which field breaks which rule."""
    with pytest.raises(ValueError, match=field):
        map_event(bad, block_size=BS, world_size=2)


# ---------------------------------------------------------------------- the bridge


class FakeLLM:
    """``get_kv_cache_events(timeout)``: what was queued, or [] after waiting the timeout."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()

    def get_kv_cache_events(self, timeout: float) -> Any:
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if isinstance(item, Exception):
            raise item
        return item


def config(replay: bool = True) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0" if replay else None,
    )


@pytest.fixture
def llm() -> FakeLLM:
    return FakeLLM()


@pytest.fixture
def bridge(llm: FakeLLM) -> Iterator[TensorRTLLMBridge]:
    b = TensorRTLLMBridge(llm.get_kv_cache_events, config(), block_size=BS, poll_timeout=0.01)
    b.start(thread=False)
    yield b
    b.close()


def test_one_batch_per_poll_and_a_malformed_entry_skipped_alone(
    bridge: TensorRTLLMBridge, llm: FakeLLM
) -> None:
    """A poll of good, bad, good entries: one batch with both good ones, the bad one counted."""
    llm.queue.put([created(0), {"event_id": 1, "data": {"type": "stored"}}, removed(2, [7])])
    assert bridge.poll_once()
    stats = bridge.stats()
    assert (stats.polls, stats.events, stats.batches, stats.bad_events) == (1, 3, 1, 1)
    assert (stats.created, stats.removed, stats.stored) == (1, 1, 0)
    assert stats.last_error is not None and "data.blocks is missing" in stats.last_error
    assert bridge.publisher_stats()[0].next_seq == 1


def test_updates_and_empty_polls_publish_nothing(bridge: TensorRTLLMBridge, llm: FakeLLM) -> None:
    """A poll of updates only, or of nothing, sends no batch; updates are counted."""
    llm.queue.put([updated(0, 10), updated(1, 11)])
    assert bridge.poll_once() and bridge.poll_once()
    stats = bridge.stats()
    assert (stats.polls, stats.updated, stats.batches) == (2, 2, 0)
    assert bridge.publisher_stats()[0].next_seq == 0


def test_skipped_event_ids_are_counted(bridge: TensorRTLLMBridge, llm: FakeLLM) -> None:
    """A jump in event_id (the engine's event buffer overflowed) counts the events missed."""
    llm.queue.put([created(0), removed(1, [5]), removed(5, [6])])
    bridge.poll_once()
    assert bridge.stats().missed_events == 3


def test_a_failing_poll_is_counted_and_the_next_one_works(
    bridge: TensorRTLLMBridge, llm: FakeLLM
) -> None:
    """A poll that raises, or returns a non-list, is counted; the bridge polls on."""
    llm.queue.put(RuntimeError("executor gone"))
    llm.queue.put({"not": "a list"})
    llm.queue.put([created(0)])
    assert not bridge.poll_once() and not bridge.poll_once() and bridge.poll_once()
    stats = bridge.stats()
    assert (stats.poll_errors, stats.polls, stats.batches) == (2, 1, 1)


def test_close_is_idempotent_and_stops_polling(llm: FakeLLM) -> None:
    """close() stops the thread and the publishers; later polls do nothing."""
    b = TensorRTLLMBridge(llm.get_kv_cache_events, config(), poll_timeout=0.01)
    b.start()
    assert len(b.close()) == 1 and len(b.close()) == 1
    assert b._thread is None and not b.poll_once()
    with pytest.raises(PublisherError):
        b.start()


def test_bad_arguments_are_refused() -> None:
    """A DP size or block size below 1 is a ValueError naming it."""
    with pytest.raises(ValueError, match="attention_dp_size"):
        TensorRTLLMBridge(lambda t: [], config(), attention_dp_size=0)
    with pytest.raises(ValueError, match="block_size"):
        TensorRTLLMBridge(lambda t: [], config(), block_size=0)


# ---------------------------------------------------------------------- on the wire


def deliveries(sub: Subscriber, count: int, timeout: float = 15.0) -> list[Delivery]:
    """The first ``count`` non-empty batches the subscriber delivers (heartbeats skipped)."""
    got: list[Delivery] = []
    deadline = Deadline(timeout)
    while len(got) < count:
        assert not deadline.expired, f"only {len(got)} of {count} batches arrived"
        item = sub.get(0.05)
        if isinstance(item, Delivery) and item.batch.events:
            got.append(item)
    return got


def specs(bridge: TensorRTLLMBridge) -> list[StreamSpec]:
    return [
        StreamSpec("trt", rank, publish, replay)
        for rank, (publish, replay) in bridge.endpoints().items()
        if publish is not None
    ]


def test_two_dp_ranks_publish_on_their_own_endpoints(llm: FakeLLM) -> None:
    """Entries of attention-DP ranks 0 and 1 go to each rank's own stream, rank set."""
    options = PublisherOptions(heartbeat_interval=0.05)
    b = TensorRTLLMBridge(
        llm.get_kv_cache_events, config(), attention_dp_size=2, block_size=BS,
        poll_timeout=0.01, options=options,
    )  # fmt: skip
    with b:
        endpoints = b.endpoints()
        assert len({endpoints[0][0], endpoints[1][0]}) == 2
        llm.queue.put([stored(0, chain(10, [1, 2, 3, 4]), rank=0), removed(0, [20], rank=1)])
        with Subscriber(specs(b)) as sub:
            got = {d.stream.rank: d.batch for d in deliveries(sub, 2)}
    assert got[0].data_parallel_rank == 0 and got[1].data_parallel_rank == 1
    assert [type(e) for e in got[0].events] == [BlockStored]
    assert got[1].events == [BlockRemoved(block_hashes=[20])]


def test_end_to_end_our_subscriber_and_index_match_the_tokens(llm: FakeLLM) -> None:
    """The bridge's stream, read by Subscriber into PrefixIndex, predicts the engine's blocks."""
    prompt = list(range(100, 114))  # three full blocks and a partial one
    options = PublisherOptions(heartbeat_interval=0.05)
    b = TensorRTLLMBridge(
        llm.get_kv_cache_events, config(), block_size=BS, poll_timeout=0.01, options=options
    )
    index = PrefixIndex(BS)
    index.register_worker("trt", block_size=BS)
    with b:
        llm.queue.put([created(0), stored(1, chain(2**64 - 4, prompt))])
        llm.queue.put([removed(2, [2**64 - 2])])  # the third block
        with Subscriber(specs(b)) as sub:
            for delivery in deliveries(sub, 2):
                index.apply("trt", 0, delivery.batch)
    assert index.match(prompt).holders == {HolderKey("trt", 0, "GPU"): 2}
    assert b.stats().partial_blocks == 1


# ---------------------------------------------------------------------- trtllm-serve


class _Events(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[list[Any]] = []
    raw: ClassVar[bytes | None] = None  # an answer sent as is, when set

    def do_POST(self) -> None:
        body = self.raw or json.dumps(self.answers.pop(0) if self.answers else []).encode()
        self.send_response(200 if self.path == "/kv_cache_events" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        """Quiet."""


def test_http_poll_reads_trtllm_serve_kv_cache_events() -> None:
    """http_poll POSTs /kv_cache_events and returns the decoded list of entries."""
    _Events.answers = [[created(0)]]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Events)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        poll = http_poll(f"http://127.0.0.1:{server.server_address[1]}/")
        assert poll(0.0) == [created(0)]
        assert poll(0.0) == []
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_http_poll_of_a_dripping_server_fails_at_its_deadline_and_is_counted() -> None:
    """A server dripping its answer a byte at a time used to hold a poll for good (0 polls, 0
    errors in 8 s); now each poll fails at request_timeout, naming the URL, and is counted."""
    with dripping() as drip:
        poll = http_poll(drip.url, request_timeout=0.5)
        began = time.monotonic()
        with pytest.raises(OSError, match=rf"POST {drip.url}/kv_cache_events: no answer within"):
            poll(0.0)
        assert time.monotonic() - began < 1.5
        bridge = TensorRTLLMBridge(poll, config(), poll_timeout=0.01)
        with bridge:
            deadline = Deadline(10.0)
            while bridge.stats().poll_errors < 2:
                assert not deadline.expired, bridge.stats()
                time.sleep(0.05)
            began = time.monotonic()
        assert time.monotonic() - began < 3.0  # close(): the poll under way ends at its deadline
    stats = bridge.stats()
    assert stats.polls == 0 and stats.last_error is not None
    assert "no answer within 0.5s" in stats.last_error


def test_http_poll_refuses_an_answer_over_its_limit() -> None:
    """A 200 MB answer is refused once max_bytes are read (it used to be read whole: 1.88 GB
    at the peak); the default limit is 64 MiB."""
    assert DEFAULT_MAX_POLL_BYTES == 64 << 20
    limit = 4 << 20
    with flooding() as flood:
        poll = http_poll(flood.url, max_bytes=limit)
        tracemalloc.start()
        try:
            with pytest.raises(OSError, match=f"over {limit} bytes"):
                poll(0.0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 3 * limit, peak


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": 1}', "a JSON dict, not a list"),
        (b"<html>", "not JSON"),
    ],
)
def test_http_poll_answers_that_are_not_a_list_name_the_url(answer: bytes, words: str) -> None:
    """Deep nesting, an object or not JSON at all is a ValueError naming the URL and why."""
    _Events.raw = answer
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Events)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ValueError, match=f"POST {url}/kv_cache_events: .*{words}"):
            http_poll(url)(0.0)
    finally:
        _Events.raw = None
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_close_returns_while_a_poll_hangs() -> None:
    """close() waits poll_timeout + 2 s for a poll under way, not for ever (a hung engine kept
    it waiting past 15 s); what the hung poll returns later is not published."""
    release = threading.Event()
    entered = threading.Event()

    def hanging(timeout: float) -> list[Any]:
        entered.set()
        release.wait(30)
        return [created(0)]

    bridge = TensorRTLLMBridge(hanging, config(), poll_timeout=0.01)
    bridge.start()
    try:
        assert entered.wait(10)
        began = time.monotonic()
        bridge.close()
        assert time.monotonic() - began < 4.0
    finally:
        release.set()
    deadline = Deadline(10.0)
    while bridge._pump.locked():  # the hung poll returns, finds the bridge closed
        assert not deadline.expired
        time.sleep(0.01)
    assert bridge.stats().polls == 0 and bridge.publisher_stats()[0].next_seq == 0


def test_bridge_counters_are_metrics(bridge: TensorRTLLMBridge, llm: FakeLLM) -> None:
    """Every counter of stats() becomes a documented counter sample; the error text does not."""
    llm.queue.put([created(0), "junk"])
    bridge.poll_once()
    samples = {name: (kind, value, doc) for name, kind, value, doc in stats_samples(bridge.stats())}
    assert samples["bad_events"] == ("counter", 1, "malformed entries skipped, one at a time")
    assert samples["batches"][1] == 1 and "last_error" not in samples
    assert len(bridge.collectors()) == 2
