"""The event recorder: turns an engine's cache mutations into well-formed batches (WIRE.md 7).

The engine reports every mutation (a full block stored, a block removed, the cache cleared)
and calls :meth:`EventRecorder.flush` once per step. The recorder enforces the producer rules
so a consumer that applies the events per ``(rank, medium)`` to a plain set holds exactly what
the engine announced:

- only full blocks (``len(token_ids) == block_size``); a partial block is never announced;
- a block is announced once per medium while it is held; a repeated store is suppressed;
- a removal is sent only for a block announced in that medium;
- fail closed: a store whose parent was never announced (in any medium, since the last clear)
  is suppressed, so a consumer never receives a child it cannot place; its children follow it;
- stores that continue a chain within a step merge into one ``BlockStored``, consecutive
  removals of one medium into one ``BlockRemoved``; the order of stores and removals is kept;
- a clear supersedes the step's earlier events and emits ``AllBlocksCleared``;
- an empty step yields no batch.

"Announced" for the parent rule means announced in any medium at some point since the last
clear, not "still held": an engine may evict a parent before its child (vLLM's LRU can), and
the child moving to another tier is still placeable by a consumer that saw the parent once.
That memory is one int per distinct hash since the last clear.

Everything suppressed is counted in :class:`RecorderStats`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch

__all__ = ["DEFAULT", "EventRecorder", "RecorderStats"]


class _Default(enum.Enum):
    DEFAULT = "default"


#: "Use the recorder's default" for ``medium``/``lora_id``/``lora_name`` (None is a value).
DEFAULT = _Default.DEFAULT


@dataclass(frozen=True)
class RecorderStats:
    """What one recorder announced and suppressed. Every field counts since construction."""

    steps: int = 0
    """flush() calls."""
    batches: int = 0
    """Non-empty batches returned by flush()."""
    blocks_stored: int = 0
    """Blocks announced in ``BlockStored`` events."""
    stored_events: int = 0
    """``BlockStored`` events emitted (after merging chains)."""
    blocks_removed: int = 0
    """Blocks announced in ``BlockRemoved`` events."""
    removed_events: int = 0
    """``BlockRemoved`` events emitted (after merging consecutive removals)."""
    clears: int = 0
    """``AllBlocksCleared`` events emitted."""
    partial_blocks: int = 0
    """Stores suppressed because the block held fewer than ``block_size`` tokens."""
    duplicate_stores: int = 0
    """Stores suppressed because the block was already announced in that medium."""
    orphan_stores: int = 0
    """Stores suppressed because their parent is not announced in any medium (fail closed)."""
    unknown_removals: int = 0
    """Removals suppressed because the block was not announced in that medium."""
    superseded_events: int = 0
    """Pending events of a step dropped because a clear followed them in the same step."""


@dataclass
class _PendingStore:
    medium: str | None
    lora_id: int | None
    lora_name: str | None
    parent: int | None
    hashes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _PendingRemove:
    medium: str | None
    hashes: list[int] = field(default_factory=list)


_Pending = _PendingStore | _PendingRemove | AllBlocksCleared


@dataclasses.dataclass(slots=True)
class RecorderCounts:
    """A recorder's running counters (each documented on :class:`RecorderStats`): mutable fields, so that a counter's name is
    checked by mypy; :meth:`frozen` makes the record."""

    steps: int = 0
    batches: int = 0
    blocks_stored: int = 0
    stored_events: int = 0
    blocks_removed: int = 0
    removed_events: int = 0
    clears: int = 0
    partial_blocks: int = 0
    duplicate_stores: int = 0
    orphan_stores: int = 0
    unknown_removals: int = 0
    superseded_events: int = 0


class EventRecorder:
    """Records one rank's cache mutations and flushes one batch per engine step.

    ``medium`` is the default tier of stores and removals (``"GPU"``); ``lora_id`` and
    ``lora_name`` are the defaults passed through to ``BlockStored``. ``clock`` gives the batch
    ``ts`` when :meth:`flush` is called without one.
    """

    def __init__(
        self,
        block_size: int,
        *,
        rank: int | None = 0,
        medium: str | None = "GPU",
        lora_id: int | None = None,
        lora_name: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.rank = rank
        self.medium = medium
        self.lora_id = lora_id
        self.lora_name = lora_name
        self._clock = clock
        self._held: dict[str | None, set[int]] = {}
        self._pending: list[_Pending] = []
        # the last pending event when it is a store, so chain merging is one identity check
        self._open_store: _PendingStore | None = None
        self._counts = RecorderCounts()

    # ------------------------------------------------------------------ mutations

    def record_stored(
        self,
        block_hash: int,
        parent_hash: int | None,
        token_ids: Sequence[int],
        *,
        medium: str | _Default | None = DEFAULT,
        lora_id: int | _Default | None = DEFAULT,
        lora_name: str | _Default | None = DEFAULT,
    ) -> bool:
        """A full block entered the cache. Returns whether it will be announced."""
        tier = self.medium if medium is DEFAULT else medium
        if len(token_ids) != self.block_size:
            return self._suppress_partial(block_hash, token_ids)
        held = self._held.get(tier)
        if held is None:
            held = self._held[tier] = set()
        elif block_hash in held:
            self._counts.duplicate_stores += 1
            return False
        if parent_hash is not None and parent_hash not in held and not self._holds(parent_hash):
            self._counts.orphan_stores += 1
            return False
        held.add(block_hash)
        lid = self.lora_id if lora_id is DEFAULT else lora_id
        lname = self.lora_name if lora_name is DEFAULT else lora_name
        last = self._open_store
        if (
            last is not None
            and last.hashes[-1] == parent_hash
            and last.medium == tier
            and last.lora_id == lid
            and last.lora_name == lname
        ):
            last.hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self._open_store = _PendingStore(tier, lid, lname, parent_hash, [block_hash])
            self._open_store.token_ids.extend(token_ids)
            self._pending.append(self._open_store)
        return True

    def record_removed(self, block_hash: int, *, medium: str | _Default | None = DEFAULT) -> bool:
        """A block left the cache (tier ``medium``). Returns whether it will be announced."""
        tier = self.medium if medium is DEFAULT else medium
        held = self._held.get(tier)
        if held is None or block_hash not in held:
            self._counts.unknown_removals += 1
            return False
        held.discard(block_hash)
        self._open_store = None
        last = self._pending[-1] if self._pending else None
        if isinstance(last, _PendingRemove) and last.medium == tier:
            last.hashes.append(block_hash)
        else:
            self._pending.append(_PendingRemove(tier, [block_hash]))
        return True

    def record_cleared(self) -> None:
        """The whole cache (every medium) was reset."""
        self._counts.superseded_events += len(self._pending)
        self._pending = [AllBlocksCleared()]
        self._open_store = None
        self._held.clear()

    # ------------------------------------------------------------------ step boundary

    def flush(self, ts: float | None = None) -> KVEventBatch | None:
        """The step's events as one batch (None when nothing changed); starts the next step."""
        self._counts.steps += 1
        if not self._pending:
            return None
        events = [self._finish(item) for item in self._pending]
        self._pending = []
        self._open_store = None
        self._counts.batches += 1
        return KVEventBatch(self._clock() if ts is None else ts, events, self.rank)

    def is_announced(self, block_hash: int, medium: str | _Default | None = DEFAULT) -> bool:
        """Whether ``block_hash`` is announced and not removed in ``medium``."""
        tier = self.medium if medium is DEFAULT else medium
        return block_hash in self._held.get(tier, ())

    def announced(self, medium: str | _Default | None = DEFAULT) -> frozenset[int]:
        """The hashes announced and not removed in ``medium`` (what a consumer holds)."""
        tier = self.medium if medium is DEFAULT else medium
        return frozenset(self._held.get(tier, ()))

    def stats(self) -> RecorderStats:
        """A snapshot of the counters."""
        return RecorderStats(**dataclasses.asdict(self._counts))

    # ------------------------------------------------------------------ internals

    def _holds(self, block_hash: int) -> bool:
        return any(block_hash in held for held in self._held.values())

    def _suppress_partial(self, block_hash: int, token_ids: Sequence[int]) -> bool:
        if len(token_ids) > self.block_size:
            raise ValueError(
                f"block {block_hash} has {len(token_ids)} token ids, more than block_size "
                f"{self.block_size}: pass one block per call"
            )
        self._counts.partial_blocks += 1
        return False

    def _finish(self, item: _Pending) -> Event:
        if isinstance(item, _PendingStore):
            self._counts.stored_events += 1
            self._counts.blocks_stored += len(item.hashes)
            return BlockStored(
                block_hashes=item.hashes,
                parent_block_hash=item.parent,
                token_ids=item.token_ids,
                block_size=self.block_size,
                lora_id=item.lora_id,
                medium=item.medium,
                lora_name=item.lora_name,
            )
        if isinstance(item, _PendingRemove):
            self._counts.removed_events += 1
            self._counts.blocks_removed += len(item.hashes)
            return BlockRemoved(block_hashes=item.hashes, medium=item.medium)
        self._counts.clears += 1
        return item
