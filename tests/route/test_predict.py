"""Predicted blocks and the front door's in-flight ledger: what they credit, and for how long."""

from __future__ import annotations

import pytest

from kvevents.index import Load, LoadBook
from kvevents.route._inflight import InFlight
from kvevents.route._predict import Predictions

A = ("a", 0)
B = ("b", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_credit_counts_for_its_target_only_and_from_the_first_key() -> None:
    """Credited keys match on their target as a prefix; another target matches nothing."""
    predictions = Predictions(clock=Clock())
    predictions.credit(A, [1, 2, 3])
    assert predictions.prefix(A, [1, 2, 3, 4]) == 3
    assert predictions.prefix(A, [1, 2]) == 2
    assert predictions.prefix(A, [9, 1, 2]) == 0
    assert predictions.prefix(B, [1, 2, 3]) == 0


def test_a_credit_lasts_grace_seconds_after_its_request_ends() -> None:
    """An answered request's blocks stay predicted for the grace period, then go."""
    clock = Clock()
    predictions = Predictions(grace=2.0, ttl=60.0, clock=clock)
    credit = predictions.credit(A, [1, 2])
    clock.now += 30
    assert predictions.expire() == 0 and predictions.prefix(A, [1, 2]) == 2
    predictions.settle(credit, stored=True)
    clock.now += 1.9
    assert predictions.expire() == 0 and predictions.prefix(A, [1, 2]) == 2
    clock.now += 0.2
    assert predictions.expire() == 1
    assert predictions.prefix(A, [1, 2]) == 0
    assert predictions.stats().keys_held == 0


def test_an_unanswered_request_keeps_its_credit_at_most_ttl_seconds() -> None:
    """A request that never ends does not pin its prediction for ever."""
    clock = Clock()
    predictions = Predictions(ttl=10.0, clock=clock)
    predictions.credit(A, [1])
    clock.now += 10.0
    assert predictions.expire() == 1
    assert predictions.prefix(A, [1]) == 0


def test_a_failed_request_takes_its_credit_back_at_once() -> None:
    """No engine cached what a failed request would have: nothing stays predicted."""
    predictions = Predictions(clock=Clock())
    credit = predictions.credit(A, [1, 2])
    predictions.settle(credit, stored=False)
    assert predictions.prefix(A, [1, 2]) == 0
    assert predictions.stats().withdrawn == 1
    predictions.settle(credit, stored=True)  # a second settle changes nothing
    assert predictions.prefix(A, [1, 2]) == 0


def test_shared_keys_stay_while_any_credit_holds_them() -> None:
    """Two requests sharing a prefix: the prefix is predicted until both credits are gone."""
    clock = Clock()
    predictions = Predictions(grace=1.0, clock=clock)
    first = predictions.credit(A, [1, 2, 3])
    second = predictions.credit(A, [1, 2, 7])
    predictions.settle(first, stored=False)
    assert predictions.prefix(A, [1, 2, 3]) == 2
    assert predictions.prefix(A, [1, 2, 7]) == 3
    predictions.settle(second, stored=False)
    assert predictions.prefix(A, [1, 2, 7]) == 0
    assert predictions.stats().keys_held == 0


def test_forget_drops_a_workers_credits_and_later_settles_are_harmless() -> None:
    """An engine that went away (or cleared its cache) is credited nothing any more."""
    clock = Clock()
    predictions = Predictions(clock=clock)
    credit = predictions.credit(A, [1, 2])
    predictions.credit(B, [1, 2])
    predictions.forget("a")
    assert predictions.prefix(A, [1, 2]) == 0
    assert predictions.prefix(B, [1, 2]) == 2
    predictions.settle(credit, stored=False)
    assert predictions.stats().keys_held == 2


def test_the_keys_held_are_bounded_and_the_soonest_to_expire_go_first() -> None:
    """Past max_keys, the credit that would expire first is dropped to make room."""
    clock = Clock()
    predictions = Predictions(grace=1.0, ttl=100.0, max_keys=4, clock=clock)
    old = predictions.credit(A, [1, 2])
    predictions.settle(old, stored=True)  # expires first
    predictions.credit(B, [3, 4])
    predictions.credit(A, [5, 6])
    assert predictions.stats().keys_held == 4
    assert predictions.prefix(A, [1, 2]) == 0
    assert predictions.prefix(B, [3, 4]) == 2 and predictions.prefix(A, [5, 6]) == 2


def test_bad_bounds_are_refused_naming_them() -> None:
    """A negative grace, a ttl of zero or no room for keys is a clear error."""
    with pytest.raises(ValueError, match="grace must be >= 0"):
        Predictions(grace=-1)
    with pytest.raises(ValueError, match="ttl > 0"):
        Predictions(ttl=0)


def test_in_flight_moves_a_request_from_queued_to_active_to_gone() -> None:
    """Sent: its new blocks are queued; first byte: its blocks are active; ended: gone."""
    book = LoadBook()
    inflight = InFlight(book, clock=Clock())
    ticket = inflight.sent(A, request_blocks=10, new_blocks=4)
    assert book.get(*A) == Load(queued_blocks=4, active_blocks=0, requests=1)
    inflight.first_byte(ticket)
    inflight.first_byte(ticket)
    assert book.get(*A) == Load(queued_blocks=0, active_blocks=10, requests=1)
    inflight.ended(ticket)
    inflight.ended(ticket)
    assert book.get(*A) == Load()
    assert inflight.stats().ended == 1


def test_a_request_that_fails_before_its_first_byte_leaves_no_load_behind() -> None:
    """A connect error ends a ticket that never saw a byte: its queued blocks go too."""
    book = LoadBook()
    inflight = InFlight(book, clock=Clock())
    first = inflight.sent(A, request_blocks=8, new_blocks=8)
    second = inflight.sent(A, request_blocks=8, new_blocks=2)
    inflight.ended(first)
    assert book.get(*A) == Load(queued_blocks=2, active_blocks=0, requests=1)
    inflight.ended(second)
    assert book.get(*A) == Load()


def test_in_flight_pins_each_block_once_however_many_requests_share_it() -> None:
    """Requests sharing a prefix pin its blocks once: pinned_blocks counts distinct keys, a
    block goes when the last request pinning it ends, and adds() counts a request's keys no
    request in flight pins yet."""
    book = LoadBook()
    inflight = InFlight(book, clock=Clock())
    system = [1, 2, 3, 4]
    first = inflight.sent(A, 6, 6, [*system, 10, 11])
    assert book.get(*A).pinned_blocks == 6
    assert inflight.adds(A, [*system, 20, 21, 22]) == 3
    assert inflight.adds(B, [*system, 20]) == 5  # nothing in flight there
    second = inflight.sent(A, 7, 3, [*system, 20, 21, 22])
    assert book.get(*A).pinned_blocks == 9
    inflight.first_byte(first)
    inflight.ended(first)
    assert book.get(*A).pinned_blocks == 7  # the shared prefix stays with the second
    inflight.ended(second)
    inflight.ended(second)
    assert book.get(*A) == Load(recent_blocks=9)  # nothing in flight; the footprint stays


def test_a_targets_footprint_outlives_its_requests_for_the_window() -> None:
    """recent_blocks counts the distinct blocks sent to a target within the window, ended or
    not; refresh() lets them go once the window has passed without requests (a decision after
    a quiet spell), and forget() with the target."""
    book = LoadBook()
    clock = Clock()
    inflight = InFlight(book, clock=clock, recent_window=30.0)
    inflight.ended(inflight.sent(A, 3, 3, [1, 2, 3]))
    inflight.ended(inflight.sent(A, 4, 1, [1, 2, 3, 4]))
    inflight.sent(B, 2, 2, [1, 2])
    assert (book.get(*A).recent_blocks, book.get(*B).recent_blocks) == (4, 2)
    clock.now += 31
    assert book.get(*A).recent_blocks == 4  # as of the last request or refresh
    inflight.refresh()
    assert (book.get(*A).recent_blocks, book.get(*B).recent_blocks) == (0, 0)
    inflight.sent(A, 1, 1, [9])
    inflight.forget("a")
    assert book.get(*A) == Load()


def test_a_forgotten_target_is_not_unpinned_by_its_old_requests() -> None:
    """forget() drops a target's pins; a request sent before it that ends after takes nothing
    from what requests sent since pin."""
    book = LoadBook()
    inflight = InFlight(book, clock=Clock())
    old = inflight.sent(A, 2, 2, [1, 2])
    inflight.forget("a")
    assert book.get(*A) == Load()
    new = inflight.sent(A, 2, 2, [1, 2])
    inflight.ended(old)
    assert book.get(*A).pinned_blocks == 2
    inflight.ended(new)
    assert book.get(*A).pinned_blocks == 0


def test_key_counts_keep_a_key_while_any_holder_holds_it() -> None:
    """KeyCounts: a key held twice stays after one removal; prefix() and missing() read the
    held keys; forget() drops a worker's keys and their references."""
    from kvevents.route._keycounts import KeyCounts

    counts = KeyCounts()
    assert counts.add(A, [1, 2, 3]) == 3
    assert counts.add(A, [1, 2, 9]) == 4
    assert counts.references == 6
    assert counts.remove(A, [1, 2, 3]) == 3  # 1 and 2 still held by the second
    assert counts.prefix(A, [1, 2, 3]) == 2 and counts.missing(A, [1, 3, 4]) == 2
    assert counts.remove(B, [1]) == 0  # an unknown target: nothing changes
    counts.add(B, [5])
    assert counts.forget("a") == [A]
    assert counts.references == 1 and counts.prefix(A, [1]) == 0
