"""The HTTP index service behind ``kvevents serve``: an ASGI app (starlette) over the index.

Endpoints follow the shape users know from Dynamo's standalone KV indexer and the Mooncake KV
indexer API, so it can be swapped in:

- ``POST /register`` ``{worker_id | instance_id, endpoint, replay_endpoint?, block_size,
  ranks? | dp_size?, topic?, model_name?}``: index the worker's ranks and subscribe to them.
  ``endpoint`` and ``replay_endpoint`` are base endpoints (rank r uses base port + r).
- ``POST /unregister`` ``{worker_id | instance_id, rank? | dp_rank?}``: forget it entirely.
- ``POST /query`` ``{token_ids | block_hashes, policy?, block_size?, lora_name?}``: matched
  blocks per worker, rank and tier, and an explained routing decision.
- ``GET /dump``: every holder's blocks; ``GET /workers``: workers with their stream health;
  ``GET /metrics``: Prometheus text; ``GET /health``.

Events come from a *feed* (the :class:`kvevents.subscriber.Subscriber` by default, created
lazily): one background thread takes its items and applies them to the index under a lock
(a ``Delivery`` is applied, a ``StreamReset`` resets that stream). Queries take the same lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import msgspec
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._memory import IdleTrim, release_free_memory
from .index import IndexStats, PrefixIndex
from .router import Router

__all__ = [
    "Feed",
    "IndexService",
    "Server",
    "ServiceStats",
    "WorkerRegistration",
    "create_app",
    "serve",
]

log = logging.getLogger("kvevents.service")

# Seconds between checks whether a burst of batches is over (then free memory is trimmed).
_TRIM_TICK = 0.25


class Feed(Protocol):
    """What the service needs from an event source (the Subscriber has all of it)."""

    def add_stream(self, spec: Any) -> None: ...
    def remove_stream(self, worker_id: str, rank: int | None = None) -> None: ...
    def start(self) -> None: ...
    def close(self) -> None: ...
    def get(self, timeout: float | None = None) -> Any: ...
    def stats(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class WorkerRegistration:
    """A registered worker: where its ranks publish and how its blocks are sized."""

    worker_id: str
    endpoint: str
    block_size: int
    ranks: tuple[int, ...] = (0,)
    replay_endpoint: str | None = None
    topic: str = ""
    model_name: str | None = None


@dataclasses.dataclass(frozen=True)
class ServiceStats:
    """The feed consumer's counters."""

    deliveries: int  #: batches applied
    resets: int  #: stream resets applied
    ignored: int  #: items of workers (or ranks) no longer registered
    apply_errors: int  #: items that raised while applied (logged; the thread goes on)
    queries: int


def default_stream_specs(reg: WorkerRegistration) -> list[Any]:
    """Stream specs of a worker's ranks, built by ``kvevents.subscriber.worker_streams``."""
    subscriber = importlib.import_module("kvevents.subscriber")
    specs: list[Any] = subscriber.worker_streams(
        reg.worker_id, reg.endpoint, reg.replay_endpoint, ranks=list(reg.ranks), topic=reg.topic
    )
    return specs


def default_feed(callback: Callable[[Any], None] | None = None, options: Any | None = None) -> Feed:
    """A ``kvevents.subscriber.Subscriber`` with no streams yet.

    ``options`` (a ``SubscriberOptions``) are used as given, except that with ``callback``
    the subscriber calls it with every item on its I/O thread instead of queueing the item.
    """
    subscriber = importlib.import_module("kvevents.subscriber")
    base = options if options is not None else subscriber.SubscriberOptions()
    feed: Feed = subscriber.Subscriber(options=dataclasses.replace(base, callback=callback))
    return feed


class IndexService:
    """The index, a router, and the thread that feeds the index from a feed.

    The service owns its feed (passed in, or made by ``feed_factory`` on first use) and
    closes it in :meth:`close`. With neither, the feed is a Subscriber that applies each item
    on its own I/O thread through :meth:`consume` (no hand-off between threads, the fastest
    path), and the service starts no consumer thread. A feed that calls :meth:`consume` itself
    is passed with ``pushes=True``. ``subscriber_options`` (a ``SubscriberOptions``)
    configure that default subscriber (e.g. CurveZMQ keys).
    """

    def __init__(
        self,
        index: PrefixIndex | None = None,
        *,
        router: Router | None = None,
        feed: Feed | None = None,
        feed_factory: Callable[[], Feed] | None = None,
        pushes: bool = False,
        subscriber_options: Any | None = None,
        stream_specs: Callable[[WorkerRegistration], list[Any]] = default_stream_specs,
        policy: str = "prefix_load",
        poll_interval: float = 0.1,
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.router = router if router is not None else Router(self.index, policy)
        self.lock = threading.Lock()
        self._feed = feed
        self._feed_factory = feed_factory
        self._pushes = pushes
        self._subscriber_options = subscriber_options
        self._stream_specs = stream_specs
        self._poll = poll_interval
        self._workers: dict[str, WorkerRegistration] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = False
        self._counts = {
            "deliveries": 0,
            "resets": 0,
            "ignored": 0,
            "apply_errors": 0,
            "queries": 0,
        }

    @property
    def feed(self) -> Feed:
        if self._feed is None:
            if self._feed_factory is None:
                self._pushes = True
                self._feed = default_feed(self.consume, self._subscriber_options)
            else:
                self._feed = self._feed_factory()
        return self._feed

    @property
    def pushes(self) -> bool:
        """True when the feed applies items itself (through :meth:`consume`)."""
        return self._pushes

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the feed and, unless it pushes, the consumer thread (idempotent)."""
        if self._started:
            return
        self.feed.start()
        self._started = True
        if self._pushes:
            return
        self._thread = threading.Thread(target=self._run, name="kvevents-index", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop consuming and close the feed (idempotent)."""
        self._stop.set()
        if self._feed is not None:
            self._feed.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> IndexService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        feed = self.feed
        while not self._stop.is_set():
            try:
                item = feed.get(timeout=self._poll)
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("the feed failed; the index stops consuming it")
                return
            if item is not None:
                self.consume(item)

    def consume(self, item: Any) -> None:
        """Apply one feed item: a Delivery (``.batch``) or a StreamReset (``.reason``)."""
        stream = item.stream
        try:
            with self.lock:
                reg = self._workers.get(stream.worker_id)
                if reg is None or stream.rank not in reg.ranks:
                    # Queued before the worker was unregistered: applying it would bring
                    # the worker back as a ghost.
                    self._counts["ignored"] += 1
                elif hasattr(item, "batch"):
                    self.index.apply(stream.worker_id, stream.rank, item.batch)
                    self._counts["deliveries"] += 1
                else:
                    self.index.reset_stream(stream.worker_id, stream.rank)
                    self._counts["resets"] += 1
        except Exception:
            self._counts["apply_errors"] += 1
            log.exception("worker %s rank %s: item not applied", stream.worker_id, stream.rank)

    # ----------------------------------------------------------------- workers

    def register(self, reg: WorkerRegistration) -> list[Any]:
        """Index a worker's ranks and subscribe to them; re-registering replaces."""
        if reg.worker_id in self._workers:
            self.unregister(reg.worker_id)
        specs = self._stream_specs(reg)
        with self.lock:
            self.index.register_worker(reg.worker_id, block_size=reg.block_size, ranks=reg.ranks)
            self._workers[reg.worker_id] = reg
        for spec in specs:
            self.feed.add_stream(spec)
        return specs

    def unregister(self, worker_id: str, rank: int | None = None) -> bool:
        """Stop following a worker (or one rank) and drop its blocks. False if unknown."""
        reg = self._workers.get(worker_id)
        if reg is None or (rank is not None and rank not in reg.ranks):
            return False
        self.feed.remove_stream(worker_id, rank)
        with self.lock:
            self.index.remove_worker(worker_id, rank)
            self.router.loads.remove(worker_id, rank)
            if rank is None or reg.ranks == (rank,):
                del self._workers[worker_id]
            else:
                ranks = tuple(r for r in reg.ranks if r != rank)
                self._workers[worker_id] = dataclasses.replace(reg, ranks=ranks)
        return True

    def workers(self) -> list[WorkerRegistration]:
        return list(self._workers.values())

    # ----------------------------------------------------------------- reads

    def query(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[int] | None = None,
        block_size: int | None = None,
        lora: str | int | None = None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        """Matches per holder and a routing decision, JSON-ready."""
        with self.lock:
            if token_ids is not None:
                match = self.index.match(token_ids, lora=lora)
            elif block_hashes is not None:
                match = self.index.match_hashes(block_hashes, block_size=block_size)
            else:
                raise ValueError("query needs token_ids or block_hashes")
            decision = self.router.decide(match, policy=policy)
            self._counts["queries"] += 1
        scores: dict[str, dict[str, int]] = {}
        for (worker, rank), blocks in match.streams.items():
            scores.setdefault(worker, {})[str(rank)] = blocks
        return {
            "request_tokens": match.request_tokens,
            "request_blocks": {str(k): v for k, v in match.request_blocks.items()},
            "scores": scores,
            "matches": [
                {"worker_id": k.worker_id, "rank": k.rank, "tier": k.tier, "matched_blocks": v}
                for k, v in match.holders.items()
            ],
            "decision": decision.to_dict(),
        }

    def stats(self) -> ServiceStats:
        return ServiceStats(**self._counts)

    def index_stats(self) -> IndexStats:
        with self.lock:
            return self.index.stats()

    def stream_health(self) -> dict[tuple[str, int], Any]:
        """The feed's per-stream stats, when it has them (the Subscriber does)."""
        stream_stats = getattr(self.feed, "stream_stats", None)
        if stream_stats is None:
            return {}
        try:
            health: dict[tuple[str, int], Any] = stream_stats()
        except Exception:  # health is advisory; never fail /workers on it
            log.exception("the feed's stream_stats() failed")
            return {}
        return health

    def workers_view(self) -> list[dict[str, Any]]:
        """Workers with their per-rank index state and stream health (``GET /workers``)."""
        with self.lock:
            streams = {(s.worker_id, s.rank): s for s in self.index.streams()}
        health = self.stream_health()
        now = time.time()
        out = []
        for reg in self._workers.values():
            ranks = []
            for rank in reg.ranks:
                info = streams.get((reg.worker_id, rank))
                row: dict[str, Any] = {"rank": rank}
                if info is not None:
                    row.update(_builtins(info))
                    last = info.last_batch_ts
                    row["lag_seconds"] = None if last is None else max(0.0, now - last)
                row["stream"] = _builtins(health.get((reg.worker_id, rank)))
                ranks.append(row)
            out.append({**_builtins(reg), "ranks": ranks})
        return out

    def dump(self) -> dict[str, Any]:
        with self.lock:
            return {"holders": self.index.dump(), "stats": _builtins(self.index.stats())}


def _builtins(value: Any) -> Any:
    """Dataclasses, structs and named tuples as plain JSON-ready values."""
    return msgspec.to_builtins(value, builtin_types=None, str_keys=True)


# --------------------------------------------------------------------------- HTTP


class _Register(msgspec.Struct, kw_only=True):
    endpoint: str
    block_size: int
    worker_id: str | None = None
    instance_id: str | int | None = None
    replay_endpoint: str | None = None
    ranks: int | list[int] | None = None
    dp_size: int | None = None
    topic: str = ""
    model_name: str | None = None


class _Unregister(msgspec.Struct, kw_only=True):
    worker_id: str | None = None
    instance_id: str | int | None = None
    rank: int | None = None
    dp_rank: int | None = None


class _Query(msgspec.Struct, kw_only=True):
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    block_size: int | None = None
    policy: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    model_name: str | None = None


class _BadRequest(Exception):
    pass


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


async def _body(request: Request, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise _BadRequest(f"{request.url.path}: {exc}") from exc


def _worker_id(body: _Register | _Unregister) -> str:
    worker = body.worker_id if body.worker_id is not None else body.instance_id
    if worker is None:
        raise _BadRequest("worker_id (or instance_id) is required")
    return str(worker)


def _registration(body: _Register) -> WorkerRegistration:
    if body.block_size <= 0:
        raise _BadRequest(f"block_size must be positive, got {body.block_size}")
    count = body.ranks if body.ranks is not None else body.dp_size
    if isinstance(count, list):
        ranks = tuple(sorted(set(count)))
    else:
        ranks = tuple(range(count if count is not None else 1))
    if not ranks or min(ranks) < 0:
        raise _BadRequest(f"ranks must be a positive count or rank numbers, got {count}")
    return WorkerRegistration(
        worker_id=_worker_id(body),
        endpoint=body.endpoint,
        block_size=body.block_size,
        ranks=ranks,
        replay_endpoint=body.replay_endpoint,
        topic=body.topic,
        model_name=body.model_name,
    )


class _Api:
    """The HTTP handlers over one service."""

    def __init__(self, service: IndexService, collectors: Sequence[Any] = ()) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(service))
        for collector in collectors:
            self.registry.register(collector)

    async def register(self, request: Request) -> Response:
        reg = _registration(await _body(request, _Register))
        specs = self.service.register(reg)
        return _json({"worker_id": reg.worker_id, "ranks": list(reg.ranks), "streams": len(specs)})

    async def unregister(self, request: Request) -> Response:
        body = await _body(request, _Unregister)
        worker = _worker_id(body)
        rank = body.rank if body.rank is not None else body.dp_rank
        if not self.service.unregister(worker, rank):
            return _json({"error": f"unknown worker {worker!r} (rank {rank})"}, 404)
        return _json({"worker_id": worker, "removed": True})

    async def query(self, request: Request) -> Response:
        body = await _body(request, _Query)
        lora = body.lora_name if body.lora_name is not None else body.lora_id
        try:
            result = self.service.query(
                body.token_ids,
                block_hashes=body.block_hashes,
                block_size=body.block_size,
                lora=lora,
                policy=body.policy,
            )
        except (ValueError, OverflowError) as exc:
            raise _BadRequest(f"/query: {exc}") from exc
        return _json(result)

    async def dump(self, request: Request) -> Response:
        return _json(self.service.dump())

    async def workers(self, request: Request) -> Response:
        return _json({"workers": self.service.workers_view()})

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok", "workers": len(self.service.workers())})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    @staticmethod
    async def bad_request(request: Request, exc: Exception) -> Response:
        return _json({"error": str(exc)}, 400)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.service.start()
        trimmer = asyncio.create_task(self._trim_when_idle())
        try:
            yield
        finally:
            trimmer.cancel()
            self.service.close()

    async def _trim_when_idle(self) -> None:
        """After a burst of batches, hand the memory it passed through back to the OS."""
        idle = IdleTrim()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_TRIM_TICK)
            if idle.due(self.service.stats().deliveries):
                await loop.run_in_executor(None, release_free_memory)


def create_app(service: IndexService, *, collectors: Sequence[Any] = ()) -> Starlette:
    """The ASGI app. Its lifespan starts the service and closes it at shutdown.

    ``collectors`` (prometheus-client collectors, e.g. ``kvevents.metrics.subscriber_collector``)
    are served by ``GET /metrics`` next to the index's own metrics.
    """
    api = _Api(service, collectors)
    routes = [
        Route("/register", api.register, methods=["POST"]),
        Route("/unregister", api.unregister, methods=["POST"]),
        Route("/query", api.query, methods=["POST"]),
        Route("/dump", api.dump, methods=["GET"]),
        Route("/workers", api.workers, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={_BadRequest: api.bad_request}, lifespan=api.lifespan
    )


class _Collector:
    """Reads the index and service stats at scrape time: nothing on the hot path."""

    def __init__(self, service: IndexService) -> None:
        self._service = service

    def collect(self) -> Any:
        stats = self._service.index_stats()
        for name, help_text in _GAUGES.items():
            yield GaugeMetricFamily(f"kvevents_index_{name}", help_text, value=getattr(stats, name))
        for name, help_text in _COUNTERS.items():
            yield CounterMetricFamily(
                f"kvevents_index_{name}", help_text, value=getattr(stats, name)
            )
        yield GaugeMetricFamily(
            "kvevents_index_bytes_per_block",
            "Estimated bytes per indexed block",
            stats.bytes_per_block,
        )
        service = self._service.stats()
        for name in ("deliveries", "resets", "ignored", "apply_errors", "queries"):
            yield CounterMetricFamily(
                f"kvevents_service_{name}",
                f"Feed items and queries: {name}",
                value=getattr(service, name),
            )
        yield self._tier_blocks()

    def _tier_blocks(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "kvevents_index_worker_blocks",
            "Blocks held per worker, rank and tier",
            labels=["worker_id", "rank", "tier"],
        )
        with self._service.lock:
            streams = self._service.index.streams()
        for info in streams:
            for tier, blocks in info.tiers.items():
                family.add_metric([info.worker_id, str(info.rank), tier], blocks)
        return family


_GAUGES = {
    "streams": "Streams (worker, rank) known to the index",
    "holders": "Holders (worker, rank, tier) known to the index",
    "blocks": "Distinct blocks indexed",
    "entries": "(holder, block) pairs indexed",
    "orphans_held": "Blocks held until their parent arrives",
    "bytes_estimate": "Estimated bytes held by the index",
}
_COUNTERS = {
    "stored_blocks": "Block store events applied",
    "removed_blocks": "Block removal events applied",
    "duplicate_stores": "Stores of a block its holder already had",
    "unknown_removals": "Removals of blocks never seen",
    "orphans_placed": "Held blocks placed once their parent arrived",
    "orphans_dropped": "Held blocks dropped (bound, clear, reset)",
    "block_size_mismatches": "Store events refused for a block size other than the worker's",
    "bad_events": "Store events skipped for a token count that does not match",
    "clears": "AllBlocksCleared events applied",
    "stream_resets": "Stream resets applied",
}


class Server:
    """A uvicorn server on a background thread, bound before it starts (port 0 works).

    ``port`` and ``url`` are known as soon as the object exists; :meth:`start` returns once
    the server accepts connections; :meth:`close` stops it; :meth:`wait` blocks until it stops.
    """

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
        # without it Nagle's algorithm and delayed ACKs add 40 ms to every response.
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"cannot bind http://{host}:{port}: {exc.strerror}") from exc
        self._sock.listen(1024)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
        self._server = uvicorn.Server(config)
        self._failure: BaseException | None = None
        # Set when the server thread ends. Not Thread.is_alive(): on Python 3.11 a Ctrl-C that
        # interrupts Thread.join() can leave is_alive() False while the thread still runs, and
        # the service would then never be shut down.
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvevents-http", daemon=True)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # uvicorn exits with SystemExit when startup fails
            self._failure = exc
        finally:
            self._done.set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> Server:
        """Run the server; return once it accepts connections (errors close the socket)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._done.is_set():
                self.close()
                raise RuntimeError(
                    f"the HTTP server on {self.url} stopped during startup ({self._failure!r})"
                )
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the HTTP server on {self.url} did not start in {timeout} s")
            time.sleep(0.005)
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.ident is not None:
            self._done.wait(timeout)
        self._sock.close()

    def wait(self) -> None:
        try:
            while not self._done.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    service: IndexService | None = None,
    collectors: Sequence[Any] = (),
    **service_options: Any,
) -> Server:
    """Start the index service over HTTP in the background; returns the started server.

    ``service_options`` go to :class:`IndexService` when no service is given. Call
    ``server.wait()`` to block (the CLI does), ``server.close()`` to stop.
    """
    service = service if service is not None else IndexService(**service_options)
    server = Server(create_app(service, collectors=collectors), host, port)
    try:
        service.start()  # here, so that a feed that cannot start raises in the caller
    except BaseException:
        server.close()
        raise
    return server.start()
