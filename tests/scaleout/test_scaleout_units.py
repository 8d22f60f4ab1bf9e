"""The pure parts of scale-out: relay records, the replica's cursor, the index digest, the
snapshot codec, the trim point. No NATS server."""

from __future__ import annotations

import asyncio
import datetime
from types import SimpleNamespace
from typing import Any

import pytest
from nats.js.api import ConsumerConfig, ConsumerInfo, SequenceInfo

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.index import PrefixIndex, index_digest
from kvevents.scaleout import JetStreamOptions
from kvevents.scaleout import _snapshot as snap
from kvevents.scaleout._cursor import StreamCursor
from kvevents.scaleout._records import (
    RecordError,
    batch_record,
    loss_record,
    parse_record,
    payload_digest,
    reset_record,
    worker_record,
)
from kvevents.scaleout._retention import ack_floor, trim, trim_point
from kvevents.service import WorkerRegistration
from kvevents.testing.fixtures import typical_batch


def _store(hashes: list[int], parent: int | None = None, base: int = 0) -> BlockStored:
    tokens = list(range(base, base + 4 * len(hashes)))
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4
    )


def _batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- records


def test_batch_record_round_trips_and_its_id_depends_on_the_payload_only() -> None:
    """A batch's message id is the same from any relay and differs for another incarnation's
    batch of the same sequence (so JetStream drops copies, never a restarted engine's batch)."""
    subject, body, headers = batch_record("kv", "w 1", 3, 7, b"payload")
    again = batch_record("kv", "w 1", 3, 7, b"payload")
    other = batch_record("kv", "w 1", 3, 7, b"payload of a restarted engine")
    assert headers == again[2] and headers["Nats-Msg-Id"] != other[2]["Nats-Msg-Id"]
    assert "." not in subject.split(".", 2)[2].rsplit(".", 1)[0]  # worker token is one token
    record = parse_record(headers, body)
    assert (record.kind, record.worker_id, record.rank, record.seq) == ("batch", "w 1", 3, 7)
    assert record.digest == payload_digest(b"payload") and record.body == b"payload"


def test_a_worker_record_carries_the_registration() -> None:
    """The replica registers a worker from the relay's record, block size and ranks included."""
    reg = WorkerRegistration("a", "tcp://127.0.0.1:5557", 16, (0, 1), model_name="m")
    _, body, headers = worker_record("kv", reg)
    back = parse_record(headers, body).registration()
    assert (back.worker_id, back.block_size, back.ranks, back.model_name) == ("a", 16, (0, 1), "m")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"Kv-Kind": "nonsense"}, "Kv-Kind"),
        ({"Kv-Rank": "-1"}, "Kv-Rank"),
        ({"Kv-Seq": "x"}, "Kv-Seq"),
        ({"Kv-Digest": ""}, "Kv-Digest"),
    ],
)
def test_a_malformed_record_names_the_header(change: dict[str, str], field: str) -> None:
    """A message that is not a relay record is refused with the header at fault named."""
    _, body, headers = batch_record("kv", "w", 0, 1, b"x")
    with pytest.raises(RecordError) as caught:
        parse_record({**headers, **change}, body)
    assert caught.value.field == field


def test_a_loss_record_must_end_after_it_starts() -> None:
    """A loss of no batches is malformed, not a silent no-op."""
    _, body, headers = loss_record("kv", "w", 0, 5, 9)
    assert parse_record(headers, body).end == 9
    with pytest.raises(RecordError, match="Kv-End"):
        parse_record({**headers, "Kv-End": "5"}, body)


def test_a_reset_record_id_names_the_new_incarnation() -> None:
    """Two relays seeing one restart write the same reset id (JetStream keeps one)."""
    assert reset_record("kv", "w", 0, 0, "ab")[2] == reset_record("kv", "w", 0, 0, "ab")[2]


# ----------------------------------------------------------------------------- cursor


def test_cursor_drops_copies_and_applies_in_order() -> None:
    """A copy of a batch applied (beyond JetStream's window) is dropped, new ones applied."""
    cursor = StreamCursor(window=8)
    assert [cursor.batch(s, f"d{s}") for s in (0, 1, 2)] == ["apply"] * 3
    assert cursor.batch(1, "d1") == "duplicate"
    assert cursor.batch(3, "d3") == "apply"


def test_cursor_sees_an_unannounced_restart_by_its_digest() -> None:
    """A batch at an applied sequence with another payload is a new incarnation: restart."""
    cursor = StreamCursor(window=8)
    for s in range(5):
        cursor.batch(s, f"old{s}")
    assert cursor.batch(0, "new0") == "restart"
    assert cursor.batch(1, "new1") == "apply"
    # A late copy of the old incarnation's batch is stale, not one more restart.
    assert cursor.batch(1, "old1") == "stale" and cursor.last_seq == 1


def test_cursor_drops_what_it_cannot_place_as_stale() -> None:
    """A batch older than the window, or never seen, is dropped (never applied out of order)."""
    cursor = StreamCursor(window=2)
    for s in range(10):
        cursor.batch(s, f"d{s}")
    assert cursor.batch(3, "d3") == "stale"
    assert cursor.batch(9, "d9") == "duplicate"


def test_a_reset_applies_once_per_incarnation() -> None:
    """The same reset from two relays (or redelivered) resets the stream once."""
    cursor = StreamCursor()
    cursor.batch(0, "a")
    cursor.batch(1, "b")
    assert cursor.reset(0, "c") is True
    assert cursor.batch(0, "c") == "apply"
    assert cursor.reset(0, "c") is False
    assert cursor.last_seq == 0


def test_a_loss_counts_only_when_it_covers_batches_not_applied() -> None:
    """A second relay's loss record for batches the first relay delivered costs nothing."""
    cursor = StreamCursor()
    for s in range(6):
        cursor.batch(s, f"d{s}")
    assert cursor.loss(2, 5) is False
    assert cursor.loss(4, 9) is True and cursor.last_seq == 8


def test_cursor_state_survives_a_snapshot() -> None:
    """A restored cursor decides as the saved one did, the old incarnation's copies included."""
    cursor = StreamCursor(window=4)
    for s in range(6):
        cursor.batch(s, f"d{s}")
    cursor.batch(5, "new5")  # an unannounced restart
    cursor.batch(6, "new6")
    back = StreamCursor.restored(cursor.state("w", 0), window=4)
    assert back.batch(6, "new6") == "duplicate" and back.batch(7, "new7") == "apply"
    assert back.batch(5, "d5") == "stale"  # a late copy of the old seq 5: not a restart


# ----------------------------------------------------------------------------- digest


def test_digest_does_not_depend_on_the_order_blocks_came_in() -> None:
    """Two indexes holding the same blocks, built in another order, have one digest."""
    a, b = PrefixIndex(), PrefixIndex()
    for index in (a, b):
        index.register_worker("w", block_size=4)
    a.apply("w", 0, _batch(_store([1, 2]), _store([3], base=100)))
    b.apply("w", 0, _batch(_store([3], base=100)))
    b.apply("w", 0, _batch(_store([1, 2])))
    assert index_digest(a) == index_digest(b)
    assert index_digest(a).by_stream()[("w", 0)].blocks == 3


def test_digest_tells_a_missing_block_and_another_stream() -> None:
    """A block less, or the same blocks on another rank, changes the digest."""
    a, b, c = PrefixIndex(), PrefixIndex(), PrefixIndex()
    for index in (a, b, c):
        index.register_worker("w", block_size=4, ranks=2)
    a.apply("w", 0, _batch(_store([1, 2])))
    b.apply("w", 0, _batch(_store([1, 2]), BlockRemoved(block_hashes=[2])))
    c.apply("w", 1, _batch(_store([1, 2])))
    totals = {index_digest(x).total for x in (a, b, c)}
    assert len(totals) == 3


# ----------------------------------------------------------------------------- snapshots


def _built() -> PrefixIndex:
    index = PrefixIndex()
    index.register_worker("w", block_size=16, ranks=2)
    for step in range(20):
        index.apply("w", step % 2, typical_batch(step))
    # The same block stored twice: one removal must leave it held (reference counts).
    index.apply("w", 0, typical_batch(30))
    index.apply("w", 0, typical_batch(30))
    return index


def test_a_loaded_snapshot_holds_what_was_saved() -> None:
    """Encode, decode and restore give an index with the same digest and the same matches."""
    index = _built()
    saved = snap.capture(index, stream="S", seq=42, replica="r", workers=[], cursors=[])
    loaded = snap.decode(snap.encode(saved))
    fresh = PrefixIndex()
    snap.restore(fresh, loaded)
    assert loaded.seq == 42 and index_digest(fresh) == index_digest(index)
    tokens = list(range(30_000, 30_000 + 64))
    assert fresh.match(tokens).holders == index.match(tokens).holders


def test_a_loaded_snapshot_goes_on_as_the_saved_index_would() -> None:
    """After loading, the next events (a removal of a twice-stored block, children of saved
    blocks, a clear) leave the same index as on the original."""
    index = _built()
    fresh = PrefixIndex()
    snap.restore(
        fresh,
        snap.decode(
            snap.encode(snap.capture(index, stream="S", seq=1, replica="r", workers=[], cursors=[]))
        ),
    )
    child = BlockStored(
        block_hashes=[999_001], parent_block_hash=30_016, token_ids=list(range(16)), block_size=16
    )
    for target in (index, fresh):
        target.apply("w", 0, _batch(BlockRemoved(block_hashes=[30_001]), child))
        target.apply("w", 1, _batch(AllBlocksCleared()))
    assert index_digest(fresh) == index_digest(index)
    assert index_digest(fresh).by_stream()[("w", 0)].blocks == index.stats().entries


def test_a_damaged_snapshot_is_refused_by_name() -> None:
    """Bytes that are not a snapshot raise SnapshotError naming the object."""
    with pytest.raises(snap.SnapshotError, match=r"KVEVENTS\.r1"):
        snap.decode(b"\x93garbage", "KVEVENTS.r1")


def test_trim_keeps_what_the_slowest_replica_and_the_snapshot_need() -> None:
    """The stream is trimmed below the lowest of the snapshot and every acknowledged floor."""
    assert trim_point(100, [250, 80]) == 81
    assert trim_point(100, [250]) == 101
    assert trim_point(100, []) == 101


def test_a_consumer_whose_floor_the_server_does_not_give_keeps_the_stream() -> None:
    """nats-py's ConsumerInfo.ack_floor is optional: a consumer without one counts as having
    acknowledged nothing, so nothing is purged (before, every trim failed on it)."""
    acked = _consumer(SequenceInfo(consumer_seq=7, stream_seq=250))
    assert ack_floor(acked) == 250 and ack_floor(_consumer(None)) == 0
    unknown = _JetStream([acked, _consumer(None)])
    assert asyncio.run(trim(unknown, JetStreamOptions(), 100)) is False
    assert unknown.purged == []
    known = _JetStream([acked])
    assert asyncio.run(trim(known, JetStreamOptions(), 100)) is True
    assert known.purged == [101]


def _consumer(floor: SequenceInfo | None) -> ConsumerInfo:
    created = datetime.datetime.now(datetime.timezone.utc)
    return ConsumerInfo("c", "S", ConsumerConfig(), created, ack_floor=floor)


class _JetStream:
    """What trim() asks of nats-py's JetStream context: a stream beginning at seq 1."""

    def __init__(self, consumers: list[ConsumerInfo]) -> None:
        self.consumers = consumers
        self.purged: list[int] = []

    async def consumers_info(self, stream: str) -> list[ConsumerInfo]:
        return self.consumers

    async def stream_info(self, stream: str) -> Any:
        return SimpleNamespace(state=SimpleNamespace(first_seq=1))

    async def purge_stream(self, stream: str, seq: int) -> None:
        self.purged.append(seq)


# ----------------------------------------------------------------------------- replica rules


def _replica_fed(*messages: tuple[dict[str, str], bytes]) -> object:
    from kvevents.scaleout._replica import Replica

    replica = Replica("nats://127.0.0.1:1")  # never started: records are applied by hand
    for headers, body in messages:
        replica.apply_message(headers, body)
    return replica


def _records(*outgoing: tuple[str, bytes, dict[str, str]]) -> list[tuple[dict[str, str], bytes]]:
    return [(headers, body) for _, body, headers in outgoing]


def test_a_replica_degrades_a_stream_on_a_loss_and_trusts_it_again_when_live() -> None:
    """A loss after applied batches marks the rank degraded in routing; ``live`` clears it; a
    loss of batches another relay delivered changes nothing."""
    from kvevents.scaleout._records import live_record
    from kvevents.wire import encode_batch

    reg = WorkerRegistration("w", "tcp://127.0.0.1:5557", 16, (0,))
    payloads = [encode_batch(typical_batch(s)) for s in range(4)]
    replica: Any = _replica_fed(
        *_records(worker_record("kv", reg)),
        *_records(*(batch_record("kv", "w", 0, s, p) for s, p in enumerate(payloads))),
        *_records(loss_record("kv", "w", 0, 1, 3)),  # applied already: no effect
    )
    assert replica.stats().applied == 4 and replica.stats().losses == 0
    assert ("w", 0) not in replica.service.router.degraded
    replica.apply_message(*_records(loss_record("kv", "w", 0, 4, 6))[0])
    assert replica.stats().losses == 1
    assert "lost seq 4..5" in str(replica.service.router.degraded[("w", 0)])
    replica.apply_message(*_records(live_record("kv", "w", 0, 5))[0])
    assert ("w", 0) not in replica.service.router.degraded


def test_a_replica_counts_what_it_cannot_apply() -> None:
    """Malformed messages, batches of unknown workers and undecodable payloads are counted
    and skipped one at a time; the next good batch is applied."""
    from kvevents.wire import encode_batch

    reg = WorkerRegistration("w", "tcp://127.0.0.1:5557", 16, (0,))
    good = encode_batch(typical_batch(1))
    replica: Any = _replica_fed(
        ({"Kv-Kind": "batch"}, b""),
        *_records(batch_record("kv", "stranger", 0, 0, good)),
        *_records(worker_record("kv", reg)),
        *_records(batch_record("kv", "w", 0, 0, b"\xc1not msgpack")),
        *_records(batch_record("kv", "w", 0, 1, good)),
    )
    stats = replica.stats()
    assert (stats.malformed, stats.unregistered, stats.undecodable, stats.applied) == (1, 1, 1, 1)


# ----------------------------------------------------------------------------- hostile records


_REG = WorkerRegistration("w", "tcp://127.0.0.1:5557", 16, (0,))


def _payload(step: int) -> bytes:
    from kvevents.wire import encode_batch

    return encode_batch(typical_batch(step))


def _reference(*steps: int) -> PrefixIndex:
    """An index fed the batches of ``steps`` directly (what a replica must hold)."""
    index = PrefixIndex()
    index.register_worker("w", block_size=16)
    for step in steps:
        index.apply("w", 0, typical_batch(step))
    return index


def _fed(*steps: int) -> Any:
    """A replica (never started) fed the registration and batches 0.. of ``steps``."""
    return _replica_fed(
        *_records(worker_record("kv", _REG)),
        *_records(*(batch_record("kv", "w", 0, s, _payload(p)) for s, p in enumerate(steps))),
    )


def _worker_message(body: bytes) -> tuple[dict[str, str], bytes]:
    _, _, headers = worker_record("kv", _REG)
    return headers, body


@pytest.mark.parametrize(
    "body",
    [
        b'{"worker_id": "w", "ranks": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"worker_id": "w", "endpoint": "bogus", "block_size": 16, "ranks": [0]}',
        b'{"worker_id": "w", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16, '
        b'"ranks": [1000000000000000000000000000000]}',
        b'{"worker_id": "w", "endpoint": "tcp://127.0.0.1:65535", "block_size": 16, '
        b'"ranks": [0, 1]}',
        b'{"worker_id": "w", "endpoint": "tcp://127.0.0.1:5557", "block_size": 2097152, '
        b'"ranks": [0]}',
        b'{"worker_id": "other", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16, '
        b'"ranks": [0]}',
    ],
    ids=["nested-200KB", "endpoint-bogus", "rank-1e30", "port-overflow", "block-2^21", "not-w"],
)
def test_a_hostile_worker_record_is_counted_and_skipped(body: bytes) -> None:
    """A ``worker`` record a replica could not hold (deep JSON, an endpoint that does not
    parse, a rank past 65535, a block size past 2^20, another worker's body) is malformed:
    counted, skipped, and the replica still applies and snapshots what comes next."""
    replica: Any = _fed()
    replica.apply_message(*_worker_message(body))
    replica.apply_message(*_records(batch_record("kv", "w", 0, 0, _payload(1)))[0])
    stats = replica.stats()
    assert (stats.malformed, stats.applied, stats.registrations) == (1, 1, 1)
    assert replica.digest() == index_digest(_reference(1))
    assert snap.decode(snap.encode(replica._capture())).seq == 0  # it can always be saved


def test_a_batch_for_a_refused_worker_is_unregistered_not_fatal() -> None:
    """A ``worker`` record with endpoint ``bogus`` and then a batch for it: the record is
    malformed, the batch unregistered, and nothing raises."""
    bogus = b'{"worker_id": "x", "endpoint": "bogus", "block_size": 16, "ranks": [0]}'
    _, _, headers = worker_record("kv", WorkerRegistration("x", "tcp://127.0.0.1:1", 16))
    replica: Any = _replica_fed(
        (headers, bogus), *_records(batch_record("kv", "x", 0, 0, _payload(1)))
    )
    assert (replica.stats().malformed, replica.stats().unregistered) == (1, 1)


@pytest.mark.parametrize(
    ("reg", "field"),
    [
        (WorkerRegistration("w", "bogus", 16), "endpoint"),
        (WorkerRegistration("w", "tcp://127.0.0.1:5557", 1 << 21), "block_size"),
        (WorkerRegistration("w", "tcp://127.0.0.1:5557", 16, (10**30,)), "ranks"),
        (WorkerRegistration("w" * 300, "tcp://127.0.0.1:5557", 16), "worker_id"),
    ],
)
def test_the_relay_does_not_write_a_worker_record_replicas_refuse(
    reg: WorkerRegistration, field: str
) -> None:
    """The relay builds its records through the replicas' own check: a registration past
    a bound is a RecordError naming the field, never a message every replica refuses."""
    with pytest.raises(RecordError, match=field):
        worker_record("kv", reg)


class _FailsOnce(PrefixIndex):
    """An index whose first ingest raises (a defect in applying a batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = [RuntimeError("boom")]

    def ingest(self, worker_id: str, rank: int, batch: KVEventBatch) -> bool:
        if self.failures:
            raise self.failures.pop()
        return super().ingest(worker_id, rank, batch)


def test_a_record_that_raises_anyway_costs_only_itself() -> None:
    """A record whose application raises (a defect) is counted in apply_errors and logged;
    the next batch is applied."""
    from kvevents.scaleout._replica import Replica

    replica = Replica("nats://127.0.0.1:1")  # never started: records are applied by hand
    replica.service = replica.new_service(index=_FailsOnce())
    replica.apply_message(*_records(worker_record("kv", _REG))[0])
    for seq, step in enumerate((1, 2)):
        replica.apply_message(*_records(batch_record("kv", "w", 0, seq, _payload(step)))[0])
    assert (replica.stats().apply_errors, replica.stats().applied) == (1, 1)
    assert replica.service.stats().apply_errors == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"Kv-Seq": str(1 << 64)}, "Kv-Seq"),
        ({"Kv-Seq": "9" * 5000}, "Kv-Seq"),
        ({"Kv-Rank": "65536"}, "Kv-Rank"),
        ({"Kv-Digest": "x" * 100_000}, "Kv-Digest"),
        ({"Kv-Worker": "w" * 300}, "Kv-Worker"),
    ],
)
def test_header_numbers_and_digests_are_bounded(change: dict[str, str], field: str) -> None:
    """Numbers past what an engine or a snapshot can hold, and digests that are not 16 hex
    digits, are malformed (a snapshot encodes every cursor and registration it applied)."""
    _, body, headers = batch_record("kv", "w", 0, 1, b"x")
    with pytest.raises(RecordError) as caught:
        parse_record({**headers, **change}, body)
    assert caught.value.field == field


# ----------------------------------------------------------------------------- forged sequences


def test_an_undecodable_batch_with_a_forged_seq_leaves_the_stream_as_it_was() -> None:
    """An undecodable payload claiming seq 10^9 is counted; the cursor does not move, so the
    genuine batches after it are applied, not dropped as stale."""
    replica: Any = _fed(0, 1, 2)
    forged = batch_record("kv", "w", 0, 10**9, b"\xc1 not msgpack")
    replica.apply_message(*_records(forged)[0])
    for seq in (3, 4):
        replica.apply_message(*_records(batch_record("kv", "w", 0, seq, _payload(seq)))[0])
    stats = replica.stats()
    assert (stats.undecodable, stats.stale, stats.applied) == (1, 0, 5)
    assert replica.digest() == index_digest(_reference(0, 1, 2, 3, 4))
    assert replica._applier.cursors[("w", 0)].last_seq == 4  # what a snapshot would save


def test_a_decodable_batch_with_a_forged_high_seq_does_not_freeze_the_stream() -> None:
    """A decodable batch at seq 2^40 jumps the cursor ahead; the genuine batch after it goes
    on below the jump, so the stream is rewound (reset, rebuilt from there) instead of
    dropping every later batch as stale. The stream is degraded while it waits, whole after."""
    replica: Any = _fed(0, 1, 2)
    replica.apply_message(*_records(batch_record("kv", "w", 0, 1 << 40, _payload(50)))[0])
    assert replica._applier.degraded()[0] == 1  # batches 3 .. 2^40 - 1 never came
    for seq in (3, 4, 5):
        replica.apply_message(*_records(batch_record("kv", "w", 0, seq, _payload(seq)))[0])
    stats = replica.stats()
    assert (stats.rewinds, stats.stale, stats.gaps) == (1, 0, 1)
    assert replica.digest() == index_digest(_reference(3, 4, 5))
    assert ("w", 0) not in replica.service.router.degraded


def test_a_forged_loss_record_does_not_freeze_the_stream() -> None:
    """A loss record claiming batches up to 2^50 moves the cursor there; the genuine batches
    that follow rewind the stream rather than being dropped as stale."""
    replica: Any = _fed(0, 1)
    replica.apply_message(*_records(loss_record("kv", "w", 0, 2, 1 << 50))[0])
    for seq in (2, 3):
        replica.apply_message(*_records(batch_record("kv", "w", 0, seq, _payload(seq)))[0])
    assert replica.stats().rewinds == 1 and replica.stats().stale == 0
    assert replica.digest() == index_digest(_reference(2, 3))


def test_a_small_jump_ahead_degrades_the_stream_and_costs_only_its_width() -> None:
    """A batch 3 past the last (no loss record) is applied and degrades the stream: batches
    2..4 never came. Batches inside a gap no wider than the window are stale (a relay's
    reorder), and the stream goes on past it."""
    replica: Any = _fed(0, 1)
    replica.apply_message(*_records(batch_record("kv", "w", 0, 5, _payload(5)))[0])
    assert replica.service.router.degraded[("w", 0)] == "lost seq 2..4"
    replica.apply_message(*_records(batch_record("kv", "w", 0, 3, _payload(3)))[0])
    replica.apply_message(*_records(batch_record("kv", "w", 0, 6, _payload(6)))[0])
    stats = replica.stats()
    assert (stats.gaps, stats.stale, stats.rewinds, stats.applied) == (1, 1, 0, 4)
    assert replica._applier.degraded()[0] == 1


def test_cursor_judges_without_moving() -> None:
    """judge() is pure: only accept() moves the cursor (a payload refused never moves it)."""
    cursor = StreamCursor(window=4)
    cursor.batch(0, "a")
    assert cursor.judge(10**12, "b") == "gap" and cursor.last_seq == 0
    cursor.accept(10**12, "b", "gap")
    assert cursor.gap == (1, 10**12)
    assert cursor.judge(1, "c") == "rewind" and cursor.last_seq == 10**12
    assert cursor.judge(10**12 - 2, "d") == "rewind"


def test_a_jump_saved_in_a_snapshot_still_rewinds_after_loading() -> None:
    """A cursor saved while jumped ahead (its gap in the snapshot) rewinds once loaded; a
    cursor without a gap is saved as before (no field an older replica does not know)."""
    cursor = StreamCursor(window=4)
    cursor.batch(0, "a")
    cursor.batch(1 << 40, "b")
    state = snap.decode(
        snap.encode(
            snap.capture(
                PrefixIndex(),
                stream="S",
                seq=1,
                replica="r",
                workers=[],
                cursors=[cursor.state("w", 0)],
            )
        )
    ).cursors[0]
    assert StreamCursor.restored(state, 4).judge(1, "c") == "rewind"
    plain = StreamCursor(window=4)
    plain.batch(0, "a")
    assert b"gap" not in snap.encode(
        snap.capture(
            PrefixIndex(), stream="S", seq=1, replica="r", workers=[], cursors=[plain.state("w", 0)]
        )
    )


# ----------------------------------------------------------------------------- the consume loop


class _Msg:
    """A JetStream message as a pull subscription returns it (``seq`` None: its metadata
    cannot be read)."""

    def __init__(self, seq: int | None, headers: dict[str, str], body: bytes) -> None:
        self.headers, self.data, self.seq = headers, body, seq
        self.acked = False

    @property
    def metadata(self) -> Any:
        if self.seq is None:
            raise ValueError("not a JetStream message")
        return type("M", (), {"sequence": type("S", (), {"stream": self.seq})()})()

    async def ack(self) -> None:
        self.acked = True


class _Pulls:
    """A pull subscription that answers each fetch from a script, then closes the replica."""

    def __init__(self, replica: Any, script: list[Any]) -> None:
        self.replica, self.script = replica, list(script)

    async def fetch(self, batch: int = 1, timeout: float = 5.0) -> list[_Msg]:
        if not self.script:
            self.replica._closing = True
            return []
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return list(step)


def test_a_fetch_that_returns_nothing_keeps_the_replica_consuming() -> None:
    """nats-py 2.16 returns [] when the server's timeout (408) comes before its own: the
    loop waits for the next fetch (it used to die on ``msgs[-1]``, for ever)."""
    import asyncio

    from kvevents.scaleout._replica import Replica

    replica = Replica("nats://127.0.0.1:1")
    _, body, headers = worker_record("kv", _REG)
    _, payload, batch = batch_record("kv", "w", 0, 0, _payload(1))
    script: list[Any] = [[], [], [_Msg(1, headers, body)], [], [_Msg(2, batch, payload)], []]
    asyncio.run(asyncio.wait_for(replica._consume(_Pulls(replica, script)), 10))
    assert replica.stats().applied == 1 and replica.covered_seq == 2


def test_a_turn_that_raises_is_counted_and_the_loop_goes_on() -> None:
    """A fetch that fails, a message without a stream sequence, and a turn that raises (a
    defect) are each counted; the loop applies the next message."""
    import asyncio

    from kvevents.scaleout._replica import Replica

    replica: Any = Replica("nats://127.0.0.1:1")
    real, failures = replica._maybe_snapshot, [RuntimeError("a defect")]

    async def snapshot_once_broken() -> None:
        if failures:
            raise failures.pop()
        await real()

    replica._maybe_snapshot = snapshot_once_broken
    _, body, headers = worker_record("kv", _REG)
    _, payload, batch = batch_record("kv", "w", 0, 0, _payload(1))
    script: list[Any] = [
        RuntimeError("server restarting"),
        [_Msg(None, headers, body), _Msg(2, headers, body)],
        [_Msg(3, batch, payload)],
    ]
    asyncio.run(asyncio.wait_for(replica._consume(_Pulls(replica, script)), 10))
    stats = replica.stats()
    assert (stats.fetch_errors, stats.malformed, stats.consume_errors) == (1, 1, 1)
    assert stats.applied == 1 and replica.covered_seq == 3


def test_a_turn_that_hangs_makes_the_replica_stalled() -> None:
    """A fetch that never returns (a hung server) is not ``ok``: after ``stall_after`` the
    replica's health says stalled, with how long the turn has lasted."""
    import asyncio
    import time

    from kvevents.scaleout._jetstream import LoopThread
    from kvevents.scaleout._replica import Replica, ReplicaOptions

    class Connected:
        is_connected = True

        async def close(self) -> None:
            pass

    class Hangs:
        async def fetch(self, batch: int = 1, timeout: float = 5.0) -> list[_Msg]:
            await asyncio.sleep(60)
            return []

    replica: Any = Replica("nats://127.0.0.1:1", options=ReplicaOptions(stall_after=0.3))
    replica._nc, replica._aio = Connected(), LoopThread("test-stall")
    try:

        async def spawn() -> None:
            replica._spawn(replica._consume(Hangs()))

        replica._aio.run(spawn(), 5)
        assert replica.health().state == "ok"
        deadline = time.monotonic() + 10
        while replica.health().state == "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = replica.health()
        assert health.state == "stalled" and "has lasted" in str(health.error)
        assert health.stalled_for >= 0.3
    finally:
        replica.close()


# ----------------------------------------------------------------------------- snapshot lists


class _Info:
    def __init__(self, name: str, description: str | None) -> None:
        self.name, self.description = name, description


class _Store:
    def __init__(self, *infos: _Info) -> None:
        self.infos = list(infos)

    async def list(self, ignore_deletes: bool = False) -> list[_Info]:
        return self.infos


def test_newest_snapshots_are_those_of_the_stream_asked_for() -> None:
    """Replicas of two streams sharing a bucket each see their own stream's snapshots only
    (by the stream their description names, or by the object's name for older ones)."""
    import asyncio
    import json

    from kvevents.scaleout._retention import newest_snapshots

    store = _Store(
        _Info("A.r1", json.dumps({"seq": 900, "stream": "A"})),
        _Info("B.r1", json.dumps({"seq": 50, "stream": "B"})),
        _Info("B.old", json.dumps({"seq": 40})),  # saved before descriptions named a stream
        _Info("A.old", json.dumps({"seq": 30})),
        _Info("junk", "[" * 10_000),
    )
    assert asyncio.run(newest_snapshots(store, "B")) == [("B.r1", 50), ("B.old", 40)]
    assert asyncio.run(newest_snapshots(store, "A")) == [("A.r1", 900), ("A.old", 30)]
