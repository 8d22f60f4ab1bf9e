"""Commands other threads send the subscriber's I/O thread, the answer to an add, the mailbox."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
from dataclasses import dataclass
from typing import TypeAlias

import zmq

from kvevents.subscribe._streams import StreamSpec

__all__ = ["AddFailed", "AddRequest", "Command", "Mailbox", "RemoveStreams", "Stop"]

_names = itertools.count()


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


class Mailbox:
    """Commands from any thread to the I/O thread, and the PAIR that wakes it for them.

    Callers :meth:`send` (or just :meth:`wake`); the I/O thread polls the socket from
    :meth:`open_inbox` and takes what arrived with :meth:`take`.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._endpoint = f"inproc://kvevents-subscriber-{os.getpid()}-{next(_names)}"
        self._lock = threading.Lock()  # one waker socket for every calling thread
        self._waker = context.socket(zmq.PAIR)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.bind(self._endpoint)

    def send(self, command: Command) -> None:
        """Queue ``command`` and wake the I/O thread."""
        self._commands.put(command)
        self.wake()

    def wake(self) -> None:
        """Make the I/O thread run a turn now."""
        # Again: wake-ups are pending already, or the thread is gone (health says which).
        with self._lock, contextlib.suppress(zmq.Again):
            if not self._waker.closed:
                self._waker.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Close the callers' side (once the I/O thread has stopped)."""
        with self._lock:
            self._waker.close(linger=0)

    def open_inbox(self, context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        """The I/O thread's side: readable when commands or wake-ups wait."""
        inbox = context.socket(zmq.PAIR)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.connect(self._endpoint)
        return inbox

    def take(self, inbox: zmq.Socket[bytes]) -> list[Command]:
        """Clear the wake-ups and return the commands waiting, in order."""
        while True:
            try:
                inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        commands: list[Command] = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands
