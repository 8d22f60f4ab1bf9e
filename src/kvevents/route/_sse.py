"""Streamed answers: the ``usage`` in an engine's server-sent events, read as they pass.

vLLM writes each SSE event (``data: {...}\\n\\n``) as one HTTP chunk, and the proxy passes each
chunk on as it comes (:mod:`kvevents.route._client`), so an event is usually whole in one
piece; one split over pieces is joined here before it is read.
"""

from __future__ import annotations

import re

from kvevents.route._usage import Usage, usage_of

__all__ = ["SseUsage"]

#: The most bytes of an unfinished SSE event kept to look for ``usage`` in (an event longer
#: than this is passed through but not read).
_EVENT_LIMIT = 1 << 20
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class SseUsage:
    """The ``usage`` of the last event carrying one, in an SSE body fed piece by piece;
    ``done``: whether ``data: [DONE]`` was seen."""

    def __init__(self) -> None:
        self._carry = b""  # the start of an event not finished yet
        self._usage: Usage | None = None
        self.done = False

    def feed(self, piece: bytes) -> None:
        if not self._carry and piece.endswith(b"\n\n"):  # whole events: the usual case
            if b'"usage"' in piece or b"[DONE]" in piece:
                self._read_events(piece)
            return
        data = self._carry + piece if self._carry else piece
        cut = _end_of_last_event(data)
        complete, rest = data[:cut], data[cut:]
        self._carry = rest if len(rest) <= _EVENT_LIMIT else b""
        if b'"usage"' in complete or b"[DONE]" in complete:
            self._read_events(complete)

    def _read_events(self, complete: bytes) -> None:
        for event in _EVENT_END.split(complete):
            self._read_event(event)

    def _read_event(self, event: bytes) -> None:
        lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
        data = b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)
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
