"""Socket helpers for deterministic network tests: ephemeral endpoints, deadlines, cleanup."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import TypeVar

from kvevents.deadline import Deadline

__all__ = ["Deadline", "unique_inproc", "unique_ipc", "wait_for"]

_counter = itertools.count()
T = TypeVar("T")


def unique_inproc(prefix: str = "kvevents-test") -> str:
    """An inproc endpoint name no other test in this process uses."""
    return f"inproc://{prefix}-{os.getpid()}-{next(_counter)}"


def unique_ipc(directory: str, prefix: str = "kv") -> str:
    """An ipc endpoint inside ``directory`` (keep paths short: the limit is ~100 bytes)."""
    return f"ipc://{directory}/{prefix}-{next(_counter)}"


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.001,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` after ``timeout``."""
    deadline = Deadline(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if deadline.expired:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
