"""The decoder's records: its limits, what it reports of a batch, and what a consumer reports.

Pure records; :mod:`kvevents.wire._decode` and :mod:`kvevents.wire._generic` fill them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvevents.events import KVEventBatch

__all__ = [
    "DEFAULT_LIMITS",
    "Applied",
    "DecodeLimits",
    "DecodedBatch",
    "Skip",
    "SkippedEvent",
    "tail",
    "too_many_tokens",
]


@dataclass(frozen=True)
class DecodeLimits:
    """What one payload may cost the decoder (``SubscriberOptions`` sets them).

    ``max_events``: events read per batch; the ones after are skipped and counted (one
    :class:`SkippedEvent` covers them). ``max_tokens``: tokens per ``BlockStored``; an event
    with more is skipped. ``max_extra_bytes``: encoded size of one event's ``extra_keys``
    read by the generic path (the one field of free-form content); an event with more is
    skipped.
    """

    max_events: int = 65_536
    max_tokens: int = 1 << 20
    max_extra_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if min(self.max_events, self.max_tokens, self.max_extra_bytes) < 1:
            raise ValueError("max_events, max_tokens and max_extra_bytes must be >= 1")


#: The limits used when none are given: fit for batches of many 8k-token prefills.
DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True, slots=True)
class SkippedEvent:
    """An event the decoder could not read: where it was and why. ``count`` is how many
    consecutive events from ``index`` on it stands for (more than 1 only for the events past
    ``DecodeLimits.max_events``, reported as one)."""

    index: int
    path: str
    reason: str
    count: int = 1


# A msgspec struct rather than a frozen dataclass: one is made per batch received.
class DecodedBatch(msgspec.Struct, frozen=True, gc=False):
    """A decoded batch plus the events that had to be skipped to read it."""

    batch: KVEventBatch
    skipped: tuple[SkippedEvent, ...] = ()

    @property
    def skipped_count(self) -> int:
        """How many events were skipped (``len(skipped)`` undercounts a cut batch)."""
        return sum(s.count for s in self.skipped)


class Applied(msgspec.Struct, frozen=True, gc=False):
    """What a sink (:class:`kvevents.subscribe.Sink`) reports of a batch it applied: the
    batch's ``ts``, its number of events, events skipped as unreadable, and whether it holds
    an ``AllBlocksCleared`` (the stream's view is whole again after one)."""

    ts: float
    events: int
    skipped: int = 0
    clears: bool = False


class Skip(Exception):
    """Raised inside the decoder: the event at ``path`` cannot be read, ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path = path
        self.reason = reason


def too_many_tokens(count: int, limits: DecodeLimits) -> str:
    return f"token_ids has {count} tokens, over the limit of {limits.max_tokens} per event"


def tail(count: int, limits: DecodeLimits) -> list[SkippedEvent]:
    """The one record standing for the events past ``max_events`` (none if there are none)."""
    over = count - limits.max_events
    if over <= 0:
        return []
    first = limits.max_events
    reason = f"over the limit of {first} events per batch"
    return [SkippedEvent(first, f"$[1][{first}:]", reason, over)]
