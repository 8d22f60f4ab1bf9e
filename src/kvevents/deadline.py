"""A point in monotonic time, for every bounded wait in the library and its tests."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Deadline"]


class Deadline:
    """A point in monotonic time; ``remaining()`` never goes below zero."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.at = clock() + seconds

    def remaining(self) -> float:
        """Seconds left, at least 0."""
        return max(0.0, self.at - self._clock())

    @property
    def expired(self) -> bool:
        """True once the deadline has passed."""
        return self._clock() >= self.at
