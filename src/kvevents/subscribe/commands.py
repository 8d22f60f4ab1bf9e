"""Commands other threads send the subscriber's I/O thread, and the answer to an add."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TypeAlias

from kvevents.subscribe.streams import StreamSpec

__all__ = ["AddFailed", "AddRequest", "Command", "RemoveStreams", "Stop"]


class AddFailed(Exception):
    """Raised on the I/O thread when a stream cannot be set up; the message is the reason."""


class AddRequest:
    """One ``add`` command and its answer: the caller waits on it, with a deadline.

    A caller that stops waiting abandons the request under the lock, so the I/O thread
    either answers in time or does not add the stream at all.
    """

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: str | None = None
        self.abandoned = False

    def wait(self, timeout: float) -> str | None:
        """None once the stream is set up, else why it is not (it is then not added)."""
        if not self.done.wait(timeout):
            with self.lock:
                if not self.done.is_set():
                    self.abandoned = True
                    return f"the I/O thread did not answer in {timeout:g}s (stalled or stopped)"
        return self.error


@dataclass(frozen=True)
class RemoveStreams:
    """Stop reading worker ``worker_id``'s rank ``rank`` (every rank when None)."""

    worker_id: str
    rank: int | None


class Stop:
    """Stop the I/O thread."""


Command: TypeAlias = AddRequest | RemoveStreams | Stop
