"""A replica's view of one (worker, rank) stream in JetStream: what to apply, what to drop.

Pure, no sockets. JetStream's duplicate window drops a relay's copies for a while (two
minutes by default); a copy written later (a relay restarted an hour after, replaying the
engine's ring) reaches the replicas, and applying a batch twice would double its reference
counts. So each replica keeps, per stream, the last engine sequence applied and the payload
digests of the last ``window`` batches, and decides here:

- a batch past the last sequence is applied;
- a batch at or before it whose digest is remembered for that sequence is a copy: dropped;
- one whose digest differs is a new incarnation of the engine that no relay announced (the
  relay was down when the engine restarted): the stream is reset, then the batch applied;
- one whose sequence is not remembered is dropped as stale (counted): a copy older than the
  window, or a restart nobody announced once the old incarnation's numbers are forgotten.

A ``reset`` record is applied once per incarnation (its first batch's seq and digest name it);
a ``loss`` record counts only if it covers batches this replica has not applied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal, TypeAlias

import msgspec

__all__ = ["BatchVerdict", "CursorState", "StreamCursor"]

#: What to do with a batch: apply it, drop a copy, reset the stream first, or drop it as stale.
BatchVerdict: TypeAlias = Literal["apply", "duplicate", "restart", "stale"]

#: Batches remembered per stream to tell a late copy from an engine restart.
DEFAULT_WINDOW = 4096


class CursorState(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A cursor as saved in a snapshot."""

    worker_id: str
    rank: int
    last_seq: int
    incarnation: str
    recent: list[tuple[int, str]]
    degraded: str | None = None
    retired: list[str] = []


class StreamCursor:
    """The cursor of one stream (one thread at a time: the replica's)."""

    __slots__ = ("degraded", "incarnation", "last_seq", "recent", "retired", "window")

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self.last_seq = -1
        self.incarnation = ""
        self.recent: OrderedDict[int, str] = OrderedDict()
        # The digests of the incarnation before the last restart: a late copy of one of its
        # batches is stale, not yet another restart.
        self.retired: frozenset[str] = frozenset()
        #: Why the stream is degraded (a loss after blocks were applied), None when whole.
        self.degraded: str | None = None

    def batch(self, seq: int, digest: str) -> BatchVerdict:
        """The verdict on batch ``seq``; for ``apply`` and ``restart`` the batch is noted
        as applied (the caller applies it, after a reset for ``restart``)."""
        if seq > self.last_seq:
            self._note(seq, digest)
            return "apply"
        known = self.recent.get(seq)
        if known == digest:
            return "duplicate"
        if known is None or digest in self.retired:
            # Never seen, or forgotten: a late copy of a batch, or an engine restart that
            # came too late to tell. Applying it out of order would be wrong either way.
            return "stale"
        self._restart(f"{seq}/{digest}")
        self._note(seq, digest)
        return "restart"

    def reset(self, seq: int, digest: str) -> bool:
        """A relay saw the engine restart; True when this incarnation is new to the cursor
        (the caller resets the stream), False for a copy of a reset already applied."""
        marker = f"{seq}/{digest}"
        if marker == self.incarnation or self.recent.get(seq) == digest:
            return False
        self._restart(marker)
        return True

    def loss(self, start: int, end: int) -> bool:
        """Batches ``start`` .. ``end - 1`` were lost for good; True when some were not
        applied here (the stream is then missing them)."""
        if end - 1 <= self.last_seq:
            return False
        self.last_seq = end - 1
        return True

    def _restart(self, marker: str) -> None:
        self.incarnation = marker
        self.last_seq = -1
        self.retired = frozenset(self.recent.values())
        self.recent.clear()
        self.degraded = None

    def _note(self, seq: int, digest: str) -> None:
        self.last_seq = seq
        recent = self.recent
        recent[seq] = digest
        while len(recent) > self.window:
            recent.popitem(last=False)

    def state(self, worker_id: str, rank: int) -> CursorState:
        return CursorState(
            worker_id=worker_id,
            rank=rank,
            last_seq=self.last_seq,
            incarnation=self.incarnation,
            recent=list(self.recent.items()),
            degraded=self.degraded,
            retired=sorted(self.retired),
        )

    @classmethod
    def restored(cls, state: CursorState, window: int = DEFAULT_WINDOW) -> StreamCursor:
        cursor = cls(window)
        cursor.last_seq = state.last_seq
        cursor.incarnation = state.incarnation
        cursor.recent = OrderedDict(state.recent[-window:])
        cursor.degraded = state.degraded
        cursor.retired = frozenset(state.retired)
        return cursor
