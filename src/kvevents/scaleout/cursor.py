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
  window, or a restart nobody announced once the old incarnation's numbers are forgotten;
- a batch past the last sequence + 1 opens a gap (the batches between never came: the
  replica applies it and degrades the stream); a batch that then comes *inside* a gap wider
  than ``window`` is the stream going on below a sequence that jumped ahead (a forged
  ``Kv-Seq`` or ``Kv-End``: no relay reorders more than its window): the stream is rewound,
  reset and rebuilt from that batch, rather than frozen for ever behind the jump.

The verdict (:meth:`StreamCursor.judge`) does not move the cursor; :meth:`StreamCursor.accept`
does, once the batch was applied: a payload the decoder refuses never moves it.

A ``reset`` record is applied once per incarnation (its first batch's seq and digest name it);
a ``loss`` record counts only if it covers batches this replica has not applied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal, TypeAlias

import msgspec

__all__ = ["BatchVerdict", "CursorState", "StreamCursor"]

#: What to do with a batch: apply it, apply it after a gap, drop a copy, reset the stream
#: first (an engine restart, or a rewind below a sequence that jumped ahead), or drop it as
#: stale.
BatchVerdict: TypeAlias = Literal["apply", "gap", "duplicate", "restart", "rewind", "stale"]

#: The verdicts whose batch is applied (and then accepted).
APPLIED: frozenset[str] = frozenset({"apply", "gap", "restart", "rewind"})

#: Batches remembered per stream to tell a late copy from an engine restart.
DEFAULT_WINDOW = 4096


class CursorState(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A cursor as saved in a snapshot (fields at their defaults are left out, so a replica
    of the version before reads a cursor without a gap)."""

    worker_id: str
    rank: int
    last_seq: int
    incarnation: str
    recent: list[tuple[int, str]]
    degraded: str | None = None
    retired: list[str] = []
    gap: tuple[int, int] | None = None


class StreamCursor:
    """The cursor of one stream (one thread at a time: the replica's)."""

    __slots__ = ("degraded", "gap", "incarnation", "last_seq", "recent", "retired", "window")

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
        #: The sequences the last jump ahead skipped, ``(first, end)``; None: no jump.
        self.gap: tuple[int, int] | None = None

    def judge(self, seq: int, digest: str) -> BatchVerdict:
        """The verdict on batch ``seq``; the cursor does not move (see :meth:`accept`)."""
        if seq > self.last_seq:
            return "gap" if self.last_seq >= 0 and seq > self.last_seq + 1 else "apply"
        known = self.recent.get(seq)
        if known == digest:
            return "duplicate"
        if known is None or digest in self.retired:
            if self._below_jump(seq):
                return "rewind"
            # Never seen, or forgotten: a late copy of a batch, or an engine restart that
            # came too late to tell. Applying it out of order would be wrong either way.
            return "stale"
        return "restart"

    def accept(self, seq: int, digest: str, verdict: BatchVerdict) -> None:
        """Note batch ``seq`` as applied under ``verdict`` (one of :data:`APPLIED`)."""
        if verdict == "restart":
            self._restart(f"{seq}/{digest}")
        elif verdict == "rewind":
            self._restart(f"rewind/{seq}/{digest}")
        elif verdict == "gap":
            self.gap = (self.last_seq + 1, seq)
        self._note(seq, digest)

    def batch(self, seq: int, digest: str) -> BatchVerdict:
        """:meth:`judge`, then :meth:`accept` when the verdict applies the batch."""
        verdict = self.judge(seq, digest)
        if verdict in APPLIED:
            self.accept(seq, digest, verdict)
        return verdict

    def _below_jump(self, seq: int) -> bool:
        """True for a batch inside a gap wider than the window: the stream going on below
        a sequence that jumped ahead (a relay reorders at most its window of messages)."""
        gap = self.gap
        return gap is not None and gap[0] <= seq < gap[1] and gap[1] - gap[0] > self.window

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
        self.gap = (self.last_seq + 1, end)
        self.last_seq = end - 1
        return True

    def _restart(self, marker: str) -> None:
        self.incarnation = marker
        self.last_seq = -1
        self.retired = frozenset(self.recent.values())
        self.recent.clear()
        self.degraded = None
        self.gap = None

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
            gap=self.gap,
        )

    @classmethod
    def restored(cls, state: CursorState, window: int = DEFAULT_WINDOW) -> StreamCursor:
        cursor = cls(window)
        cursor.last_seq = state.last_seq
        cursor.incarnation = state.incarnation
        cursor.recent = OrderedDict(state.recent[-window:])
        cursor.degraded = state.degraded
        cursor.retired = frozenset(state.retired)
        cursor.gap = state.gap
        return cursor
