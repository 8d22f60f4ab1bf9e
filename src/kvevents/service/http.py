"""The HTTP index service behind ``kvevents serve``: an ASGI app (starlette) over an
:class:`~kvevents.service.core.IndexService`.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvevents.index.keys import pack_tokens
from kvevents.metrics import CollectorGroup, StatsCollector
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.memory import IdleTrim, release_free_memory

__all__ = ["Server", "create_app", "serve"]

log = logging.getLogger("kvevents.service.core")

# Seconds between checks whether a burst of batches is over (then free memory is trimmed).
_TRIM_TICK = 0.25


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


class _QueryPacked(_Query, kw_only=True):
    """``_Query`` with ``token_ids`` left as JSON text, for a packer that reads it directly."""

    token_ids: msgspec.Raw = msgspec.Raw()  # type: ignore[assignment]


class _BadRequest(Exception):
    pass


_query_decoder = msgspec.json.Decoder(_Query)
_query_packed_decoder = msgspec.json.Decoder(_QueryPacked)
_encoder = msgspec.json.Encoder()
_NULL = b"null"
_TOKEN_MAX = 2**32 - 1

#: Reads a JSON array of token ids into packed uint32 little-endian bytes; None if it is not one.
JsonPacker = Callable[[bytes], "bytes | None"]
#: Finds a top-level member of a JSON object and packs it: (packed, start, end) or None.
MemberPacker = Callable[[bytes, bytes], "tuple[bytes, int, int] | None"]


def _json_packer() -> JsonPacker | None:
    """The block table's ``pack_json_tokens`` when it is native code, else None.

    The pure-Python packer decodes the array into ints anyway, and doing that together with
    the rest of the body is cheaper than a second pass over it, so the lean path then decodes
    ``token_ids`` as a list.
    """
    try:
        primitives = importlib.import_module("kvevents.index.table")
    except ImportError:
        return None
    if getattr(primitives, "IMPLEMENTATION", "python") == "python":
        return None
    packer: JsonPacker = primitives.pack_json_tokens
    return packer


def _member_packer() -> MemberPacker | None:
    """The block table's ``pack_json_member`` when it is native code, else None."""
    if _json_packer() is None:
        return None
    packer: MemberPacker = importlib.import_module("kvevents.index.table").pack_json_member
    return packer


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
        self.pack_json = _json_packer()
        self.pack_member = _member_packer()
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
        return _json(self.answer_query(await request.body()))

    def answer_query(self, body: bytes) -> dict[str, Any]:
        """The answer to a ``POST /query`` body; ``_BadRequest`` naming what is wrong."""
        query, packed = self._read_query(body)
        lora = query.lora_name if query.lora_name is not None else query.lora_id
        try:
            return self.service.query(
                packed=packed,
                block_hashes=query.block_hashes,
                block_size=query.block_size,
                lora=lora,
                policy=query.policy,
            )
        except (ValueError, OverflowError) as exc:
            raise _BadRequest(f"/query: {exc}") from exc

    def _read_query(self, body: bytes) -> tuple[_Query | _QueryPacked, bytes | None]:
        """The decoded query and its tokens packed as uint32 LE (None without token_ids)."""
        try:
            if self.pack_json is None:
                query = _query_decoder.decode(body)
                if query.token_ids is None:
                    return query, None
                try:
                    return query, pack_tokens(query.token_ids)
                except OverflowError:
                    raise _BadRequest(_token_range_error(query.token_ids)) from None
            if self.pack_member is not None:
                # token_ids found and packed in one pass; the small rest of the body is
                # decoded as usual (a repeated token_ids shows up there: the full path reads it).
                found = self.pack_member(body, b"token_ids")
                if found is not None:
                    packed, start, end = found
                    rest = _query_packed_decoder.decode(body[:start] + _NULL + body[end:])
                    if bytes(rest.token_ids) == _NULL:
                        return rest, packed
            packed_query = _query_packed_decoder.decode(body)
            raw = packed_query.token_ids
            if not raw or (len(raw) == len(_NULL) and bytes(raw) == _NULL):
                return packed_query, None
            tokens = self.pack_json(raw)
            if tokens is None:
                raise _BadRequest(_token_ids_error(body))
            return packed_query, tokens
        except msgspec.DecodeError as exc:  # ValidationError is a subclass
            raise _BadRequest(f"/query: {exc}") from exc

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
        # Answered by _LeanQuery; the route still gives other methods their 405.
        Route("/query", api.query, methods=["POST"]),
        Route("/dump", api.dump, methods=["GET"]),
        Route("/workers", api.workers, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(_LeanQuery, api=api)],
        exception_handlers={_BadRequest: api.bad_request},
        lifespan=api.lifespan,
    )


def _token_ids_error(body: bytes) -> str:
    """Why ``token_ids`` is not an array of uint32 token ids (a packer only says it is not)."""
    try:
        tokens = _query_decoder.decode(body).token_ids or []
    except msgspec.DecodeError as exc:
        return f"/query: {exc}"
    return _token_range_error(tokens)


def _token_range_error(tokens: list[int]) -> str:
    for i, token in enumerate(tokens):
        if not 0 <= token <= _TOKEN_MAX:
            return f"/query: token id {token} at `$.token_ids[{i}]` is outside 0..{_TOKEN_MAX}"
    return "/query: token_ids must be an array of token ids"


class _LeanQuery:
    """ASGI middleware answering ``POST /query`` itself, the hot route of the service.

    Starlette's routing and its Request and Response objects cost about as much as the
    query itself; everything else goes on to the Starlette app.
    """

    def __init__(self, app: ASGIApp, api: _Api) -> None:
        self.app = app
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/query" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client went away
        try:
            status, payload = 200, _encoder.encode(self.api.answer_query(body))
        except _BadRequest as exc:
            status, payload = 400, _encoder.encode({"error": str(exc)})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(payload)),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class _Collector:
    """Reads the index and service stats at scrape time: nothing on the hot path."""

    def __init__(self, service: IndexService) -> None:
        self._service = service
        self._stats = CollectorGroup(
            [
                StatsCollector("kvevents_index", lambda: [({}, service.index_stats())], _HELP),
                StatsCollector("kvevents_service", lambda: [({}, service.stats())], _HELP),
            ]
        )

    def collect(self) -> Any:
        yield from self._stats.collect()
        yield GaugeMetricFamily(
            "kvevents_index_bytes_per_block",
            "Estimated bytes per indexed block",
            self._service.index_stats().bytes_per_block,
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


# HELP texts of the index and service stats fields (the kinds come from the records).
_HELP = {
    "streams": "Streams (worker, rank) known to the index",
    "holders": "Holders (worker, rank, tier) known to the index",
    "blocks": "Distinct blocks indexed",
    "entries": "(holder, block) pairs indexed",
    "orphans_held": "Blocks held until their parent arrives",
    "bytes_estimate": "Estimated bytes held by the index",
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
    "deliveries": "Batches applied from the feed",
    "resets": "Stream resets received from the feed",
    "ignored": "Feed items of workers no longer registered",
    "apply_errors": "Feed items that raised while applied",
    "queries": "Queries answered",
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
        # No proxy-headers layer: client addresses are only used by the access log, and that
        # is off (each layer costs every request).
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", access_log=False, proxy_headers=False
        )
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
