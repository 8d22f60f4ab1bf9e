"""Property: whatever the live feed does, a full replay source yields 0..n-1 exactly once."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.subscribe._cursor import (
    Action,
    Cursor,
    Deliver,
    Gap,
    ReplayDone,
    Restart,
    Unrecoverable,
)

EXAMPLES = 60 if os.environ.get("CI") else 200


def payload(seq: int) -> bytes:
    return seq.to_bytes(4, "big") * 3


@st.composite
def live_feeds(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    """(n, live order, replay chunk sizes): drops, duplicates and bounded reordering."""
    n = draw(st.integers(1, 60))
    feed: list[int] = []
    for seq in range(n - 1):
        copies = draw(st.sampled_from([0, 1, 1, 1, 2]))
        feed += [seq] * copies
    # Swap neighbours a few places: reordering within a short distance.
    for _ in range(draw(st.integers(0, 5))):
        if len(feed) > 1:
            i = draw(st.integers(0, len(feed) - 2))
            feed[i], feed[i + 1] = feed[i + 1], feed[i]
    feed.append(n - 1)  # the last batch arrives (a heartbeat would reveal a trailing gap)
    chunks = draw(st.lists(st.integers(0, 4), min_size=len(feed), max_size=len(feed)))
    return n, feed, chunks


class Harness:
    """Feeds a cursor and plays the replay source: everything published so far."""

    def __init__(self) -> None:
        self.cursor = Cursor(window=64)
        self.delivered: list[int] = []
        self.published = -1
        self.pending: list[int] = []
        self.bad: list[Action] = []

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Deliver):
                assert action.payload == payload(action.seq)
                self.delivered.append(action.seq)
            elif isinstance(action, Gap):
                self.pending = list(range(action.start, self.published + 1))
            elif isinstance(action, ReplayDone):
                self.pending = []
            elif isinstance(action, (Restart, Unrecoverable)):
                self.bad.append(action)

    def replay(self, count: int) -> None:
        for _ in range(count):
            if not self.pending:
                return
            seq = self.pending.pop(0)
            self.apply(self.cursor.on_replay(seq, payload(seq)))
            if not self.pending and self.cursor.replaying:
                self.apply(self.cursor.on_replay_end(ok=True))

    def live(self, seq: int) -> None:
        self.published = max(self.published, seq)
        self.apply(self.cursor.on_live(seq, payload(seq)))


@settings(max_examples=EXAMPLES, deadline=None)
@given(live_feeds())
def test_any_drop_duplicate_reorder_pattern_delivers_each_batch_once(
    case: tuple[int, list[int], list[int]],
) -> None:
    """Drops, duplicates and reordering with a replay source => 0..n-1, once each, in order."""
    n, feed, chunks = case
    h = Harness()
    for seq, chunk in zip(feed, chunks, strict=True):
        h.live(seq)
        h.replay(chunk)
    for _ in range(4 * n + 4):
        if not h.cursor.replaying:
            break
        h.replay(n + 1)
    assert h.bad == []
    assert h.delivered == list(range(n))
    assert h.cursor.state == "live"
