"""Streamed answers: an engine's body read along its own chunk boundaries, and the ``usage``
in its server-sent events.

vLLM writes each SSE event (``data: {...}\\n\\n``) as one HTTP chunk. :class:`ChunkReader`
hands the proxy one upstream chunk at a time, so each goes to the client as one chunk too:
a client that reads event by event sees the same boundaries as it would from the engine.
Only a chunk larger than ``hold`` bytes is passed on in pieces (bytes unchanged), so the
proxy never holds more than that of a body.
"""

from __future__ import annotations

import re

import aiohttp

from kvevents.route._usage import Usage, usage_of

__all__ = ["ChunkReader", "SseUsage"]

#: The most bytes of an unfinished SSE event kept to look for ``usage`` in (an event longer
#: than this is passed through but not read).
_EVENT_LIMIT = 1 << 20
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class ChunkReader:
    """Pieces of ``content``: whole HTTP chunks when ``chunked``, else as they arrive."""

    def __init__(self, content: aiohttp.StreamReader, chunked: bool, hold: int = 64 << 10):
        self._content = content
        self._chunked = chunked
        self._hold = hold

    async def read(self) -> tuple[bytes, bool]:
        """(the next piece, whether it is the last); the last may be empty."""
        content = self._content
        data, chunk_end = await content.readchunk()
        if chunk_end or not self._chunked or content.at_eof():
            return data, content.at_eof()  # the usual case: a whole chunk, or any piece
        held = [data] if data else []
        size = len(data)
        while size < self._hold:
            data, chunk_end = await content.readchunk()
            if data:
                held.append(data)
                size += len(data)
            if (chunk_end and held) or content.at_eof():
                break
        return (held[0] if len(held) == 1 else b"".join(held)), content.at_eof()


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
