"""Rate-limited log lines: a full queue can drop thousands of batches a second."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitedWarning"]


class RateLimitedWarning:
    """Log a warning per key at most once per ``interval`` seconds, saying how many were held.

    ``level`` is the logging level of the lines (a warning unless told otherwise).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        level: int = logging.WARNING,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval = interval
        self._clock = clock
        self._state: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, message: str, *args: object) -> None:
        now = self._clock()
        last, held = self._state.get(key, (float("-inf"), 0))
        if now - last < self._interval:
            self._state[key] = (last, held + 1)
            return
        self._state[key] = (now, 0)
        if held:
            message += " (%d similar warnings held back)"
            args = (*args, held)
        self._logger.log(self._level, message, *args)
