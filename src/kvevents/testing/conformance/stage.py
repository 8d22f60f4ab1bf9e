"""The stage of a conformance scenario: publishers, the truth they build, the sentinel handshake.

:class:`Stage` owns one :class:`~kvevents.testing.peers.RawPublisher` per stream of a
scenario. A script publishes through it, and every batch also updates the :class:`Truth`: the
engine block hashes a correct consumer holds per (worker, rank) stream once settled.
:meth:`Stage.sync` stores a sentinel block on every stream and waits until the consumer shows
it: once it does, everything published before has been processed. :class:`Consumer` is what a
consumer under test provides; see :mod:`kvevents.testing.conformance.run`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvevents.events import BlockRemoved, BlockStored, Event, KVEventBatch, StreamKey
from kvevents.testing.index import HashStyle, engine_hashes, store_event
from kvevents.testing.peers import RawPublisher
from kvevents.testing.sockets import Deadline
from kvevents.wire import encode_batch

__all__ = [
    "Consumer",
    "NotObservable",
    "Prompt",
    "Scenario",
    "Stage",
    "StreamDef",
    "StreamRegistration",
    "Truth",
    "u64",
]

_U64 = 2**64 - 1
# Sentinel handshake: heartbeats re-probe a consumer that missed the sentinel (slow joiner,
# late join). Capped, so a consumer that ignores a stream is not fed unbounded sequence
# numbers (Dynamo starts accepting a restarted stream once it passes the old watermark).
_FIRST_PROBE = 0.05
_MAX_PROBE_INTERVAL = 0.5
_MAX_PROBES = 8
_POLL = 0.02
_tokens = itertools.count(1)
_SYNC_NAMES = {1: "hello", 2: "end"}  # the handshake sentinel and the final one


def u64(block_hash: int) -> int:
    """A hash as unsigned 64-bit: signed and unsigned forms of one hash compare equal."""
    return block_hash & _U64


class NotObservable(Exception):
    """Raised by an adapter that cannot follow or read a scenario at all (say why)."""


@dataclass(frozen=True)
class StreamRegistration:
    """What a consumer is told about one (worker, rank) stream."""

    worker_id: str
    rank: int
    endpoint: str  #: the rank's own PUB endpoint (not a base endpoint)
    replay_endpoint: str | None
    block_size: int

    @property
    def key(self) -> StreamKey:
        return (self.worker_id, self.rank)


class Consumer(Protocol):
    """What the runner needs from a consumer under test; see the module docstring.

    Read-back methods return None when the adapter cannot observe that part of the state
    (the check becomes ``NOT OBSERVABLE``). Hashes are compared as unsigned 64-bit (:func:`u64`).
    """

    name: str

    def start(self) -> None:
        """Once, before any scenario (e.g. launch a process)."""

    def begin(self, scenario: str) -> None:
        """Start from an empty state for one scenario."""

    def register(self, streams: Sequence[StreamRegistration]) -> None:
        """Follow these streams (every stream of the scenario, in one call)."""

    def held(self) -> Mapping[StreamKey, frozenset[int]] | None:
        """Engine block hashes held per stream (any tier)."""

    def matched(self, token_ids: Sequence[int], block_size: int) -> Mapping[StreamKey, int] | None:
        """Matched prefix length in blocks per stream for a request (absent means 0)."""

    def losses(self) -> Mapping[StreamKey, bool] | None:
        """Per stream: has the consumer reported events lost for good?"""

    def rejections(self) -> Mapping[StreamKey, int] | None:
        """Per stream: events the consumer reported rejecting for their block size."""

    def end(self) -> None:
        """Forget the scenario's streams and state."""

    def close(self) -> None:
        """Release everything (after the last scenario)."""


# ---------------------------------------------------------------------- the truth


@dataclass(frozen=True)
class Prompt:
    """A token sequence whose blocks a scenario stores; ``hashes`` are its engine hashes."""

    name: str
    tokens: tuple[int, ...]
    block_size: int
    style: HashStyle = "vllm"

    @property
    def hashes(self) -> list[int]:
        return engine_hashes(self.tokens, self.block_size, style=self.style)

    @property
    def blocks(self) -> int:
        return len(self.tokens) // self.block_size

    def remove(self, start: int = 0, end: int | None = None) -> BlockRemoved:
        """The ``BlockRemoved`` for blocks ``start:end``."""
        return BlockRemoved(block_hashes=self.hashes[start:end], medium="GPU")

    def store(self, start: int = 0, end: int | None = None) -> BlockStored:
        """The ``BlockStored`` for blocks ``start:end`` (parent: block ``start - 1``)."""
        return store_event(
            self.tokens,
            self.block_size,
            start_block=start,
            end_block=end,
            medium="GPU",
            style=self.style,
        )


@dataclass
class Truth:
    """What a correct consumer holds once settled, kept as the scenario publishes.

    ``held``: engine hashes per stream (unsigned 64-bit). ``names``: a readable name per hash
    for reasons (``B[2]``). ``prompts``: requests to match; the expected match on a stream is
    the run of leading blocks it holds. ``lossy``: streams that must report a loss;
    ``rejecting``: streams that must report a rejected block size.
    """

    held: dict[StreamKey, set[int]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    prompts: list[Prompt] = field(default_factory=list)
    lossy: set[StreamKey] = field(default_factory=set)
    rejecting: set[StreamKey] = field(default_factory=set)

    def apply(self, key: StreamKey, events: Iterable[Event]) -> None:
        """Apply events the way the engine's cache changed."""
        held = self.held.setdefault(key, set())
        for event in events:
            if isinstance(event, BlockStored):
                held.update(u64(h) for h in event.block_hashes)
            elif hasattr(event, "block_hashes"):
                held.difference_update(u64(h) for h in event.block_hashes)
            else:
                held.clear()

    def reset(self, key: StreamKey) -> None:
        """The engine restarted: its cache is empty."""
        self.held[key] = set()

    def name(self, prompt: Prompt) -> None:
        for i, h in enumerate(prompt.hashes):
            self.names[u64(h)] = f"{prompt.name}[{i}]"

    def expected_match(self, prompt: Prompt, key: StreamKey) -> int:
        held = self.held.get(key, set())
        return next((i for i, h in enumerate(prompt.hashes) if u64(h) not in held), prompt.blocks)


# ---------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class StreamDef:
    """A stream a scenario publishes on; ``block_size`` is what the consumer is told."""

    worker_id: str
    rank: int = 0
    block_size: int = 16

    @property
    def key(self) -> StreamKey:
        return (self.worker_id, self.rank)


class Stage:
    """The publishers of one scenario run, and the truth they build. Scripts use this."""

    def __init__(self, streams: Sequence[StreamDef]) -> None:
        self.streams = {s.key: s for s in streams}
        self.truth = Truth()
        self.pubs: dict[StreamKey, RawPublisher] = {}
        self._base = next(_tokens) * 100_000
        self._sync_count = 0
        try:
            for key in self.streams:
                self.pubs[key] = RawPublisher()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()

    def registrations(self) -> list[StreamRegistration]:
        return [
            StreamRegistration(
                s.worker_id,
                s.rank,
                self.pubs[k].endpoint,
                self.pubs[k].replay_endpoint,
                s.block_size,
            )
            for k, s in self.streams.items()
        ]

    def prompt(
        self,
        name: str,
        blocks: int = 4,
        *,
        block_size: int = 16,
        style: HashStyle = "vllm",
        probe: bool = True,
    ) -> Prompt:
        """Fresh tokens (unique in this process); ``probe``: the runner matches it at the end."""
        start = self._base
        self._base += blocks * block_size
        prompt = Prompt(name, tuple(range(start, self._base)), block_size, style)
        self.truth.name(prompt)
        if probe:
            self.truth.prompts.append(prompt)
        return prompt

    def publish(
        self, key: StreamKey, *events: Event, drop: bool = False, known: bool = True
    ) -> int:
        """Publish a batch on ``key``; ``drop``: replay only; ``known``: counts in the truth."""
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=key[1])
        return self.publish_payload(key, encode_batch(batch), events, drop=drop, known=known)

    def publish_payload(
        self,
        key: StreamKey,
        payload: bytes,
        meaning: Iterable[Event],
        *,
        drop: bool = False,
        known: bool = True,
    ) -> int:
        """Publish raw bytes whose effect on the cache is ``meaning``."""
        if known:
            self.truth.apply(key, meaning)
        return self.pubs[key].publish(payload, drop=drop)

    def heartbeat(self, key: StreamKey) -> None:
        self.publish(key)

    def restart(self, key: StreamKey) -> None:
        """The publisher process restarts: sequence back to 0, empty ring, empty cache."""
        self.pubs[key].restart()
        self.truth.reset(key)

    def sync(self, consumer: Consumer, seconds: float) -> str | None:
        """Store a sentinel block on every stream and wait until the consumer shows them all.

        None when it did, else why not (the caller still checks the final state).
        """
        self._sync_count += 1
        sentinels: dict[StreamKey, Prompt] = {}
        for key, spec in self.streams.items():
            name = _SYNC_NAMES.get(self._sync_count, f"sync{self._sync_count}")
            sentinels[key] = self.prompt(name, 1, block_size=spec.block_size, probe=False)
            self.publish(key, sentinels[key].store())
        return _await_sentinels(self, consumer, sentinels, Deadline(seconds), seconds)


def _shown(consumer: Consumer, sentinels: Mapping[StreamKey, Prompt]) -> list[StreamKey]:
    """Streams whose sentinel the consumer does not show yet."""
    held = consumer.held()
    if held is not None:
        return [k for k, p in sentinels.items() if u64(p.hashes[0]) not in held.get(k, ())]
    missing = []
    for key, prompt in sentinels.items():
        matched = consumer.matched(prompt.tokens, prompt.block_size) or {}
        if matched.get(key, 0) < 1:
            missing.append(key)
    return missing


def _await_sentinels(
    stage: Stage,
    consumer: Consumer,
    sentinels: Mapping[StreamKey, Prompt],
    deadline: Deadline,
    seconds: float,
) -> str | None:
    interval, probes = _FIRST_PROBE, 0
    next_probe = time.monotonic() + interval
    while True:
        missing = _shown(consumer, sentinels)
        if not missing:
            return None
        if deadline.expired:
            streams = ", ".join(f"{w}/{r}" for w, r in missing)
            return f"{streams} never showed the sentinel (waited {seconds:g} s)"
        if time.monotonic() >= next_probe and probes < _MAX_PROBES:
            for key in missing:
                stage.heartbeat(key)
            probes += 1
            interval = min(interval * 2, _MAX_PROBE_INTERVAL)
            next_probe = time.monotonic() + interval
        time.sleep(_POLL)


# ---------------------------------------------------------------------- scenarios and results


@dataclass(frozen=True)
class Scenario:
    """One fault script and what it expects; see docs/conformance.md.

    ``prelude`` runs before the consumer registers (late joins), ``script`` after the
    handshake. Both publish through the :class:`Stage`, which keeps the truth.
    """

    name: str
    injects: str  #: what the script does to the stream
    expects: str  #: the final state it checks, and why
    streams: tuple[StreamDef, ...]
    script: Callable[[Stage], None]
    prelude: Callable[[Stage], None] | None = None
