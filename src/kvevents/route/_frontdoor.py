"""The front door put together: engines, their event streams, the index, the planner, the proxy.

:class:`FrontDoor` is what ``kvevents route`` runs. Each engine (:class:`EngineSpec`) is one
OpenAI server; each of its data parallel ranks is a target of its own, asked for with vLLM's
rank header. An engine with an event stream is registered in the index service as a worker
named like the engine (rank r publishes on the base port + r, WIRE.md section 5); one without
is routed on load and the front door's own predictions alone. With a JetStream replica
(``kvevents route --nats``) the index comes from the replicas' stream instead, where the relay
registered the workers under the engines' names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvevents._types import Document
from kvevents.events import StreamKey
from kvevents.http import Server
from kvevents.index import LoadBook, PrefixIndex, Router, StreamInfo
from kvevents.metrics import StatsCollector
from kvevents.route._engines import Engine, EnginePool
from kvevents.route._options import ProxyOptions
from kvevents.route._plan import IndexPlanner, PlannerOptions
from kvevents.route._proxy import RouteApp
from kvevents.route._status import status_pages
from kvevents.route._tokens import ModelTokenizer
from kvevents.service import IndexService, WorkerRegistration

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = ["EngineSpec", "FrontDoor"]

log = logging.getLogger("kvevents.route")


@dataclass(frozen=True)
class EngineSpec:
    """One engine behind the front door.

    ``url``: its OpenAI server; ``name``: its id in the index and the ``x-kvevents-engine``
    header (default: the URL). ``events`` / ``replay``: the base endpoints of its KV event
    stream and replay socket (None: no stream, routed on load alone). ``ranks``: its data
    parallel ranks (each routed to on its own). ``block_size``: its block size (None: the
    front door's). ``topic``: its event topic. ``cache_blocks``: the blocks its KV cache holds
    per rank (None: as its ``/metrics`` says, where it does).
    """

    url: str
    name: str | None = None
    events: str | None = None
    replay: str | None = None
    ranks: int = 1
    block_size: int | None = None
    topic: str = ""
    cache_blocks: int | None = None

    @property
    def worker_id(self) -> str:
        return self.name if self.name is not None else self.url.rstrip("/")

    def engines(self) -> list[Engine]:
        """The pool's engines of this spec: one, or one per data parallel rank."""
        blocks = self.cache_blocks
        if self.ranks == 1:
            return [Engine(self.url, self.worker_id, cache_blocks=blocks)]
        return [
            Engine(self.url, f"{self.worker_id}#rank{r}", rank=r, cache_blocks=blocks)
            for r in range(self.ranks)
        ]


@dataclass
class FrontDoor:
    """``kvevents route``: see the module docstring. :meth:`start` returns once the server
    accepts connections (and the engines had their first health check); :meth:`close`."""

    engines: Sequence[EngineSpec]
    tokenizers: Mapping[str | None, ModelTokenizer]
    host: str = "127.0.0.1"
    port: int = 0
    planner_options: PlannerOptions = field(default_factory=PlannerOptions)
    proxy_options: ProxyOptions = field(default_factory=ProxyOptions)
    health_interval: float = 2.0
    health_timeout: float = 1.0
    service: IndexService | None = None
    collectors: Sequence[Collector] = ()
    server: Server | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        names = [spec.worker_id for spec in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        pool_engines = [engine for spec in self.engines for engine in spec.engines()]
        self.pool = EnginePool(
            pool_engines, interval=self.health_interval, timeout=self.health_timeout
        )
        if self.service is None:
            index = PrefixIndex()
            router = Router(index, self.planner_options.policy, loads=LoadBook())
            self.service = IndexService(index, router=router)
        self.planner = IndexPlanner(
            self.service,
            self.pool,
            self.tokenizers,
            self._targets(),
            options=self.planner_options,
            block_sizes={
                (spec.worker_id, rank): spec.block_size
                for spec in self.engines
                if spec.block_size is not None
                for rank in range(spec.ranks)
            },
        )
        self.started_at = time.time()
        self.app = RouteApp(
            self.pool,
            self.planner,
            options=self.proxy_options,
            collectors=[*self._collectors(), *self.collectors],
            pages=status_pages(self),
            health_details=self.health_details,
        )

    def _targets(self) -> dict[str, StreamKey]:
        out: dict[str, StreamKey] = {}
        for spec in self.engines:
            for engine in spec.engines():
                out[engine.id] = (spec.worker_id, engine.rank or 0)
        return out

    def _collectors(self) -> list[StatsCollector]:
        planner = self.planner
        prefix = "kvevents_route_planner"
        return [
            StatsCollector(prefix, lambda: [({}, planner.stats().counts)]),
            StatsCollector(prefix, lambda: [({}, planner.stats().levels)]),
        ]

    # ------------------------------------------------------------------ lifecycle

    def registrations(self) -> list[WorkerRegistration]:
        """The workers of the engines that publish events (what the index follows)."""
        size = self.planner_options.block_size
        return [
            WorkerRegistration(
                spec.worker_id,
                spec.events,
                spec.block_size or size,
                tuple(range(spec.ranks)),
                spec.replay,
                spec.topic,
            )
            for spec in self.engines
            if spec.events is not None
        ]

    def start(self, *, register: bool = True) -> FrontDoor:
        """Follow the engines' streams (unless ``register`` is False: a replica's index),
        then serve."""
        assert self.service is not None
        self.service.start()
        try:
            if register:
                for reg in self.registrations():
                    self.service.register(reg, persist=False)
            self.server = Server(
                self.app, self.host, self.port, limits=self.proxy_options.limits
            ).start()
        except BaseException:
            self.service.close()
            raise
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.service is not None:
            self.service.close()

    def __enter__(self) -> FrontDoor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        assert self.server is not None, "start() first"
        return self.server.url

    # ------------------------------------------------------------------ views

    def streams_view(self) -> list[Document]:
        """Each engine target's event stream: state, lag, blocks, why it gets no credit."""
        assert self.service is not None
        health = self.service.stream_health()
        infos = {(s.worker_id, s.rank): s for s in self.service.stream_infos()}
        degraded = self.service.degraded()
        now = time.time()
        out = []
        for engine_id, target in self.planner.targets.items():
            stats = health.get(target)
            info = infos.get(target)
            why = degraded.get(target) or self.planner.stale.get(target)
            out.append(
                {
                    "engine": engine_id,
                    "worker_id": target[0],
                    "rank": target[1],
                    "state": "none" if stats is None else stats.state,
                    "lag_seconds": _lag(info, now),
                    "blocks": 0 if info is None else sum(info.tiers.values()),
                    "batches": 0 if info is None else info.batches,
                    "no_credit": why,
                }
            )
        return out

    def health_details(self) -> Document:
        """``GET /health``'s view of the streams: degraded when one gets no credit."""
        streams = self.streams_view()
        untrusted = [s for s in streams if s["no_credit"] is not None]
        details: Document = {"streams": streams}
        if untrusted:
            details["streams_without_credit"] = [s["engine"] for s in untrusted]
            if self.pool.healthy():
                details["status"] = "degraded"
        return details


def _lag(info: StreamInfo | None, now: float) -> float | None:
    last = None if info is None else info.last_batch_ts
    return None if last is None else round(max(0.0, now - last), 3)
