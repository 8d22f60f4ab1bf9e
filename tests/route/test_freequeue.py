"""The front door's free block queue: which matched blocks a request's prefill will find."""

from __future__ import annotations

import pytest

from kvevents.index import LoadBook
from kvevents.route._freequeue import FreeQueue
from kvevents.route._inflight import InFlight, Ticket
from kvevents.route._plan import _unkeyed
from kvevents.route._seam import Outcome

T = ("e0", 0)
NOTHING: frozenset[int] = frozenset()


def test_a_request_frees_its_answer_then_its_prompt_last_first() -> None:
    queue = FreeQueue()
    queue.freed(T, [10, 11, 12], unkeyed=1, last=12)  # the queue: (12, 1) 12 11 10
    keys = [10, 11, 12]
    assert queue.surviving(T, keys, 3, room=5, held=NOTHING) == 3
    assert queue.surviving(T, keys, 3, room=4, held=NOTHING) == 3
    assert queue.surviving(T, keys, 3, room=3, held=NOTHING) == 3  # the answer goes first
    assert queue.surviving(T, keys, 3, room=2, held=NOTHING) == 2  # then the prompt's tail
    assert queue.surviving(T, keys, 3, room=1, held=NOTHING) == 1
    assert queue.surviving(T, keys, 3, room=0, held=NOTHING) == 0
    assert queue.surviving(T, keys, 3, room=-4, held=NOTHING) == 0
    assert queue.surviving(T, keys, 2, room=0, held=NOTHING) == 0
    assert queue.surviving(T, keys, 0, room=9, held=NOTHING) == 0


def test_both_ends_of_the_queue_read_alike() -> None:
    queue = FreeQueue()
    queue.freed(T, list(range(100, 140)), unkeyed=3, last=139)  # 43 entries
    keys = list(range(100, 140))
    for room in range(0, 45):
        # The newest `room` entries survive: the prompt's first min(room, 40) blocks.
        assert queue.surviving(T, keys, 40, room, NOTHING) == min(room, 40), room


def test_a_later_turn_finds_the_answer_blocks_by_their_place() -> None:
    """The blocks past a prompt (its answer's) have no key here: the next turn, whose history
    goes on through them, matches them under keys of its own, found by their place after the
    prompt's last key; they went into the queue before the prompt's blocks, so they go first."""
    queue = FreeQueue()
    queue.freed(T, [1, 2, 3], unkeyed=2, last=3)  # the queue: (3, 2) (3, 1) 3 2 1
    turn = [1, 2, 3, 40, 41, 42]  # 40 and 41 are the answer's blocks, 42 is new
    assert queue.surviving(T, turn, 5, room=5, held=NOTHING) == 5
    assert queue.surviving(T, turn, 5, room=4, held=NOTHING) == 4
    assert queue.surviving(T, turn, 5, room=3, held=NOTHING) == 3
    assert queue.surviving(T, turn, 5, room=2, held=NOTHING) == 2
    # Held by a request in flight, the prompt's blocks anchor the places after them too.
    queue.held(T, [1, 2, 3])
    assert queue.surviving(T, turn, 5, room=2, held={1, 2, 3}) == 5
    assert queue.surviving(T, turn, 5, room=1, held={1, 2, 3}) == 4
    # The next turn sent: the answer's blocks leave the queue with the prompt's.
    queue.held(T, turn)
    assert len(queue) == 0
    queue.freed(T, turn, unkeyed=1, last=42)
    assert queue.surviving(T, [*turn, 50], 7, room=7, held=NOTHING) == 7
    assert queue.surviving(T, [*turn, 50], 7, room=6, held=NOTHING) == 6


def test_blocks_held_by_requests_in_flight_survive_anything() -> None:
    queue = FreeQueue()
    queue.freed(T, [1, 2, 3, 4])
    assert queue.surviving(T, [1, 2, 3, 4], 4, room=0, held={1, 2}) == 2
    assert queue.surviving(T, [1, 2, 3, 4], 4, room=0, held={1, 2, 3, 4}) == 4
    assert queue.surviving(T, [1, 2, 3, 4], 4, room=0, held={2}) == 0  # a prefix, not a set


def test_a_held_block_leaves_the_queue_and_comes_back_newest() -> None:
    queue = FreeQueue()
    queue.freed(T, [1, 2])  # queue: 2 1
    queue.freed(T, [5, 6])  # queue: 2 1 6 5
    assert queue.surviving(T, [1, 2], 2, room=2, held=NOTHING) == 0
    queue.held(T, [1, 2])  # a request hits them: out of the queue (queue: 6 5)
    queue.freed(T, [1, 2])  # it ends (queue: 6 5 2 1)
    assert queue.surviving(T, [1, 2], 2, room=2, held=NOTHING) == 2
    assert queue.surviving(T, [5, 6], 2, room=2, held=NOTHING) == 0


def test_blocks_it_never_saw_freed_are_the_oldest() -> None:
    queue = FreeQueue()
    unknown = [7, 8]
    assert queue.surviving(T, unknown, 2, room=1, held=NOTHING) == 2  # no queue known: room
    assert queue.surviving(T, unknown, 2, room=0, held=NOTHING) == 0
    queue.freed(T, [1, 2, 3])
    assert queue.surviving(T, unknown, 2, room=4, held=NOTHING) == 2  # room past the queue
    assert queue.surviving(T, unknown, 2, room=3, held=NOTHING) == 0  # the queue fills it
    assert queue.surviving(T, [1, 2, 3, 7], 4, room=3, held=NOTHING) == 3


def test_the_queue_keeps_no_more_than_the_cache() -> None:
    queue = FreeQueue(limit=6)
    queue.freed(T, list(range(10)), capacity=4)
    assert len(queue) == 4  # blocks 3 2 1 0: the newest four
    assert queue.surviving(T, [0, 1, 2, 3], 4, room=4, held=NOTHING) == 4
    queue.freed(T, list(range(20, 30)))
    assert len(queue) == 6  # the queue's own limit
    queue.freed(("e1", 0), [1])
    queue.forget("e0")
    assert len(queue) == 1
    with pytest.raises(ValueError, match="limit"):
        FreeQueue(limit=0)


def test_in_flight_requests_pin_their_blocks_and_leave_the_rest_room() -> None:
    book = LoadBook()
    capacity = {T: 10}
    inflight = InFlight(book, clock=lambda: 0.0, capacity=capacity)
    history = [1, 2, 3, 4, 5, 6]
    ticket = inflight.sent(T, 6, 6, history)
    inflight.first_byte(ticket)
    # Held by a request in flight: found whatever the room.
    assert inflight.surviving(T, history, 6) == 6
    inflight.ended(ticket, unkeyed=1)  # queue: [answer] 6 5 4 3 2 1
    assert inflight.surviving(T, history, 6) == 6  # nothing in flight: room for all
    other = inflight.sent(T, 8, 8, [21, 22, 23, 24, 25, 26, 27, 28])
    # 8 blocks pinned and one partial block: room for 1 of the queue, the history's first.
    assert inflight.surviving(T, history, 6) == 1
    inflight.first_byte(other)
    inflight.ended(other, unkeyed=1)
    # Its prefill took the room: of the history only the first block is still there.
    assert inflight.surviving(T, history, 6) == 1
    # Its capacity unknown: every matched block counts, and no queue grows.
    last = inflight.sent(T, 8, 8, [31, 32, 33, 34, 35, 36, 37, 38])
    del capacity[T]
    assert inflight.surviving(T, history, 6) == 6
    size = len(inflight.queue)
    inflight.ended(last, unkeyed=1)
    assert len(inflight.queue) == size


def test_a_key_another_request_still_holds_is_not_freed() -> None:
    book = LoadBook()
    inflight = InFlight(book, clock=lambda: 0.0, capacity={T: 4})
    shared = [1, 2]
    first = inflight.sent(T, 3, 3, [*shared, 3])
    second = inflight.sent(T, 3, 1, [*shared, 4])
    # Nothing freed there yet, and no room: what requests in flight hold is found all the same.
    assert inflight.surviving(T, [*shared, 3], 3) == 3
    inflight.first_byte(first)
    inflight.ended(first, unkeyed=0)  # 3 joins the queue; 1 and 2 stay held by the second
    filler = inflight.sent(T, 1, 1, [9])
    # 4 blocks: 1, 2, 4 and 9 pinned, no room: 3 is gone, 1 and 2 are held.
    assert inflight.surviving(T, [*shared, 3], 3) == 2
    inflight.ended(second, unkeyed=0)
    inflight.ended(filler, unkeyed=0)
    inflight.forget("e0")
    assert inflight.surviving(T, [*shared, 3], 3) == 3  # forgotten: nothing known, room


def test_an_ended_request_frees_the_blocks_its_usage_says_it_computed() -> None:
    """Past its prompt's full blocks: the partial one and the answer's, less the answer's last
    token (never run); one block when the usage did not say, none when no answer began."""
    ticket = Ticket(T, request_blocks=6, new_blocks=6, sent_at=0.0)

    def outcome(prompt: int | None, completion: int | None, began: bool = True) -> Outcome:
        return Outcome(200, "ok", prompt, 0, 0.1 if began else None, 0.2, completion)

    assert _unkeyed(ticket, outcome(100, 32), 16) == 3  # 131 tokens run: 9 blocks, 6 keyed
    assert _unkeyed(ticket, outcome(100, 29), 16) == 2  # 128: 8 blocks
    assert _unkeyed(ticket, outcome(96, 1), 16) == 0  # the answer's one token never ran
    assert _unkeyed(ticket, outcome(100, None), 16) == 1
    assert _unkeyed(ticket, outcome(None, 5), 16) == 1
    assert _unkeyed(ticket, outcome(100, 32, began=False), 16) == 0


def test_a_request_that_got_no_answer_frees_only_what_was_cached_before_it() -> None:
    """An attempt that failed before its first byte (refused, its engine unreachable) may
    have computed nothing: of its prompt's blocks only the ones matched when it was sent go
    back to the queue; the new ones are not there to find."""
    inflight = InFlight(LoadBook(), clock=lambda: 0.0, capacity={T: 100})
    prompt = [1, 2, 3, 4, 5]
    failed = inflight.sent(T, 5, 3, prompt)  # 1 and 2 were cached there
    inflight.ended(failed, unkeyed=0)
    assert len(inflight.queue) == 2
    assert inflight.queue.surviving(T, prompt, 5, room=2, held=frozenset()) == 2
    answered = inflight.sent(T, 5, 3, prompt)
    inflight.first_byte(answered)
    inflight.ended(answered, unkeyed=1)
    assert len(inflight.queue) == 6  # all five, and the place of its answer's block
