"""A TensorRT-LLM bridge: its pulled KV cache events published as the kvevents wire.

TensorRT-LLM hands its KV cache events out through a pull API: ``LLM.get_kv_cache_events(timeout)``
(and ``POST /kv_cache_events`` of ``trtllm-serve``) returns the JSON-able dicts of its
``KVCacheEventSerializer``; its own ZeroMQ path is refused at start-up in current releases.
:class:`TensorRTLLMBridge` calls such a ``poll(timeout) -> list[dict]`` on its own thread and
publishes exactly the stream a :class:`~kvevents.config.KVEventsConfig` describes: one
kvevents publisher per attention-DP rank (endpoints per rank, replay, topic, bounded queue and
replay buffer), one batch per poll per rank that has something to say.

The mapping (``docs/engines.md``), one entry at a time:

- ``stored`` -> ``BlockStored``: each block's ``tokens[].token_id`` flattened, ``parent_hash``
  the parent, ``lora_id`` kept, ``medium`` from ``cache_level`` (0 -> ``"GPU"``, 1 ->
  ``"CPU"``); a partial last block is not announced (WIRE.md section 7). Blocks that differ in
  medium or LoRA become consecutive ``BlockStored`` events chained by their parent hashes;
  non-zero ``token_extra_id`` values go to ``extra_keys`` (one list per block);
- ``removed`` -> ``BlockRemoved``; ``created`` (the cache was (re)created) -> ``AllBlocksCleared``;
- ``updated`` (a priority or cache level change) -> no wire event: it changes no cache
  contents; counted.

Hashes are kept as signed 64-bit integers (an unsigned value above ``2**63 - 1`` becomes its
two's complement). A malformed entry is counted and skipped alone, with a rate-limited warning
naming the field and the rule; the rest of its poll is published.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Literal, TypeAlias

from kvevents._types import DocumentView, JSONValue
from kvevents.config import KVEventsConfig
from kvevents.errors import PublisherError
from kvevents.events import UNSET, AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
from kvevents.integrations._fetch import FetchError, fetch
from kvevents.metrics import StatsCollector, publisher_collector
from kvevents.publish import (
    Publisher,
    PublisherOptions,
    PublisherStats,
    ShutdownReport,
    create_publisher,
)
from kvevents.ratelimit import RateLimitedWarning

__all__ = [
    "DEFAULT_MAX_POLL_BYTES",
    "MEDIA",
    "BridgeStats",
    "Mapped",
    "TensorRTLLMBridge",
    "http_poll",
    "map_event",
    "signed64",
]

log = logging.getLogger("kvevents.integrations.tensorrt_llm")

#: ``cache_level`` -> wire ``medium``: TensorRT-LLM's primary pool is GPU memory, its
#: secondary pool host memory.
MEDIA: Mapping[int, str] = {0: "GPU", 1: "CPU"}

EventKind: TypeAlias = Literal["created", "stored", "removed", "updated"]
Poll: TypeAlias = Callable[[float], list[JSONValue]]
BridgeState: TypeAlias = Literal["new", "started", "closed"]

_KINDS: tuple[EventKind, ...] = ("created", "stored", "removed", "updated")
_U64 = 1 << 64
_I64_MIN = -(1 << 63)
#: How long close() waits for a poll under way to end; after that the poll thread is left to
#: end on its own (a daemon: what it returns is not published once the bridge is closed).
_CLOSE_GRACE = 2.0
#: The largest answer :func:`http_poll` reads by default: a poll every 0.1-0.2 s drains far
#: less (a stored event of 1,024 tokens is about 50 KB of the serializer's JSON).
DEFAULT_MAX_POLL_BYTES = 64 << 20


class _Malformed(ValueError):
    """One entry cannot be mapped; the message names the field and the rule."""


# ---------------------------------------------------------------------- the pure mapping


def signed64(value: object, field: str) -> int:
    """``value`` as a signed 64-bit integer: ``[2**63, 2**64)`` wraps to its two's complement."""
    value = _int(value, field)
    return value - _U64 if value > ~_I64_MIN else value


def _get(obj: DocumentView, key: str, where: str) -> JSONValue:
    if key not in obj:
        raise _Malformed(f"{where}.{key} is missing")
    return obj[key]


def _mapping(value: object, field: str) -> DocumentView:
    if not isinstance(value, Mapping):
        raise _Malformed(f"{field} is {type(value).__name__}, expected an object")
    return value


def _list(value: object, field: str) -> list[JSONValue]:
    if not isinstance(value, list):
        raise _Malformed(f"{field} is {type(value).__name__}, expected a list")
    return value


def _int(value: object, field: str) -> int:
    """An integer msgpack can carry (a larger one would fail the whole batch's encoding)."""
    if type(value) is not int:
        raise _Malformed(f"{field} is {type(value).__name__}, expected an integer")
    if not _I64_MIN <= value < _U64:
        raise _Malformed(f"{field} = {value} is outside the 64-bit range")
    return value


def _small_int(value: object, field: str) -> int:
    if type(value) is not int or not 0 <= value < _U64:
        raise _Malformed(f"{field} = {value!r} is not an integer in [0, 2**64)")
    return value


@dataclasses.dataclass(frozen=True)
class Mapped:
    """One TensorRT-LLM entry read: its rank, kind, the wire events it becomes (none for
    ``updated``), its ``event_id`` and the partial blocks left unannounced."""

    rank: int
    kind: EventKind
    events: tuple[Event, ...]
    event_id: int | None = None
    partial_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class _Block:
    block_hash: int
    tokens: list[int]
    extras: list[int] | None
    medium: str
    lora_id: int | None


def _tokens(value: object, where: str) -> tuple[list[int], list[int] | None]:
    tokens = _list(value, f"{where}.tokens")
    # The common case in two comprehensions (a store carries thousands of tokens); any doubt
    # goes to the token-by-token reading, which names the first bad token.
    try:
        ids = [token["token_id"] for token in tokens]
        extras = [token.get("token_extra_id") or 0 for token in tokens]
    except (TypeError, KeyError, AttributeError):
        return _tokens_one_by_one(tokens, where)
    if not (_all_int64(ids) and _all_int64(extras)):
        return _tokens_one_by_one(tokens, where)
    return ids, (extras if any(extras) else None)


def _all_int64(values: list[JSONValue]) -> bool:
    if not values:
        return True
    return set(map(type, values)) == {int} and min(values) >= _I64_MIN and max(values) < _U64


def _tokens_one_by_one(tokens: list[JSONValue], where: str) -> tuple[list[int], list[int] | None]:
    ids: list[int] = []
    extras: list[int] = []
    for i, token in enumerate(tokens):
        token = _mapping(token, f"{where}.tokens[{i}]")
        ids.append(
            _int(_get(token, "token_id", f"{where}.tokens[{i}]"), f"{where}.tokens[{i}].token_id")
        )
        extra = token.get("token_extra_id") or 0
        extras.append(_int(extra, f"{where}.tokens[{i}].token_extra_id"))
    return ids, (extras if any(extras) else None)


def _block(value: object, where: str) -> _Block:
    block = _mapping(value, where)
    ids, extras = _tokens(_get(block, "tokens", where), where)
    level = _small_int(block.get("cache_level", 0), f"{where}.cache_level")
    if level not in MEDIA:
        raise _Malformed(f"{where}.cache_level = {level} is not one of {sorted(MEDIA)}")
    lora = block.get("lora_id")
    return _Block(
        block_hash=signed64(_get(block, "block_hash", where), f"{where}.block_hash"),
        tokens=ids,
        extras=extras,
        medium=MEDIA[level],
        lora_id=None if lora is None else _small_int(lora, f"{where}.lora_id"),
    )


def _full_blocks(blocks: list[_Block], block_size: int) -> tuple[list[_Block], int]:
    """The blocks to announce and how many partial ones were left (only the last may be)."""
    for i, block in enumerate(blocks):
        size = len(block.tokens)
        if size > block_size or (size < block_size and i != len(blocks) - 1):
            raise _Malformed(
                f"data.blocks[{i}] has {size} tokens; blocks hold {block_size} "
                "(only the last may hold fewer)"
            )
    if blocks and len(blocks[-1].tokens) < block_size:
        return blocks[:-1], 1
    return blocks, 0


def _stored_event(run: list[_Block], parent: int | None, block_size: int) -> BlockStored:
    extras = [b.extras for b in run]
    return BlockStored(
        block_hashes=[b.block_hash for b in run],
        parent_block_hash=parent,
        token_ids=[t for b in run for t in b.tokens],
        block_size=block_size,
        lora_id=run[0].lora_id,
        medium=run[0].medium,
        extra_keys=extras if any(e is not None for e in extras) else UNSET,
    )


def _stored(data: DocumentView, block_size: int | None) -> tuple[list[Event], int]:
    raw = _list(_get(data, "blocks", "data"), "data.blocks")
    if not raw:
        raise _Malformed("data.blocks is empty: a store names at least one block")
    parent_raw = data.get("parent_hash")
    parent = None if parent_raw is None else signed64(parent_raw, "data.parent_hash")
    blocks = [_block(b, f"data.blocks[{i}]") for i, b in enumerate(raw)]
    size = block_size or max(len(b.tokens) for b in blocks)
    if size == 0:
        raise _Malformed("data.blocks hold no tokens")
    full, partial = _full_blocks(blocks, size)
    events: list[Event] = []
    # One event per run of blocks sharing medium and LoRA, each chained to the block before.
    for _, group in itertools.groupby(full, key=lambda b: (b.medium, b.lora_id)):
        run = list(group)
        events.append(_stored_event(run, parent, size))
        parent = run[-1].block_hash
    return events, partial


def _removed(data: DocumentView) -> list[Event]:
    raw = _list(_get(data, "block_hashes", "data"), "data.block_hashes")
    hashes = [signed64(h, f"data.block_hashes[{i}]") for i, h in enumerate(raw)]
    return [BlockRemoved(block_hashes=hashes)] if hashes else []


def _header(entry: DocumentView, world_size: int) -> tuple[int, int | None]:
    rank = entry.get("attention_dp_rank")
    rank = 0 if rank is None else _small_int(rank, "attention_dp_rank")
    if rank >= world_size:
        raise _Malformed(f"attention_dp_rank = {rank} is not below the {world_size} DP ranks")
    event_id = entry.get("event_id")
    return rank, None if event_id is None else _small_int(event_id, "event_id")


def map_event(entry: object, *, block_size: int | None = None, world_size: int = 1) -> Mapped:
    """One serialized TensorRT-LLM event as wire events; raises ``ValueError`` naming the
    field and the rule when it is malformed.

    ``block_size`` is the engine's tokens per block; None takes the largest block of the
    entry (then a store made of one partial block cannot be told from a full one).
    """
    entry = _mapping(entry, "entry")
    rank, event_id = _header(entry, world_size)
    data = _mapping(_get(entry, "data", "entry"), "data")
    kind = _get(data, "type", "data")
    if kind == "stored":
        events, partial = _stored(data, block_size)
        return Mapped(rank, "stored", tuple(events), event_id, partial)
    if kind == "removed":
        return Mapped(rank, "removed", tuple(_removed(data)), event_id)
    if kind == "created":
        return Mapped(rank, "created", (AllBlocksCleared(),), event_id)
    if kind == "updated":
        signed64(_get(data, "block_hash", "data"), "data.block_hash")
        return Mapped(rank, "updated", (), event_id)
    raise _Malformed(f"data.type = {kind!r} is not one of {list(_KINDS)}")


# ---------------------------------------------------------------------- the bridge


@dataclasses.dataclass(frozen=True)
class BridgeStats:
    """The bridge's counters (``stats()``); the publishers' own are in ``publisher_stats()``."""

    polls: int = 0  #: calls of the poll function that returned a list
    poll_errors: int = 0  #: calls that raised or returned something other than a list
    events: int = 0  #: entries received from the engine
    created: int = 0  #: created entries read (published as AllBlocksCleared)
    stored: int = 0  #: stored entries read (published as BlockStored)
    removed: int = 0  #: removed entries read (published as BlockRemoved)
    updated: int = 0  #: updated entries read (priority or cache level; nothing published)
    bad_events: int = 0  #: malformed entries skipped, one at a time
    partial_blocks: int = 0  #: partial last blocks of stores, not announced
    missed_events: int = 0  #: event ids the engine skipped (its event buffer overflowed)
    batches: int = 0  #: batches handed to the publishers
    publish_errors: int = 0  #: batches a closed or unstarted publisher refused
    last_error: str | None = None  #: why the last entry was skipped or the last poll failed


@dataclasses.dataclass(slots=True)
class _BridgeCounts:
    """The bridge's running counters (each documented on :class:`BridgeStats`): mutable
    fields, so that a counter's name is checked by mypy."""

    polls: int = 0
    poll_errors: int = 0
    events: int = 0
    created: int = 0
    stored: int = 0
    removed: int = 0
    updated: int = 0
    bad_events: int = 0
    partial_blocks: int = 0
    missed_events: int = 0
    batches: int = 0
    publish_errors: int = 0

    def read(self, kind: EventKind) -> None:
        """Count one entry of ``kind`` read."""
        if kind == "created":
            self.created += 1
        elif kind == "stored":
            self.stored += 1
        elif kind == "removed":
            self.removed += 1
        else:
            self.updated += 1


class TensorRTLLMBridge:
    """Polls TensorRT-LLM's KV cache events and publishes them per attention-DP rank.

    ``poll`` is ``llm.get_kv_cache_events`` (or :func:`http_poll` for ``trtllm-serve``);
    ``attention_dp_size`` the engine's attention-DP ranks; ``block_size`` its tokens per block
    (recommended: without it a store of one partial block is taken for a full one).
    ``start()`` binds every rank's publisher, then starts the polling thread (``thread=False``:
    drive it yourself with :meth:`poll_once`); ``close()`` stops both.
    """

    def __init__(
        self,
        poll: Poll,
        config: KVEventsConfig,
        *,
        attention_dp_size: int = 1,
        block_size: int | None = None,
        poll_timeout: float = 0.1,
        options: PublisherOptions | None = None,
    ) -> None:
        if attention_dp_size < 1:
            raise ValueError(f"attention_dp_size must be >= 1, got {attention_dp_size}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.poll = poll
        self.config = config
        self.world_size = attention_dp_size
        self.block_size = block_size
        self.poll_timeout = poll_timeout
        self.publishers: list[Publisher] = [
            create_publisher(config, rank, world_size=attention_dp_size, options=options)
            for rank in range(attention_dp_size)
        ]
        self._counts = _BridgeCounts()
        self._last_error: str | None = None
        self._last_ids: dict[int, int] = {}
        self._state: BridgeState = "new"
        self._pump = threading.Lock()  # one poll at a time
        self._lock = threading.Lock()  # guards the counters and the state, never held long
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warn = RateLimitedWarning(log)

    def __repr__(self) -> str:
        return f"<TensorRTLLMBridge ranks={self.world_size} {self._state}>"

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, thread: bool = True) -> None:
        """Bind every rank's publisher, then start polling on a thread (idempotent)."""
        if self._state == "closed":
            raise PublisherError("the TensorRT-LLM bridge was closed")
        if self._state == "new":
            for publisher in self.publishers:
                publisher.start()
            self._state = "started"
        if thread and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvevents-trtllm-bridge", daemon=True
            )
            self._thread.start()

    def endpoints(self) -> dict[int, tuple[str | None, str | None]]:
        """Each rank's bound ``(publish, replay)`` endpoints (ephemeral ports resolved)."""
        return {p.rank: (p.endpoint, p.replay_endpoint) for p in self.publishers}

    def close(self, timeout: float | None = None) -> list[ShutdownReport]:
        """Stop polling, publish what is queued, close (idempotent). A poll under way gets
        ``poll_timeout`` plus 2 s to end; one that hangs longer is not waited for, and what
        it returns is dropped."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.poll_timeout + _CLOSE_GRACE)
        # The counters' lock, not the pump: a hung poll holds the pump; no batch is published
        # after this (publishing happens under this lock, once the state says started).
        with self._lock:
            self._state = "closed"
        return [publisher.shutdown(timeout) for publisher in self.publishers]

    def __enter__(self) -> TensorRTLLMBridge:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.poll_once():
                # A failing poll must not spin: wait as long as a poll would have.
                self._stop.wait(self.poll_timeout)

    # ------------------------------------------------------------------ polling

    def poll_once(self) -> bool:
        """One poll, published: one batch per rank with wire events. False if the poll failed."""
        with self._pump:
            if self._state != "started":
                return False
            # Outside the counters' lock: a poll may wait for its whole timeout.
            entries = self._poll()
            with self._lock:
                if entries is None or self._state != "started":
                    return False
                self._counts.polls += 1
                for rank, events in sorted(self._map_all(entries).items()):
                    self._publish(rank, events)
            return True

    def _poll(self) -> list[JSONValue] | None:
        try:
            entries = self.poll(self.poll_timeout)
        except Exception as exc:  # the engine's failure is reported, never the bridge's death
            self._poll_failed(f"poll raised {type(exc).__name__}: {exc}")
            return None
        if not isinstance(entries, list):
            self._poll_failed(f"poll returned {type(entries).__name__}, expected a list")
            return None
        return entries

    def _poll_failed(self, reason: str) -> None:
        with self._lock:
            self._counts.poll_errors += 1
            self._last_error = reason
        self._warn("poll", "TensorRT-LLM bridge: %s", reason)
        return None

    def _map_all(self, entries: list[JSONValue]) -> dict[int, list[Event]]:
        per_rank: dict[int, list[Event]] = {}
        for index, entry in enumerate(entries):
            self._counts.events += 1
            try:
                mapped = map_event(entry, block_size=self.block_size, world_size=self.world_size)
            except ValueError as exc:
                self._skip(index, str(exc))
                continue
            self._count(mapped)
            if mapped.events:
                per_rank.setdefault(mapped.rank, []).extend(mapped.events)
        return per_rank

    def _skip(self, index: int, reason: str) -> None:
        self._counts.bad_events += 1
        self._last_error = f"entry {index} of a poll: {reason}"
        self._warn("bad", "TensorRT-LLM bridge skipped %s", self._last_error)

    def _count(self, mapped: Mapped) -> None:
        self._counts.read(mapped.kind)
        self._counts.partial_blocks += mapped.partial_blocks
        if mapped.event_id is None:
            return
        last = self._last_ids.get(mapped.rank)
        if last is not None and mapped.event_id > last + 1:
            self._counts.missed_events += mapped.event_id - last - 1
        self._last_ids[mapped.rank] = mapped.event_id

    def _publish(self, rank: int, events: list[Event]) -> None:
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)
        try:
            self.publishers[rank].publish(batch)
        except PublisherError as exc:
            self._counts.publish_errors += 1
            self._last_error = f"rank {rank}: {exc}"
            return
        self._counts.batches += 1

    # ------------------------------------------------------------------ introspection

    def stats(self) -> BridgeStats:
        """A snapshot of the bridge's counters (safe from any thread)."""
        with self._lock:
            return BridgeStats(**dataclasses.asdict(self._counts), last_error=self._last_error)

    def publisher_stats(self) -> dict[int, PublisherStats]:
        """Each rank's publisher counters."""
        return {p.rank: p.stats() for p in self.publishers}

    def collectors(self) -> list[StatsCollector]:
        """Prometheus collectors of the bridge (``kvevents_trtllm_bridge_*``) and its publishers
        (``kvevents_publisher_*`` by rank): ``kvevents.metrics.start_exporter(bridge.collectors())``.
        """
        bridge = StatsCollector("kvevents_trtllm_bridge", lambda: [({}, self.stats())])
        return [bridge, publisher_collector(self.publishers)]


def http_poll(
    base_url: str, *, request_timeout: float = 10.0, max_bytes: int = DEFAULT_MAX_POLL_BYTES
) -> Poll:
    """A poll function over ``trtllm-serve``'s ``POST /kv_cache_events`` (each call drains the
    events queued since the previous one). An empty answer returned early waits out the poll
    timeout, so the bridge's thread never spins on an idle engine.

    ``request_timeout`` is each call's whole exchange (connect, headers, body), ``max_bytes``
    its largest answer: a call past either raises ``OSError`` naming the URL and why (the
    bridge counts it in ``poll_errors``), and the events of an answer refused for its size are
    lost (the engine drained them; ``missed_events`` shows the gap at the next poll).
    """
    url = base_url.rstrip("/") + "/kv_cache_events"

    def poll(timeout: float) -> list[JSONValue]:
        began = time.monotonic()
        entries = _read_entries(url, request_timeout, max_bytes)
        if not entries:
            time.sleep(max(0.0, timeout - (time.monotonic() - began)))
        return entries

    return poll


def _read_entries(url: str, request_timeout: float, max_bytes: int) -> list[JSONValue]:
    """The JSON list ``POST url`` answers; OSError or ValueError naming the URL otherwise."""
    try:
        body = fetch(url, timeout=request_timeout, max_bytes=max_bytes, data=b"")
    except FetchError as exc:
        raise OSError(f"POST {url}: {exc.reason}") from None
    try:
        entries = json.loads(body)
    except RecursionError:
        raise ValueError(f"POST {url}: the answer is not JSON: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"POST {url}: the answer is not JSON ({exc})") from None
    if not isinstance(entries, list):
        raise ValueError(f"POST {url}: the answer is a JSON {type(entries).__name__}, not a list")
    return entries
