"""An SGLang plugin: SGLang's KV events published by :class:`kvevents.publish.ZmqPublisher`.

Installed next to SGLang (``pip install 'kvevents[sglang]'`` in SGLang's environment), the
entry point ``kvevents`` of the ``sglang.srt.plugins`` group is run by SGLang's
``load_plugins()``, which every SGLang process calls first (the scheduler processes that own a
KV cache among them); it calls :func:`register`, which adds the publisher ``"kvevents"`` to
SGLang's ``EventPublisherFactory``. ``--kv-events-config '{"publisher": "kvevents", ...}'``
then selects it: the factory builds it with ``attn_dp_rank=...`` and the other fields of
SGLang's config (``format`` aside, which only SGLang's hashing reads). It publishes the wire
and answers the replay requests of SGLang's own publisher, with kvevents' never-blocking send
path, replay ring, shutdown flush and counters (``docs/publisher.md``).

Where SGLang's ``SGLANG_PLUGINS`` lists the plugins to load, it must name ``kvevents``.

Differences from SGLang's publisher: the PUB socket always binds, so a config SGLang would
connect (``bind: false``, or a concrete host without ``bind``) is refused at start with the
way out (:class:`kvevents.config.SGLangKVEventsConfig`); an EAGLE bigram store (token pairs)
is sent as its tokens plus the token after them (``lookahead_token_ids``), which every
kvevents consumer keys as SGLang reuses it; an event kvevents cannot read (pairs that do not
chain, say) is skipped and counted rather than sent.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from kvevents._types import Document
from kvevents.config import SGLangKVEventsConfig
from kvevents.errors import DecodeError
from kvevents.publish import PublisherStats, ZmqPublisher
from kvevents.ratelimit import RateLimitedWarning
from kvevents.wire import decode_batch

__all__ = ["PUBLISHER_NAME", "SGLangPublisher", "SGLangPublisherStats", "register"]

log = logging.getLogger("kvevents.integrations.sglang")

#: The name SGLang's ``kv_events_config.publisher`` selects this publisher by.
PUBLISHER_NAME = "kvevents"
# A bound wildcard is reachable on loopback from this host (SGLang's local sources say so too).
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "[::]": "[::1]"}


@dataclass(frozen=True)
class SGLangPublisherStats:
    """The publisher's counters, plus what it could not read from SGLang (skipped, not sent):
    single events, and whole batches that were not one."""

    publisher: PublisherStats
    events_skipped: int
    batches_skipped: int


class SGLangPublisher:
    """SGLang's ``EventPublisher`` interface (``publish``, ``shutdown``,
    ``describe_local_source``) over a ``ZmqPublisher`` for one attention-DP rank."""

    # SGLang's config fields, any values, checked by the config.
    def __init__(self, attn_dp_rank: int = 0, **fields: Any) -> None:
        fields.setdefault("publisher", PUBLISHER_NAME)
        # SGLang validated its config before its factory called us, so a field we do not know is
        # one a newer SGLang added: warn and go on rather than refuse to start the engine.
        unknown = sorted(set(fields) - set(SGLangKVEventsConfig.model_fields))
        if unknown:
            log.warning("kvevents publisher: ignoring SGLang config fields %s", ", ".join(unknown))
        known = {name: value for name, value in fields.items() if name not in unknown}
        config = SGLangKVEventsConfig.model_validate(known).to_kvevents()
        self.rank = attn_dp_rank
        # The layout check wants a world size; this rank's own endpoints are all it binds.
        self._publisher = ZmqPublisher(config, attn_dp_rank, world_size=attn_dp_rank + 1)
        self._encode = msgspec.msgpack.Encoder()
        self._skipped = 0
        self._batches_skipped = 0
        self._closed = False
        self._warn = RateLimitedWarning(log)
        self._publisher.start()
        # SGLang's schedulers exit without shutting their publisher down: flush at exit.
        atexit.register(self.shutdown)

    # SGLang's KVEventBatch: its classes are not imported here.
    def publish(self, events: Any) -> None:
        """Publish one SGLang ``KVEventBatch`` (``[ts, events, attn_dp_rank]``), never blocking."""
        payload = self._encode.encode(events)
        try:
            decoded = decode_batch(payload)
        except DecodeError as exc:
            self._batches_skipped += 1
            self._skip(len(getattr(events, "events", ())), str(exc))
            return
        if decoded.skipped:
            self._skip(decoded.skipped_count, decoded.skipped[0].reason)
        self._publisher.publish(decoded.batch)

    def _skip(self, count: int, reason: str) -> None:
        self._skipped += count
        self._warn("skipped", "kvevents publisher: %d unreadable SGLang events (%s)", count, reason)

    def stats(self) -> SGLangPublisherStats:
        """A snapshot of the counters (safe from any thread)."""
        return SGLangPublisherStats(self._publisher.stats(), self._skipped, self._batches_skipped)

    def describe_local_source(self, block_size: int) -> Document | None:
        """Where a process on this host subscribes to this rank: the bound endpoints, a wildcard
        host read as loopback (what SGLang's scheduler asks every publisher for)."""
        endpoint = _local(self._publisher.endpoint)
        if endpoint is None:
            return None
        source: Document = {
            "dp_rank": self.rank,
            "endpoint": endpoint,
            "topic": self._publisher.config.topic,
            "block_size": block_size,
        }
        replay = _local(self._publisher.replay_endpoint)
        if replay is not None:
            source["replay_endpoint"] = replay
        return source

    def shutdown(self) -> None:
        """Publish what is queued (within the linger), then close; calling it again is harmless."""
        atexit.unregister(self.shutdown)
        if self._closed:
            return
        self._closed = True
        report = self._publisher.shutdown()
        if report.undelivered:
            log.warning(
                "kvevents publisher: %d batches undelivered at shutdown", report.undelivered
            )


def _local(endpoint: str | None) -> str | None:
    """A bound endpoint as a local process dials it; None for inproc (this process only)."""
    if endpoint is None or endpoint.startswith("inproc://"):
        return None
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return f"tcp://{_LOOPBACK.get(host, host)}:{port}"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: add the publisher to SGLang's factory.

    SGLang calls it once in each of its processes; calling it again is harmless. Outside SGLang
    it does nothing.
    """
    try:
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory
    except ImportError:
        return
    with contextlib.suppress(KeyError):  # registered already by this process
        EventPublisherFactory.register_publisher(PUBLISHER_NAME, SGLangPublisher)
