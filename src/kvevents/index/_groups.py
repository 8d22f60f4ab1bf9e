"""KV cache groups of hybrid models: what a prefix hit needs from each group.

vLLM tags every event of a hybrid model with its KV cache group (``group_idx``) and stores
with the group's spec (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``); the groups
share block hashes when they share a block size. What a hit of ``n`` blocks needs
(``vllm/v1/core/single_type_kv_cache_manager.py``, ``find_longest_cache_hit`` per manager):

- a whole-prefix group (full attention, MLA, attention sinks) every block ``0 .. n-1``;
- a sliding-window group only the ``cdiv(window - 1, block_size)`` blocks before ``n``
  (``SlidingWindowManager._contiguous_blocks_for_hit``);
- a Mamba group only block ``n - 1`` (the state at the hit point).

So the index keeps whole-prefix groups (and every event without a group or a kind) in its
block tables, as before, and each windowed or Mamba group of a stream aside, as a
:class:`TailGroup` of our keys; a stream's prefix is then cut to the longest ``n`` whose tail
every such group holds (:func:`cut`). A group whose block size is not its stream's is not
followed (its events are counted, nothing else).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvevents.index import _table as bt

__all__ = ["WHOLE_PREFIX", "TailGroup", "cut", "tail_need"]

#: Kinds of group whose hit needs every block of the prefix.
WHOLE_PREFIX = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def tail_need(kind: str, window: object, block_size: int) -> int | None:
    """Blocks before the hit point a group of ``kind`` needs; None for a whole-prefix group
    (or a kind whose rule the index does not model: it stays in the tables, as before)."""
    if kind == "mamba":
        return 1
    if kind in ("sliding_window", "sliding_window_mla") and isinstance(window, int) and window > 0:
        return max(1, -(-(window - 1) // block_size))
    return None


class TailGroup:
    """One windowed or Mamba group of a stream: the blocks it holds, by engine hash and by
    our key (reference counted, as vLLM does not de-duplicate its cache)."""

    __slots__ = ("engine", "held", "need")

    def __init__(self, need: int) -> None:
        self.need = need
        self.engine = bt.U64Map()  # engine hash -> our key
        self.held: dict[int, int] = {}  # our key -> copies held

    def add(self, hashes: Sequence[int], ours: Sequence[int], refresh: bool) -> None:
        """Store blocks (``refresh``: a held engine hash is the same block announced again)."""
        engine, held = self.engine, self.held
        for eh, oh in zip(hashes, ours, strict=True):
            if refresh and engine.get(eh) is not None:
                continue
            engine[eh] = oh
            held[oh] = held.get(oh, 0) + 1

    def remove(self, hashes: Sequence[int]) -> int:
        """Remove one copy of each block; returns how many it did not hold."""
        engine, held, unknown = self.engine, self.held, 0
        for eh in hashes:
            oh = engine.get(eh)
            if oh is None:
                unknown += 1
            elif held.get(oh, 0) > 1:
                held[oh] -= 1
            else:
                held.pop(oh, None)
                del engine[eh]
        return unknown

    def clear(self) -> None:
        self.engine = bt.U64Map()
        self.held = {}

    def run_lengths(self, keys: Sequence[int]) -> list[int]:
        """For each block of ``keys``, how many held blocks end there, it included."""
        out, run, held = [], 0, self.held
        for key in keys:
            run = run + 1 if key in held else 0
            out.append(run)
        return out


def cut(depth: int, keys: Sequence[int], groups: Sequence[TailGroup]) -> int:
    """The longest prefix of at most ``depth`` blocks whose tail every group holds."""
    if not groups or depth == 0:
        return depth
    runs = [(g.need, g.run_lengths(keys[:depth])) for g in groups]
    for n in range(depth, 0, -1):
        if all(run[n - 1] >= min(n, need) for need, run in runs):
            return n
    return 0
