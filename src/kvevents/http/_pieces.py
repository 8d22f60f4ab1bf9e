"""Bytes a connection has read and not parsed yet, handed to the parser a piece at a time.

The parser takes whatever it is given, and one read can hold thousands of small pipelined
requests: parsed all at once, 122 KB of pipelined queries were all answered in one callback
(+220 MB, every other connection stalled 7 s). :class:`Unparsed` holds what was read and hands
out one piece at a time, so that the protocol can stop between pieces.
"""

from __future__ import annotations

__all__ = ["PARSE_PIECE", "Unparsed"]

#: Bytes handed to the parser at a time. One read can hold thousands of small pipelined
#: requests, and the parser takes all it is given: each piece is parsed whole, so a
#: connection has at most this many bytes of requests parsed ahead of its answers. 64 KiB
#: takes an 8k-token query (about 49 KB) in one piece (splitting it cost 2-3 us a query);
#: of the smallest requests the app answers it is about 2,000, or 5 MB of uvicorn's state.
PARSE_PIECE = 64 << 10


class Unparsed:
    """Bytes read and not parsed yet, handed to the parser a piece at a time."""

    __slots__ = ("_data", "_start")

    def __init__(self) -> None:
        self._data = b""
        self._start = 0

    def __bool__(self) -> bool:
        return self._start < len(self._data)

    def __len__(self) -> int:
        return len(self._data) - self._start

    def add(self, data: bytes) -> None:
        # Reading is held while bytes wait here, so data rarely lands on top of others.
        start = self._start
        self._data = self._data[start:] + data if start < len(self._data) else data
        self._start = 0

    def clear(self) -> None:
        self._data = b""
        self._start = 0

    def take(self, body_left: int, between_requests: bool) -> bytes | memoryview:
        """The next piece: at most :data:`PARSE_PIECE` bytes past the ``body_left`` bytes of
        the current request's declared body (bounded by the body limit, and a body parsed in
        pieces costs a copy to join them). Between requests, a request's head comes alone
        when the rest does not fit: its declared length then sizes the next piece."""
        data, start = self._data, self._start
        end = len(data)
        size = PARSE_PIECE + body_left
        if end - start > size and between_requests:
            head = data.find(b"\r\n\r\n", start, start + PARSE_PIECE)
            if head >= 0:
                size = head + 4 - start
        if start == 0 and end <= size:
            self._data = b""
            return data
        stop = start + size if start + size < end else end
        self._start = stop
        return memoryview(data)[start:stop]
