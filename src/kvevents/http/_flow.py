"""When a connection reads: uvicorn's wish (its request in flight wants more of its body, or
not) and the protocol's own hold, together."""

from __future__ import annotations

import asyncio

from kvevents.http._uvicorn import FlowControl

__all__ = ["HeldFlow"]


class HeldFlow(FlowControl):
    """uvicorn's flow control with a second reason to stop reading: the protocol's hold.

    uvicorn resumes reading whenever its request in flight asks for more of its body; the
    protocol holds reading while it has bytes it has not parsed or answers it has not written,
    and reading resumes only when neither wants it stopped. Without the hold, a client's
    pipelined requests would pile up behind the one in flight.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self._reader = transport
        self.held = False  #: whether the protocol holds reading (set by hold())
        self._app_paused = False

    def pause_reading(self) -> None:
        self._app_paused = True
        self._apply()

    def resume_reading(self) -> None:
        self._app_paused = False
        self._apply()

    def hold(self, held: bool) -> None:
        """Stop reading (``held``) or let uvicorn's own wish decide again."""
        self.held = held
        self._apply()

    def _apply(self) -> None:
        paused = self.held or self._app_paused
        if paused != self.read_paused:
            self.read_paused = paused
            if paused:
                self._reader.pause_reading()
            else:
                self._reader.resume_reading()
