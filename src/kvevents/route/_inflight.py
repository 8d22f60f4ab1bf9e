"""What the front door has in flight on each target: its own view of load. Pure: no sockets.

Every request is sent by the front door, so it knows each target's load better than any
report could: requests in flight, the prefill still to compute there (the blocks it did not
expect cached, until the first byte comes back), the blocks held by requests past their
first token, the distinct blocks its requests in flight pin (the keys of their prompts'
blocks, a prefix they share counted once: what the engine cannot evict while they run), and
the distinct blocks of the requests sent to it within the last minute or so, ended or not (its
recent footprint, :class:`~kvevents.index.RecentBlocks`: how much different prefix its cache
is asked to keep). :class:`InFlight` keeps these in the router's :class:`LoadBook`, where every
policy reads them, and each target's free block queue (:class:`~._freequeue.FreeQueue`: the
blocks its ended requests freed, in the order the engine evicts them), from which
:meth:`InFlight.surviving` tells how many of a request's matched blocks its prefill will find.
Not thread-safe: the front door calls it on its event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import monotonic

from kvevents.events import StreamKey
from kvevents.index import DEFAULT_RECENT_WINDOW, LoadBook, RecentBlocks
from kvevents.route._freequeue import FreeQueue
from kvevents.route._keycounts import KeyCounts

__all__ = ["InFlight", "InFlightStats", "Ticket"]


@dataclass(eq=False)
class Ticket:
    """One request on one target, from when it is sent to when its answer ends."""

    target: StreamKey
    request_blocks: int  #: the prompt's full blocks
    new_blocks: int  #: of those, the blocks the target was not expected to hold
    sent_at: float
    keys: Sequence[int] = field(default=(), repr=False)  #: its blocks' keys there, if known
    epoch: int = field(default=0, repr=False)  #: its target's, when sent (see forget)
    first_byte_at: float | None = None
    done: bool = field(default=False, repr=False)


@dataclass(frozen=True)
class InFlightStats:
    """Requests sent, answered (their first byte) and ended, over every target."""

    sent: int = 0
    first_bytes: int = 0
    ended: int = 0


class InFlight:
    """Loads in ``book``, moved by each request's :meth:`sent`, :meth:`first_byte` and
    :meth:`ended`; the clock (monotonic seconds by default) stamps tickets. ``capacity``:
    each target's cache in blocks, where known (the router's, kept current by the planner):
    without it a target's matched blocks all survive (:meth:`surviving`)."""

    def __init__(
        self,
        book: LoadBook,
        clock: Callable[[], float] = monotonic,
        recent_window: float = DEFAULT_RECENT_WINDOW,
        capacity: Mapping[StreamKey, int] | None = None,
    ) -> None:
        self.book = book
        self._clock = clock
        self._sent = self._first_bytes = self._ended = 0
        self._pins = KeyCounts()  # per target, the keys its requests in flight pin
        self._epochs: dict[StreamKey, int] = {}  # target -> times forgotten
        self.recent = RecentBlocks(recent_window, clock)
        self.capacity: Mapping[StreamKey, int] = capacity if capacity is not None else {}
        self.queue = FreeQueue()

    def sent(
        self, target: StreamKey, request_blocks: int, new_blocks: int, keys: Sequence[int] = ()
    ) -> Ticket:
        """Count a request sent: one more in flight, its new blocks queued for prefill, the
        blocks of ``keys`` (its prompt's, as the target keys them) pinned there."""
        new = max(0, min(new_blocks, request_blocks))
        self.book.add(*target, queued_blocks=new, requests=1)
        if keys:
            self.book.set(*target, pinned_blocks=self._pins.add(target, keys))
            self.queue.held(target, keys)
            self.recent.touch(target, keys)
            self._publish_recent()
        self._sent += 1
        return Ticket(target, request_blocks, new, self._clock(), keys, self._epochs.get(target, 0))

    def refresh(self) -> None:
        """Footprints as of now: what was sent longer than the window ago leaves them (a
        decision after a quiet spell must not see the traffic before it)."""
        if self.recent.expire():
            self._publish_recent()

    def _publish_recent(self) -> None:
        for target, size in self.recent.sizes().items():
            self.book.set(*target, recent_blocks=size)

    def adds(self, target: StreamKey, keys: Sequence[int]) -> int:
        """How many of ``keys`` no request in flight on ``target`` pins yet."""
        return self._pins.missing(target, keys)

    def surviving(self, target: StreamKey, keys: Sequence[int], matched: int) -> int:
        """How many of the first ``matched`` of ``keys`` (cached on ``target`` now) a request
        sent there now finds at its prefill: the ones its requests in flight hold, and the
        ones the blocks they will still allocate leave in its free queue. The room they
        leave: the cache, less the blocks those requests pin and one more each (the partial
        last block of a prompt, which has no key). ``matched`` itself where the target's
        capacity is not known."""
        capacity = self.capacity.get(target)
        if capacity is None or matched <= 0:
            return max(0, matched)
        load = self.book.get(*target)
        room = capacity - load.pinned_blocks - load.requests
        return self.queue.surviving(target, keys, matched, room, self._pins.held(target))

    def first_byte(self, ticket: Ticket) -> None:
        """Its prefill is done: its blocks move from queued to active (idempotent)."""
        if ticket.first_byte_at is not None or ticket.done:
            return
        ticket.first_byte_at = self._clock()
        self.book.add(
            *ticket.target, queued_blocks=-ticket.new_blocks, active_blocks=ticket.request_blocks
        )
        self._first_bytes += 1

    def ended(self, ticket: Ticket, unkeyed: int = 1) -> None:
        """Its answer ended (or failed): it leaves the target's load (idempotent), and the
        blocks it held that no other request in flight holds join the target's free queue:
        ``unkeyed`` blocks without a key (its answer's, its prompt's partial last block),
        then its prompt's (only those the target was expected to hold already when no answer
        began: a request refused or lost before its prefill computed nothing)."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.first_byte_at is None:
            self.book.add(*ticket.target, queued_blocks=-ticket.new_blocks, requests=-1)
        else:
            self.book.add(*ticket.target, active_blocks=-ticket.request_blocks, requests=-1)
        self._unpin(ticket, unkeyed)
        self._ended += 1

    def _unpin(self, ticket: Ticket, unkeyed: int) -> None:
        if ticket.epoch != self._epochs.get(ticket.target, 0):
            return  # its target was forgotten since it was sent
        target = ticket.target
        if ticket.keys:
            self.book.set(*target, pinned_blocks=self._pins.remove(target, ticket.keys))
        capacity = self.capacity.get(target)
        if capacity is None:
            return  # no forecast without the cache's size: no queue kept either
        keys = ticket.keys
        if ticket.first_byte_at is None:
            # No answer began: the engine may never have computed the prompt, so of its blocks
            # only the ones it was expected to hold already go back.
            keys = keys[: ticket.request_blocks - ticket.new_blocks]
        held = self._pins.held(target)
        freed = [key for key in keys if key not in held]
        last = keys[-1] if keys else None
        self.queue.freed(target, freed, unkeyed, capacity, last)

    def forget(self, worker_id: str, rank: int | None = None) -> None:
        """Drop a target's load (its engine is gone; tickets still open end harmlessly)."""
        self.book.remove(worker_id, rank)
        self.recent.forget(worker_id, rank)
        self.queue.forget(worker_id, rank)
        for target in self._pins.forget(worker_id, rank):
            self._epochs[target] = self._epochs.get(target, 0) + 1

    def stats(self) -> InFlightStats:
        return InFlightStats(self._sent, self._first_bytes, self._ended)
