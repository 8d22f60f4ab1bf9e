"""Each target's recent footprint: the distinct blocks sent to it within a window
(kvevents.index.RecentBlocks)."""

from __future__ import annotations

import pytest

from kvevents.index import RecentBlocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_footprint_counts_each_block_once_per_target() -> None:
    """Keys sent to a target count once however often they are sent; targets apart."""
    recent = RecentBlocks(10.0, Clock())
    assert recent.touch(("a", 0), [1, 2, 3]) == 3
    assert recent.touch(("a", 0), [1, 2, 3, 4]) == 4  # a shared prefix counts once
    assert recent.touch(("b", 0), [1, 2]) == 2
    assert recent.sizes() == {("a", 0): 4, ("b", 0): 2}
    assert recent.size(("c", 0)) == 0


def test_blocks_leave_a_footprint_a_window_after_they_were_last_sent() -> None:
    """A key leaves once it was last sent longer than the window ago; sending it again keeps
    it; expire() says whether anything left, and touch() expires every target."""
    clock = Clock()
    recent = RecentBlocks(10.0, clock)
    recent.touch(("a", 0), [1, 2, 3])
    recent.touch(("b", 0), [7])
    clock.now += 6
    recent.touch(("a", 0), [1])  # 1 is recent again; 2 and 3 are not
    clock.now += 5
    assert recent.expire() is True
    assert recent.sizes() == {("a", 0): 1, ("b", 0): 0}
    assert recent.expire() is False
    recent.touch(("b", 0), [8])
    clock.now += 10.5
    recent.touch(("b", 0), [9])  # a's last key expires with b's touch
    assert recent.sizes() == {("a", 0): 0, ("b", 0): 1}


def test_forget_drops_a_workers_footprint() -> None:
    """An engine gone (its cache with it) has no footprint; other workers keep theirs."""
    recent = RecentBlocks(10.0, Clock())
    recent.touch(("a", 0), [1])
    recent.touch(("a", 1), [2])
    recent.touch(("b", 0), [3])
    assert sorted(recent.forget("a", 1)) == [("a", 1)]
    assert sorted(recent.forget("a")) == [("a", 0)]
    assert recent.sizes() == {("b", 0): 1}


@pytest.mark.parametrize("window", [0.0, -1.0, float("nan")])
def test_the_window_must_be_positive(window: float) -> None:
    with pytest.raises(ValueError, match="window must be > 0 seconds"):
        RecentBlocks(window)
