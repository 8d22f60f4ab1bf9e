"""Streamed answers: the ``usage`` in an engine's server-sent events, read as they pass.

vLLM writes each SSE event (``data: {...}\\n\\n``) as one HTTP chunk, and the proxy passes each
chunk on as it comes (:mod:`kvevents.route._client`), so an event is usually whole in one
piece; one split over pieces is joined here before it is read.
"""

from __future__ import annotations

import re

from kvevents.route._usage import Usage, usage_of

__all__ = ["Events", "SseUsage", "event_data"]

#: The most bytes of an unfinished SSE event kept (a longer event is passed through but not
#: read).
EVENT_LIMIT = 1 << 20
_EVENT_END = re.compile(rb"\r?\n\r?\n")


def event_data(event: bytes) -> bytes:
    """The data of one SSE event: its ``data:`` lines joined."""
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)


class Events:
    """Whole SSE events out of pieces fed as they come; ``overflow``: an event longer than
    :data:`EVENT_LIMIT` came (dropped)."""

    def __init__(self) -> None:
        self._carry = b""  # the start of an event not finished yet
        self.overflow = False

    @property
    def pending(self) -> bool:
        """Whether the start of an unfinished event is held."""
        return bool(self._carry)

    def feed(self, piece: bytes) -> list[bytes]:
        """The events ``piece`` completes (without their blank lines)."""
        data = self._carry + piece if self._carry else piece
        cut = _end_of_last_event(data)
        self._carry = data[cut:]
        if len(self._carry) > EVENT_LIMIT:
            self._carry, self.overflow = b"", True
        return split_events(data[:cut])

    def rest(self) -> bytes:
        """The unfinished event held, given up."""
        rest, self._carry = self._carry, b""
        return rest


def split_events(complete: bytes) -> list[bytes]:
    """The events of ``complete`` (whole events, each ended by a blank line)."""
    return [event for event in _EVENT_END.split(complete) if event]


class SseUsage:
    """The ``usage`` of the last event carrying one, in an SSE body fed piece by piece;
    ``done``: whether ``data: [DONE]`` was seen."""

    def __init__(self) -> None:
        self._events = Events()
        self._usage: Usage | None = None
        self.done = False

    def feed(self, piece: bytes) -> None:
        if not self._events.pending and piece.endswith(b"\n\n"):  # whole events: the usual case
            if b'"usage"' in piece or b"[DONE]" in piece:
                self._read_events(split_events(piece))
            return
        self._read_events(self._events.feed(piece))

    def _read_events(self, events: list[bytes]) -> None:
        for event in events:
            if b'"usage"' in event or b"[DONE]" in event:
                self._read_event(event)

    def _read_event(self, event: bytes) -> None:
        data = event_data(event)
        if data == b"[DONE]":
            self.done = True
        elif b'"usage"' in data:
            usage = usage_of(data)
            if usage is not None:
                self._usage = usage

    def result(self) -> Usage | None:
        return self._usage


def _end_of_last_event(data: bytes) -> int:
    """The index just past the blank line that ends the last complete event (0: none)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
