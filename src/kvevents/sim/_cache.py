"""The reference prefix cache: a paged KV block cache that reports every mutation.

One :class:`RankCache` per attention-DP rank, :class:`PrefixCache` holds several. A rank has
``capacity_blocks`` physical GPU blocks. Full blocks are cached under their chained hash
(:mod:`kvevents.sim._hashing`) and shared by reference count; a request's partial tail block is
private (counted against capacity, never cached, never announced).

A block computed by a second request while the first copy is cached is shared: the second
request's private block is freed at once. vLLM keeps the second copy too (cached under the same
hash until each copy is evicted, and announcing both), so this cache holds slightly more than
vLLM's when identical blocks are computed concurrently.

Eviction is LRU over unreferenced cached blocks, like vLLM's free-block queue. Requests release
their blocks tail first, so within one request the tail is evicted before its prefix; across
requests too: whoever holds a child holds its parent and releases it later, so a parent is
never older in the LRU than its child. The GPU tier is therefore prefix-closed (a cached
block's parent is cached), every stored block has a held parent, and the recorder's fail-closed
parent rule never fires. (vLLM can evict a parent first; the recorder then suppresses a later
store of the child elsewhere, see :mod:`kvevents.publish._recorder`.)

Optional second tier: with ``cpu_capacity_blocks > 0`` an evicted GPU block moves to a CPU tier
with its own LRU. The events of one eviction round are, in order:
``BlockRemoved(CPU)`` for blocks the CPU tier drops to make room, ``BlockStored(CPU)`` for the
moved blocks (parent first, so chains merge), then ``BlockRemoved(GPU)``. Storing on CPU before
removing from GPU means a consumer never sees a moved block as absent everywhere, which is
also the physical order (the copy completes before the GPU block is reused). A prefix lookup
that finds blocks on CPU loads them back to GPU (``BlockStored(GPU)``); the CPU copy stays.

:meth:`RankCache.cached_blocks` is the ground truth: applying the recorder's events per
``(rank, medium)`` to a plain set reproduces it after every step.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvevents.publish import EventRecorder

__all__ = ["CPU", "GPU", "CacheStats", "PrefixCache", "PrefixHit", "RankCache"]

GPU = "GPU"
CPU = "CPU"


@dataclass(frozen=True)
class CacheStats:
    """Counters of one rank's cache since construction."""

    gpu_hit_blocks: int = 0
    """Prefix blocks found on GPU by :meth:`RankCache.acquire`."""
    cpu_hit_blocks: int = 0
    """Prefix blocks found on CPU and loaded back to GPU by :meth:`RankCache.acquire`."""
    stored_blocks: int = 0
    """Blocks committed that were not cached yet (new GPU entries)."""
    shared_blocks: int = 0
    """Blocks committed that were already cached (computed twice, kept once)."""
    evicted_blocks: int = 0
    """Blocks evicted from GPU."""
    offloaded_blocks: int = 0
    """Evicted blocks newly stored on the CPU tier."""
    cpu_dropped_blocks: int = 0
    """Blocks dropped from the CPU tier by its LRU."""
    failed_allocations: int = 0
    """allocate() calls refused for lack of free or evictable blocks."""
    resets: int = 0
    """Successful resets."""
    refused_resets: int = 0
    """reset() calls refused because blocks were in use."""


@dataclasses.dataclass(slots=True)
class CacheCounts:
    """A rank cache's running counters (each documented on :class:`CacheStats`): mutable fields, so that a counter's name is
    checked by mypy; :meth:`frozen` makes the record."""

    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0
    stored_blocks: int = 0
    shared_blocks: int = 0
    evicted_blocks: int = 0
    offloaded_blocks: int = 0
    cpu_dropped_blocks: int = 0
    failed_allocations: int = 0
    resets: int = 0
    refused_resets: int = 0


@dataclass(frozen=True)
class PrefixHit:
    """What :meth:`RankCache.acquire` found: blocks already on GPU, blocks loaded from CPU."""

    gpu_blocks: int
    cpu_blocks: int

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


class _Block:
    __slots__ = ("lora_id", "lora_name", "parent", "refs", "tokens")

    def __init__(
        self,
        parent: int | None,
        tokens: Sequence[int],
        refs: int,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.refs = refs
        self.lora_id = lora_id
        self.lora_name = lora_name

    def copy(self, refs: int) -> _Block:
        return _Block(self.parent, self.tokens, refs, self.lora_id, self.lora_name)


class RankCache:
    """One rank's block cache. Every mutation goes to ``recorder`` (one is made if not given)."""

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        *,
        cpu_capacity_blocks: int = 0,
        rank: int = 0,
        recorder: EventRecorder | None = None,
    ) -> None:
        if capacity_blocks <= 0 or cpu_capacity_blocks < 0:
            raise ValueError(
                f"rank {rank}: capacity_blocks must be > 0 and cpu_capacity_blocks >= 0, got "
                f"{capacity_blocks} and {cpu_capacity_blocks}"
            )
        self.capacity_blocks = capacity_blocks
        self.cpu_capacity_blocks = cpu_capacity_blocks
        self.block_size = block_size
        self.rank = rank
        self.recorder = recorder or EventRecorder(block_size, rank=rank, medium=GPU)
        if self.recorder.block_size != block_size:
            raise ValueError(
                f"rank {rank}: recorder block_size {self.recorder.block_size} != cache "
                f"block_size {block_size}"
            )
        self._gpu: dict[int, _Block] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cpu: OrderedDict[int, _Block] = OrderedDict()
        self._private = 0
        self._counts = CacheCounts()

    # ------------------------------------------------------------------ views

    @property
    def free_blocks(self) -> int:
        """Physical GPU blocks neither cached nor held privately."""
        return self.capacity_blocks - len(self._gpu) - self._private

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation could get: free ones plus unreferenced cached ones."""
        return self.free_blocks + len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests (shared cached ones and private tails)."""
        return len(self._gpu) - len(self._lru) + self._private

    def cached_count(self, medium: str = GPU) -> int:
        """How many blocks are cached in ``medium`` (without copying the set)."""
        return len(self._gpu) if medium == GPU else len(self._cpu) if medium == CPU else 0

    def cached_blocks(self, medium: str = GPU) -> set[int]:
        """The exact set of block hashes cached in ``medium`` ("GPU" or "CPU")."""
        return set(self._gpu) if medium == GPU else set(self._cpu) if medium == CPU else set()

    def match(self, block_hashes: Sequence[int]) -> int:
        """How many leading ``block_hashes`` are cached on GPU (no side effect)."""
        n = 0
        for h in block_hashes:
            if h not in self._gpu:
                break
            n += 1
        return n

    def match_any_tier(self, block_hashes: Sequence[int]) -> int:
        """How many leading ``block_hashes`` are cached on GPU or CPU (no side effect)."""
        n = 0
        for h in block_hashes:
            if h not in self._gpu and h not in self._cpu:
                break
            n += 1
        return n

    def can_admit(self, block_hashes: Sequence[int], total_blocks: int) -> bool:
        """Whether a request of ``total_blocks`` whose full blocks hash to ``block_hashes``
        fits now: its GPU-cached prefix is shared, every other block must be allocatable."""
        n = self.match(block_hashes)
        pinned = sum(1 for h in block_hashes[:n] if self._gpu[h].refs == 0)
        return self.available_blocks - pinned >= total_blocks - n

    def stats(self) -> CacheStats:
        return CacheStats(**dataclasses.asdict(self._counts))

    # ------------------------------------------------------------------ request lifecycle

    def acquire(self, block_hashes: Sequence[int]) -> PrefixHit:
        """Reference the longest cached prefix of ``block_hashes``, loading CPU blocks to GPU.

        The caller owns one reference per block of the returned prefix and gives them back
        with :meth:`release`.
        """
        gpu_hits = cpu_hits = 0
        for h in block_hashes:
            block = self._gpu.get(h)
            if block is not None:
                self._ref(h, block)
                gpu_hits += 1
            elif h in self._cpu and self._load_from_cpu(h):
                cpu_hits += 1
            else:
                break
        self._counts.gpu_hit_blocks += gpu_hits
        self._counts.cpu_hit_blocks += cpu_hits
        return PrefixHit(gpu_hits, cpu_hits)

    def allocate(self, count: int) -> bool:
        """Take ``count`` private blocks, evicting as needed; all or nothing."""
        if count <= 0:
            return True
        if not self._reserve(count):
            self._counts.failed_allocations += 1
            return False
        self._private += count
        return True

    def commit(
        self,
        block_hash: int,
        parent: int | None,
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """A private block became full: cache it (or share the cached copy, freeing the private
        block) and reference it."""
        if self._private <= 0:
            raise ValueError(f"rank {self.rank}: commit of {block_hash} without a private block")
        self._private -= 1
        block = self._gpu.get(block_hash)
        if block is not None:
            self._ref(block_hash, block)
            self._counts.shared_blocks += 1
            return
        block = self._gpu[block_hash] = _Block(parent, token_ids, 1, lora_id, lora_name)
        self._counts.stored_blocks += 1
        self._announce(block_hash, block, GPU)

    def release(self, block_hashes: Sequence[int], private: int = 0) -> None:
        """Give back references (tail first, so tails are evicted first) and private blocks."""
        for h in reversed(block_hashes):
            block = self._gpu[h]
            block.refs -= 1
            if block.refs == 0:
                self._lru[h] = None
        if private > self._private:
            raise ValueError(
                f"rank {self.rank}: release of {private} private blocks, only {self._private} held"
            )
        self._private -= private

    def reset(self) -> bool:
        """Drop every cached block of both tiers (``AllBlocksCleared``); refused while in use."""
        if self.used_blocks:
            self._counts.refused_resets += 1
            return False
        self._gpu.clear()
        self._lru.clear()
        self._cpu.clear()
        self._counts.resets += 1
        self.recorder.record_cleared()
        return True

    # ------------------------------------------------------------------ internals

    def _ref(self, block_hash: int, block: _Block) -> None:
        if block.refs == 0:
            del self._lru[block_hash]
        block.refs += 1

    def _load_from_cpu(self, block_hash: int) -> bool:
        block = self._cpu[block_hash]
        if not self._reserve(1):
            return False
        if block_hash in self._cpu:  # the eviction just made may have dropped it from CPU
            self._cpu.move_to_end(block_hash)
        self._gpu[block_hash] = block.copy(refs=1)
        self._announce(block_hash, block, GPU)
        return True

    def _announce(self, block_hash: int, block: _Block, medium: str) -> None:
        self.recorder.record_stored(
            block_hash,
            block.parent,
            block.tokens,
            medium=medium,
            lora_id=block.lora_id,
            lora_name=block.lora_name,
        )

    def _reserve(self, count: int) -> bool:
        shortfall = count - self.free_blocks
        if shortfall <= 0:
            return True
        if shortfall > len(self._lru):
            return False
        self._evict(shortfall)
        return True

    def _evict(self, count: int) -> None:
        victims = [self._lru.popitem(last=False)[0] for _ in range(count)]
        blocks = [self._gpu.pop(h) for h in victims]
        self._counts.evicted_blocks += count
        if self.cpu_capacity_blocks:
            self._offload(victims, blocks)
        for h in victims:
            self.recorder.record_removed(h, medium=GPU)

    def _offload(self, victims: list[int], blocks: list[_Block]) -> None:
        # Victims come oldest first, and a parent is never older than its child (tails are
        # released first), so reversed they are parent first: stored that way, chains merge
        # and every stored block's parent is already held on GPU or CPU.
        fresh: list[tuple[int, _Block]] = []
        touched = 0
        for h, block in zip(reversed(victims), reversed(blocks), strict=True):
            if h in self._cpu:
                self._cpu.move_to_end(h)
                touched += 1
            else:
                fresh.append((h, block))
        # Make room only from blocks that are not victims (they sit before the touched ones),
        # so no victim's parent leaves CPU while its child is being stored there.
        room = self.cpu_capacity_blocks - touched
        fresh = fresh[: max(0, room)]
        self._drop_from_cpu(len(self._cpu) + len(fresh) - self.cpu_capacity_blocks)
        self._counts.offloaded_blocks += len(fresh)
        for h, block in fresh:
            self._cpu[h] = block.copy(refs=0)
            self._announce(h, block, CPU)

    def _drop_from_cpu(self, count: int) -> None:
        for _ in range(max(0, count)):
            h, _block = self._cpu.popitem(last=False)
            self._counts.cpu_dropped_blocks += 1
            self.recorder.record_removed(h, medium=CPU)


class PrefixCache:
    """Several ranks' caches with one capacity each: a convenience over :class:`RankCache`."""

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        *,
        ranks: int = 1,
        cpu_capacity_blocks: int = 0,
        recorders: Sequence[EventRecorder] | None = None,
    ) -> None:
        if ranks <= 0:
            raise ValueError(f"ranks must be positive, got {ranks}")
        if recorders is not None and len(recorders) != ranks:
            raise ValueError(f"{len(recorders)} recorders for {ranks} ranks")
        self.ranks = [
            RankCache(
                capacity_blocks,
                block_size,
                cpu_capacity_blocks=cpu_capacity_blocks,
                rank=r,
                recorder=None if recorders is None else recorders[r],
            )
            for r in range(ranks)
        ]

    def __getitem__(self, rank: int) -> RankCache:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def cached_blocks(self, rank: int, medium: str = GPU) -> set[int]:
        """Ground truth: the block hashes cached on ``rank`` in ``medium``."""
        return self.ranks[rank].cached_blocks(medium)
