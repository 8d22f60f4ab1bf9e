"""The index service: an index fed by a subscriber, a router on it, under one lock.

:class:`IndexService` needs only the core install. Its HTTP API (``create_app``, ``Server``,
``serve`` and their options) is the layer above, :mod:`kvevents.http` (the ``service`` extra).

Besides the service (:class:`IndexService`, :class:`ServiceStats`): what a worker registers
(:class:`WorkerRegistration`, :class:`OwnEndpoints`) and the field bounds every source of one is
held to (:data:`BlockSize`, :data:`Rank`, ...); the service's feed (:func:`subscriber_feed`,
:func:`default_stream_specs`); its state file (:class:`StateFile`); its records of load reports
and routed queries (:class:`LoadReport`, :class:`RoutedQuery`, :class:`HitBucket`); idle memory
trimming (:class:`IdleTrim`). Its modules are private (``_core``, ``_feed``...): import from
here.
"""

from __future__ import annotations

from kvevents.service._bounds import BlockSize, EndpointText, Name, Rank, RankCount, Text
from kvevents.service._core import IndexService
from kvevents.service._decisions import DecisionLog, HitBucket, RoutedQuery
from kvevents.service._feed import (
    OwnEndpoints,
    ServiceStats,
    WorkerRegistration,
    default_stream_specs,
    subscriber_feed,
)
from kvevents.service._loadreports import LoadLedger, LoadReport
from kvevents.service._memory import IdleTrim, release_free_memory
from kvevents.service._state import (
    StateFile,
    StateFileError,
    decode_registrations,
    encode_registrations,
)

__all__ = [
    "BlockSize",
    "DecisionLog",
    "EndpointText",
    "HitBucket",
    "IdleTrim",
    "IndexService",
    "LoadLedger",
    "LoadReport",
    "Name",
    "OwnEndpoints",
    "Rank",
    "RankCount",
    "RoutedQuery",
    "ServiceStats",
    "StateFile",
    "StateFileError",
    "Text",
    "WorkerRegistration",
    "decode_registrations",
    "default_stream_specs",
    "encode_registrations",
    "release_free_memory",
    "subscriber_feed",
]
