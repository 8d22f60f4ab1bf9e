"""The cursor alone: every action, without sockets."""

from __future__ import annotations

import pytest

from kvevents.subscribe._cursor import (
    END_SEQ,
    Cursor,
    Deliver,
    Duplicate,
    Gap,
    ReplayDone,
    Restart,
    Unrecoverable,
)


def p(seq: int, incarnation: int = 0) -> bytes:
    return f"batch-{incarnation}-{seq}".encode()


def delivered(actions: list[object]) -> list[int]:
    return [a.seq for a in actions if isinstance(a, Deliver)]


def test_in_order_stream_is_delivered_as_is() -> None:
    """Contiguous live messages from 0 are delivered one by one, state live."""
    cursor = Cursor()
    assert cursor.state == "new"
    out = [a for seq in range(5) for a in cursor.on_live(seq, p(seq))]
    assert out == [Deliver(seq, p(seq)) for seq in range(5)]
    assert cursor.state == "live" and cursor.next_seq == 5


def test_late_join_replays_from_zero_then_releases_buffer() -> None:
    """A first message with seq > 0 asks a replay from 0; live messages wait behind it."""
    cursor = Cursor()
    assert cursor.on_live(3, p(3)) == [Gap(0, 3)]
    assert cursor.state == "replaying"
    assert cursor.on_live(4, p(4)) == []
    assert cursor.buffered == 2
    out = [a for seq in range(3) for a in cursor.on_replay(seq, p(seq))]
    assert delivered(out) == [0, 1, 2, 3, 4]
    assert out[-1] == ReplayDone()
    assert cursor.state == "live" and cursor.buffered == 0
    assert cursor.on_replay(3, p(3)) == []  # the rest of the replay is ignored


def test_gap_replays_the_hole_and_keeps_order() -> None:
    """seq > next asks for [next, seq) and delivers replay then buffered live in order."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    assert cursor.on_live(3, p(3)) == [Gap(1, 3)]
    cursor.on_live(5, p(5))  # 4 lost live too: the replay covers it
    out: list[object] = []
    for seq in range(1, 6):
        out += cursor.on_replay(seq, p(seq))
    assert delivered(out) == [1, 2, 3, 4, 5]
    assert cursor.state == "live"


def test_duplicate_of_delivered_batch_is_not_a_restart() -> None:
    """A repeated (seq, payload) already delivered is reported Duplicate, nothing else."""
    cursor = Cursor()
    for seq in range(4):
        cursor.on_live(seq, p(seq))
    assert cursor.on_live(2, p(2)) == [Duplicate(2)]
    assert cursor.on_live(0, p(0)) == [Duplicate(0)]
    assert cursor.on_live(4, p(4)) == [Deliver(4, p(4))]


@pytest.mark.parametrize("digest_name", ["hash", "xxh3"])
def test_duplicates_are_proven_with_the_digest_given(digest_name: str) -> None:
    """The digest decides what is the same payload: with the subscriber's xxh3 or Python's
    hash, a repeat is a Duplicate and a new payload at that seq a Restart; a digest that sees
    every payload alike makes every repeat of a seq a Duplicate."""
    digest = hash if digest_name == "hash" else pytest.importorskip("xxhash").xxh3_64_intdigest
    cursor = Cursor(digest=digest)
    for seq in range(4):
        assert cursor.accept(seq, p(seq)) or cursor.on_live(seq, p(seq)) == [Deliver(seq, p(seq))]
    assert cursor.on_live(3, p(3)) == [Duplicate(3)]
    assert cursor.on_live(3, p(3, incarnation=1))[0] == Restart(3)
    blind = Cursor(digest=lambda payload: 0)
    for seq in range(4):
        blind.on_live(seq, p(seq))
    assert blind.on_live(3, p(3, incarnation=1)) == [Duplicate(3)]


def test_duplicate_while_replaying_is_not_buffered_twice() -> None:
    """A live duplicate of a buffered message is a Duplicate, and the buffer keeps one copy."""
    cursor = Cursor()
    cursor.on_live(2, p(2))
    assert cursor.on_live(2, p(2)) == [Duplicate(2)]
    assert cursor.buffered == 1


def test_sequence_back_to_zero_with_new_payload_is_a_restart() -> None:
    """seq 0 with a different payload after advancing resets and rebuilds from 0."""
    cursor = Cursor()
    for seq in range(10):
        cursor.on_live(seq, p(seq))
    assert cursor.on_live(0, p(0, incarnation=1)) == [
        Restart(0),
        Deliver(0, p(0, incarnation=1)),
    ]
    assert cursor.next_seq == 1 and cursor.state == "live"


def test_restart_seen_late_rebuilds_through_replay_from_zero() -> None:
    """A restarted publisher first seen at seq 3 (< next) resets and replays from 0."""
    cursor = Cursor()
    for seq in range(10):
        cursor.on_live(seq, p(seq))
    assert cursor.on_live(3, p(3, incarnation=1)) == [Restart(3), Gap(0, 3)]
    assert cursor.state == "replaying"


def test_sequence_older_than_the_window_is_a_restart() -> None:
    """Going back past what the duplicate window remembers cannot be proven a duplicate."""
    cursor = Cursor(window=4)
    for seq in range(10):
        cursor.on_live(seq, p(seq))
    assert cursor.on_live(2, p(2))[0] == Restart(2)


def test_end_marker_on_the_live_socket_is_a_restart() -> None:
    """An end-of-replay marker arriving live means the publisher ended: reset the stream."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    assert cursor.on_live(END_SEQ, b"") == [Restart(END_SEQ)]
    assert cursor.state == "new"
    assert cursor.on_live(0, p(0, 1)) == [Deliver(0, p(0, 1))]


def test_without_replay_a_gap_is_unrecoverable_and_delivery_goes_on() -> None:
    """No replay source: report [next, seq) unrecoverable, mark incomplete, deliver seq."""
    cursor = Cursor(can_replay=False)
    assert cursor.on_live(5, p(5)) == [Unrecoverable(0, 5), Deliver(5, p(5))]
    assert cursor.state == "incomplete" and not cursor.complete
    assert cursor.on_live(8, p(8)) == [Unrecoverable(6, 8), Deliver(8, p(8))]
    cursor.mark_complete()
    assert cursor.state == "live"


def test_replay_starting_later_than_asked_reports_the_trimmed_range() -> None:
    """A replay whose first seq is later than asked: the difference is unrecoverable."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    cursor.on_live(10, p(10))
    out = cursor.on_replay(4, p(4))
    assert out[:2] == [Unrecoverable(1, 4), Deliver(4, p(4))]
    rest = [a for seq in range(5, 10) for a in cursor.on_replay(seq, p(seq))]
    assert delivered(rest) == [5, 6, 7, 8, 9, 10]
    assert cursor.state == "incomplete"


def test_trimmed_replay_keeps_buffered_live_batches_inside_the_hole() -> None:
    """Live batches buffered inside the trimmed range are delivered, not thrown away."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    cursor.on_live(5, p(5))
    cursor.on_live(6, p(6))
    out = cursor.on_replay(7, p(7))
    assert out == [Unrecoverable(1, 5), Deliver(5, p(5)), Deliver(6, p(6)), ReplayDone()]


def test_failed_replay_releases_the_buffer_and_reports_the_hole() -> None:
    """A replay that timed out reports the hole and delivers the buffered live messages."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    cursor.on_live(3, p(3))
    cursor.on_live(4, p(4))
    out = cursor.on_replay_end(ok=False)
    assert out == [Unrecoverable(1, 3), Deliver(3, p(3)), Deliver(4, p(4)), ReplayDone()]
    assert cursor.state == "incomplete"


def test_replay_that_ended_early_after_progress_asks_again() -> None:
    """A hole beyond what the server held when it answered is asked for once more."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    cursor.on_live(2, p(2))
    cursor.on_live(5, p(5))  # 3 and 4 lost live, published after the server answered
    cursor.on_replay(1, p(1))
    assert cursor.on_replay_end() == [Gap(3, 5)]
    assert cursor.on_replay_end() == [Unrecoverable(3, 5), Deliver(5, p(5)), ReplayDone()]


def test_buffer_limit_abandons_the_replay() -> None:
    """More live messages than max_buffered while replaying gives up on the hole."""
    cursor = Cursor(max_buffered=2)
    cursor.on_live(0, p(0))
    cursor.on_live(2, p(2))
    cursor.on_live(3, p(3))
    out = cursor.on_live(4, p(4))
    assert out[0] == Unrecoverable(1, 2)
    assert delivered(out) == [2, 3, 4]
    assert cursor.state == "incomplete"


def test_live_restart_while_replaying_drops_the_buffer() -> None:
    """A restart found during a replay discards the buffer and starts over from 0."""
    cursor = Cursor()
    cursor.on_live(0, p(0))
    cursor.on_live(5, p(5))
    assert cursor.on_live(0, p(0, 1)) == [Restart(0), Deliver(0, p(0, 1))]
    assert cursor.buffered == 0 and cursor.state == "live"
    assert cursor.on_replay(1, p(1)) == []  # the old replay's messages are stale


def test_invalid_limits_are_rejected() -> None:
    """A zero window or buffer would make every message a restart; refuse it."""
    with pytest.raises(ValueError):
        Cursor(window=0)


class _CountingBuffer(dict[int, bytes]):
    """A cursor buffer that counts the keys its iterations visit, and stops at a budget."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.visits = 0
        self.budget = budget

    def __iter__(self):  # type: ignore[no-untyped-def]
        for key in super().__iter__():
            self.visits += 1
            if self.visits > self.budget:
                raise AssertionError(f"more than {self.budget} key visits: quadratic")
            yield key


def test_releasing_40k_holes_visits_each_buffered_batch_a_few_times() -> None:
    """Abandoning a replay over 40k holes is O(n log n): no rescans per hole (was 26 s)."""
    holes = 40_000
    cursor = Cursor(max_buffered=10 * holes)
    buffer = _CountingBuffer(budget=4 * holes)
    cursor._buffer = buffer
    cursor.on_live(0, p(0))
    for seq in range(2, 2 * holes + 2, 2):  # every other batch missing: 40k holes
        cursor.on_live(seq, p(seq))
    assert cursor.buffered == holes and cursor.replaying
    actions = cursor.on_replay_end(ok=False)
    lost = [a for a in actions if isinstance(a, Unrecoverable)]
    assert len(lost) == holes
    assert delivered(actions) == list(range(2, 2 * holes + 2, 2))
    assert buffer.visits <= 2 * holes
    assert cursor.state == "incomplete" and cursor.buffered == 0
