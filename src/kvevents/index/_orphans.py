"""Stores whose parent is not known yet, held until it arrives (bounded, oldest dropped first).

A store names its parent by the engine's hash; our hash of its blocks chains from our hash of
that parent, so a store whose parent the index has not seen cannot be keyed. It is held here,
under its parent's engine hash, and placed exactly once when that parent is stored (never
re-rooted at token 0). It is held with what its keys are made of
(:class:`~kvevents.index._tokens.StoreKeys`), read once when it arrived. A removal of a held
block is remembered on the orphan, so the block is not placed but still chains its held
children.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvevents.index._records import Stored
from kvevents.index._tokens import StoreKeys

__all__ = ["Orphan", "OrphanPen"]


class Orphan:
    """One held store: the event, its keys but the parent's, and its blocks removed while
    held."""

    __slots__ = ("alive", "event", "keys", "removed")

    def __init__(self, event: Stored, keys: StoreKeys) -> None:
        self.event = event
        self.keys = keys
        self.removed: set[int] = set()
        self.alive = True


class OrphanPen:
    """The orphans of one stream, by parent engine hash and by their own engine hashes."""

    __slots__ = ("blocks", "held", "queue", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[int, list[Orphan]] = {}  # parent engine hash -> its orphans
        self.blocks: dict[int, Orphan] = {}  # engine hash of a held block -> its orphan
        self.queue: deque[Orphan] = deque()  # oldest first; dead entries are skipped
        self.held = 0  # blocks held

    def hold(self, event: Stored, keys: StoreKeys, limit: int) -> int:
        """Hold a store whose parent is unknown; returns the blocks dropped to stay in ``limit``."""
        assert event.parent_block_hash is not None
        orphan = Orphan(event, keys)
        self.waiting.setdefault(event.parent_block_hash, []).append(orphan)
        for eh in event.block_hashes:
            self.blocks[eh] = orphan
        self.queue.append(orphan)
        self.held += len(event.block_hashes)
        dropped = 0
        while self.held > limit:
            dropped += self._drop_oldest()
        return dropped

    def claim_removal(self, engine_hash: int) -> bool:
        """Whether a removal is of a held block (first removal only): then it is remembered."""
        orphan = self.blocks.get(engine_hash)
        if orphan is None or engine_hash in orphan.removed:
            return False
        orphan.removed.add(engine_hash)
        return True

    def release(self, parents: Iterable[int]) -> list[Orphan]:
        """The live orphans waiting for these parent engine hashes, no longer held."""
        out = []
        for eh in parents:
            for orphan in self.waiting.pop(eh, ()):
                if orphan.alive:
                    self._forget(orphan)
                    out.append(orphan)
        return out

    def clear(self) -> int:
        """Drop every orphan; returns the blocks dropped."""
        dropped = self.held
        self.waiting = {}
        self.blocks = {}
        self.queue = deque()
        self.held = 0
        return dropped

    def _drop_oldest(self) -> int:
        orphan = self.queue.popleft()
        if not orphan.alive:
            return 0
        self._forget(orphan)
        parent = orphan.event.parent_block_hash
        siblings = self.waiting.get(parent) if parent is not None else None
        if parent is not None and siblings is not None:
            siblings.remove(orphan)
            if not siblings:
                del self.waiting[parent]
        return len(orphan.event.block_hashes)

    def _forget(self, orphan: Orphan) -> None:
        orphan.alive = False
        self.held -= len(orphan.event.block_hashes)
        for eh in orphan.event.block_hashes:
            if self.blocks.get(eh) is orphan:
                del self.blocks[eh]
        # Placed orphans stay in the queue until it is compacted: keep it proportional.
        if len(self.queue) > 2 * len(self.blocks) + 64:
            self.queue = deque(o for o in self.queue if o.alive)
