"""A vLLM plugin: vLLM's KV events published by :class:`kvevents.publish.ZmqPublisher`.

Installed next to vLLM (``pip install 'kvevents[vllm]'`` in vLLM's environment), the entry
point ``kvevents`` of the ``vllm.general_plugins`` group makes every vLLM process call
:func:`register`, which adds the publisher ``"kvevents"`` to vLLM's ``EventPublisherFactory``.
vLLM builds it with ``data_parallel_rank=...`` and the fields of its ``KVEventsConfig``; it
publishes the same wire and answers the same replay requests as vLLM's own publisher, with
kvevents' send path, replay ring and counters (``docs/publisher.md``).

vLLM 0.32 validates ``publisher`` against ``"null"`` and ``"zmq"`` before any plugin is
consulted, so the name cannot be chosen from ``--kv-events-config`` there. With
``KVEVENTS_VLLM_OVERRIDE_ZMQ=1`` in the engine's environment the plugin also takes the
``"zmq"`` name, which works with every vLLM that has the factory.

Differences from vLLM's publisher, both from kvevents' endpoint rules (``docs/wire.md``): the
PUB socket always binds (vLLM connects to a ``tcp://HOST:PORT`` without ``*``), and rank r of
an ``ipc://`` endpoint binds ``<endpoint>_dp<r>`` (vLLM refuses ipc for ranks above 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import msgspec

from kvevents.config import KVEventsConfig
from kvevents.publish import ZmqPublisher

__all__ = ["OVERRIDE_ENV", "PUBLISHER_NAME", "VllmPublisher", "register"]

log = logging.getLogger("kvevents.integrations.vllm")

#: The name vLLM's ``kv_events_config.publisher`` selects this publisher by.
PUBLISHER_NAME = "kvevents"
#: Set to ``1`` to take vLLM's ``"zmq"`` name too (for vLLMs that reject other names).
OVERRIDE_ENV = "KVEVENTS_VLLM_OVERRIDE_ZMQ"

# The fields of vLLM's config that kvevents' config shares; a newer vLLM may send more.
_SHARED = ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")


class VllmPublisher:
    """vLLM's ``EventPublisher`` interface (``publish``, ``shutdown``) over a ``ZmqPublisher``."""

    # vLLM's config fields, any values, checked by the config.
    def __init__(self, data_parallel_rank: int = 0, **fields: Any) -> None:
        shared = {k: v for k, v in fields.items() if k in _SHARED}
        ignored = sorted(set(fields) - set(_SHARED))
        if ignored:
            log.info("kvevents publisher: vLLM config fields not used: %s", ignored)
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **shared)
        self.rank = data_parallel_rank
        # The layout check wants a world size; this rank's own endpoints are all it binds.
        self._publisher = ZmqPublisher(config, data_parallel_rank, world_size=self.rank + 1)
        self._encode = msgspec.msgpack.Encoder()
        self._publisher.start()

    # vLLM's KVEventBatch: its classes are not imported here.
    def publish(self, events: Any) -> None:
        """Publish one vLLM ``KVEventBatch``: encoded once, sent as vLLM's publisher sends it.

        vLLM's batch structs encode to the wire's payload (``docs/wire.md``), so nothing is
        decoded on the engine thread: decoding built a Python object per token id, thousands
        per prefill, on the thread that runs the engine; now a batch costs one ``bytes``, as
        vLLM's own publisher's does. The rank is stamped as vLLM's own publisher stamps it.
        """
        if getattr(events, "data_parallel_rank", 0) is None:
            events.data_parallel_rank = self.rank
        self._publisher.publish_encoded(self._encode.encode(events))

    def published_batches(self) -> int:
        """Sequence numbers allocated so far: the next batch gets this one."""
        return self._publisher.stats().next_seq

    def get_publisher_config(self) -> None:
        """vLLM asks for the resolved endpoints; None, as its base publisher answers."""
        return None

    def shutdown(self) -> None:
        self._publisher.shutdown()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the publisher to vLLM's factory.

    vLLM calls it once in each of its processes; calling it again is harmless. Outside vLLM it
    does nothing.
    """
    try:
        from vllm.distributed.kv_events import EventPublisherFactory
    except ImportError:
        return
    with contextlib.suppress(KeyError):  # registered already by this process
        EventPublisherFactory.register_publisher(PUBLISHER_NAME, VllmPublisher)
    if os.environ.get(OVERRIDE_ENV) == "1":
        # register_publisher refuses a taken name; the factory's registry is a plain dict.
        EventPublisherFactory._registry["zmq"] = VllmPublisher
