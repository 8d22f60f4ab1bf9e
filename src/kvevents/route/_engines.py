"""The engines behind the front door: who they are, what they serve, whether they are up.

An :class:`Engine` is one OpenAI-compatible server (a ``vllm serve``), known by its base URL.
The :class:`EnginePool` keeps their health two ways:

- actively: ``GET /health`` every ``interval`` seconds, each bounded by ``timeout``; an engine
  whose check passes after it was down (or at start) has its ``GET /v1/models`` read again
  before it takes requests. A check that times out on an engine that answered a request since
  the previous check began is slow, not failed (counted, the engine stays in): on a saturated
  host every engine's ``/health`` can miss its deadline at once while all of them serve, and
  taking them all out would refuse every request;
- passively: the proxy calls :meth:`EnginePool.mark_down` on a connect error or a 5xx, which
  takes the engine out of routing at once and checks it again at once, so an engine that only
  failed one request (its ``/health`` passes) is back within a round trip, and a dead one stays
  out until a check passes.

Observers (:meth:`EnginePool.subscribe`) hear every change of state, e.g. a planner dropping
a dead engine's cache credit. Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import msgspec

from kvevents._types import Document
from kvevents.route._client import EngineClient, UpstreamError
from kvevents.route._replies import OpenAIError

__all__ = [
    "Engine",
    "EngineCounts",
    "EnginePool",
    "EngineState",
    "EngineStats",
    "cache_blocks",
]

log = logging.getLogger("kvevents.route.engines")


class EngineState(enum.Enum):
    """``unknown``: not checked yet; ``up``: takes requests; ``down``: out of routing."""

    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass
class EngineCounts:
    """What happened with one engine, counted by the proxy and the health checks."""

    requests: int = 0  #: requests sent to this engine (every attempt)
    connect_errors: int = 0  #: attempts that found no connection (refused, unreachable, timed out)
    http_errors: int = 0  #: attempts answered with a 5xx before any byte went to the client
    timeouts: int = 0  #: attempts with no answer, or no body data, within their timeout
    resets: int = 0  #: attempts whose connection was lost before or during the answer
    too_large: int = 0  #: answers over the size limit of an answer that is not streamed
    client_gone: int = 0  #: attempts cancelled because the client went away
    marked_down: int = 0  #: times taken out of routing (a failed check or a failed request)
    checks_failed: int = 0  #: health checks that did not pass
    checks_slow: int = 0  #: checks that timed out while the engine answered requests (kept in)


@dataclass(frozen=True)
class EngineStats:
    """One engine now: ``up``, ``in_flight`` and a copy of its ``counts``
    (``kvevents_route_engine_*`` metrics, labelled ``engine``)."""

    GAUGES: ClassVar[frozenset[str]] = frozenset({"up", "in_flight"})

    up: bool  #: 1 while the engine takes requests
    in_flight: int  #: requests sent to it and not finished
    counts: EngineCounts


class _ModelCard(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[msgspec.Raw]


_card_decoder = msgspec.json.Decoder(_ModelCard)
_list_decoder = msgspec.json.Decoder(_ModelList)


class Engine:
    """One engine: ``id`` (default: its URL, with ``#rank`` and the rank for one data parallel
    rank; the ``x-kvevents-engine`` header), ``url`` (its base URL), ``rank`` (the data
    parallel rank its requests ask for, None: the engine chooses), ``models`` (the ids its ``GET /v1/models`` listed; ``listed``: once it was
    read) and ``cards`` (those entries as it sent them), ``state`` and ``reason`` (why it is down), ``in_flight``
    (requests on it now) and ``counts``."""

    __slots__ = (
        "answered_at",
        "cache_blocks",
        "cache_given",
        "cards",
        "checked_at",
        "counts",
        "id",
        "in_flight",
        "listed",
        "models",
        "rank",
        "reason",
        "since",
        "state",
        "url",
    )

    def __init__(
        self,
        url: str,
        id: str | None = None,
        *,
        rank: int | None = None,
        cache_blocks: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL {url!r}: expected http://HOST:PORT or https://...")
        if rank is not None and rank < 0:
            raise ValueError(f"engine {url!r}: rank must be >= 0, got {rank}")
        self.rank = rank
        default = self.url if rank is None else f"{self.url}#rank{rank}"
        self.id = id if id is not None else default
        self.models: frozenset[str] = frozenset()
        self.cards: tuple[msgspec.Raw, ...] = ()
        self.listed = False  # its models were read at least once
        self.state = EngineState.UNKNOWN
        self.reason: str | None = "not checked yet"
        self.since = time.monotonic()  # when the state last changed
        self.in_flight = 0
        self.counts = EngineCounts()
        #: When (monotonic) the engine last sent a request's first byte, and when its last
        #: health check began: a check timing out after the engine answered is only slow.
        self.answered_at = -1.0
        self.checked_at = 0.0
        if cache_blocks is not None and cache_blocks < 1:
            raise ValueError(f"engine {url!r}: cache blocks must be >= 1, got {cache_blocks}")
        #: The blocks its KV cache can hold (None: not known): as given, else as its
        #: ``/metrics`` said when it came up (vLLM's ``num_gpu_blocks``, less its null block).
        self.cache_blocks = cache_blocks
        self.cache_given = cache_blocks is not None

    @property
    def up(self) -> bool:
        return self.state is EngineState.UP

    def stats(self) -> EngineStats:
        return EngineStats(self.up, self.in_flight, dataclasses.replace(self.counts))

    def view(self) -> Document:
        """JSON-ready: id, url, state, reason, models, seconds in this state, in flight."""
        return {
            "id": self.id,
            "url": self.url,
            "rank": self.rank,
            "state": self.state.value,
            "reason": self.reason,
            "models": sorted(self.models),
            "for_s": round(time.monotonic() - self.since, 3),
            "in_flight": self.in_flight,
            "cache_blocks": self.cache_blocks,
        }

    def __repr__(self) -> str:
        return f"Engine({self.url!r}, id={self.id!r}, state={self.state.value})"


Observer = Callable[[Engine], None]


class EnginePool:
    """The engines, their health checks and the observers of their state.

    ``engines``: URLs or :class:`Engine` objects (ids must be unique). ``interval``: seconds
    between health checks of each engine; ``timeout``: the bound on each check (and on its
    ``GET /v1/models``). :meth:`start` runs the first round and returns when it is done.
    """

    def __init__(
        self, engines: Iterable[str | Engine], *, interval: float = 2.0, timeout: float = 1.0
    ) -> None:
        self.engines: tuple[Engine, ...] = tuple(
            e if isinstance(e, Engine) else Engine(e) for e in engines
        )
        if not self.engines:
            raise ValueError("an engine pool needs at least one engine")
        ids = [e.id for e in self.engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        if interval <= 0 or timeout <= 0:
            raise ValueError("health check interval and timeout must be > 0")
        self.interval = interval
        self.timeout = timeout
        self._by_id = {e.id: e for e in self.engines}
        self._observers: list[Observer] = []
        self._wake = {e.id: asyncio.Event() for e in self.engines}
        self._tasks: list[asyncio.Task[None]] = []
        self._client: EngineClient | None = None

    # ------------------------------------------------------------------ reading

    def get(self, engine_id: str) -> Engine | None:
        return self._by_id.get(engine_id)

    def healthy(self, model: str | None = None) -> list[Engine]:
        """The engines up now (serving ``model``, when one is named), in pool order."""
        if model is None:
            return [e for e in self.engines if e.state is EngineState.UP]
        return [e for e in self.engines if e.state is EngineState.UP and model in e.models]

    def unavailable(self, model: str | None) -> OpenAIError | None:
        """Why no engine can take a request for ``model`` now, or None if one can: 404 when
        every engine's models are known and none serves it, else 503."""
        if self.healthy(model):
            return None
        if model is not None and not self._may_serve(model):
            return OpenAIError(
                404, f"the model `{model}` does not exist", param="model", code="model_not_found"
            )
        which = "no engine is healthy" if model is None else f"no healthy engine serves `{model}`"
        return OpenAIError(503, f"{which} right now", code="no_healthy_engine")

    def _may_serve(self, model: str) -> bool:
        # An engine whose models were never read (down since start) may serve it.
        return any(model in e.models or not e.listed for e in self.engines)

    def model_cards(self) -> list[msgspec.Raw]:
        """The healthy engines' model entries, one per model id (the first engine's)."""
        seen: set[str] = set()
        cards: list[msgspec.Raw] = []
        for engine in self.healthy():
            for card in engine.cards:
                model = _card_decoder.decode(card).id
                if model not in seen:
                    seen.add(model)
                    cards.append(card)
        return cards

    # ------------------------------------------------------------------ changing state

    def subscribe(self, observer: Observer) -> None:
        """Call ``observer(engine)`` on the event loop after each change of an engine's state."""
        self._observers.append(observer)

    def mark_down(self, engine: Engine, reason: str) -> None:
        """Take ``engine`` out of routing now (a failed request) and check it again at once."""
        if engine.state is EngineState.UP:
            self._set(engine, EngineState.DOWN, reason)
            self._wake[engine.id].set()

    def _set(self, engine: Engine, state: EngineState, reason: str | None) -> None:
        if state is EngineState.DOWN:
            engine.reason = reason
        if engine.state is state:
            return
        previous, engine.state, engine.since = engine.state, state, time.monotonic()
        engine.reason = reason if state is EngineState.DOWN else None
        if state is EngineState.DOWN:
            engine.counts.marked_down += 1
            log.warning("engine %s is down: %s", engine.id, reason)
        elif previous is EngineState.DOWN:
            log.warning("engine %s is up again", engine.id)
        for observer in self._observers:
            try:
                observer(engine)
            except Exception:  # an observer's bug must not stop the health checks
                log.exception("an engine state observer failed on %s", engine.id)

    # ------------------------------------------------------------------ checks

    async def start(self, client: EngineClient) -> None:
        """Check every engine once (concurrently) over ``client``, then keep checking in the
        background."""
        self._client = client
        await asyncio.gather(*(self.check(engine) for engine in self.engines))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch(engine)) for engine in self.engines]

    async def aclose(self) -> None:
        """Stop the health checks."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _watch(self, engine: Engine) -> None:
        wake = self._wake[engine.id]
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), self.interval)
            wake.clear()
            await self.check(engine)

    async def check(self, engine: Engine) -> bool:
        """One health check of ``engine`` (and its models when it comes up); True if it passed
        (or was only slow: see the module docstring)."""
        previous, engine.checked_at = engine.checked_at, time.monotonic()
        failure = await self._probe(engine, "/health")
        if failure is None and engine.state is not EngineState.UP:
            failure = await self._read_models(engine)
            if failure is None and not engine.cache_given:
                await self._read_cache(engine)
        if failure is None:
            self._set(engine, EngineState.UP, None)
            return True
        if failure.timed_out and engine.up and engine.answered_at >= previous:
            engine.counts.checks_slow += 1
            log.debug("engine %s: %s, but it answers requests: kept", engine.id, failure.reason)
            return True
        engine.counts.checks_failed += 1
        self._set(engine, EngineState.DOWN, failure.reason)
        return False

    async def _probe(self, engine: Engine, path: str) -> _Failure | None:
        """None if ``GET path`` answers 200 within the timeout, else what went wrong."""
        body = await self._get(engine, path)
        return body if isinstance(body, _Failure) else None

    async def _read_models(self, engine: Engine) -> _Failure | None:
        body = await self._get(engine, "/v1/models")
        if isinstance(body, _Failure):
            return body
        try:
            cards = _list_decoder.decode(body).data
            models = frozenset(_card_decoder.decode(card).id for card in cards)
        except msgspec.DecodeError as exc:
            return _Failure(f"GET /v1/models: not an OpenAI model list ({exc})")
        engine.cards, engine.models, engine.listed = tuple(cards), models, True
        return None

    async def _read_cache(self, engine: Engine) -> None:
        """The engine's cache size from its ``/metrics``, where it says (vLLM does); not
        knowing it is no failure: the engine is routed without a cache bound."""
        body = await self._get(engine, "/metrics")
        blocks = None if isinstance(body, _Failure) else cache_blocks(body, engine.rank)
        if blocks is None:
            log.debug("engine %s: its cache size is not known", engine.id)
        engine.cache_blocks = blocks

    async def _get(self, engine: Engine, path: str) -> bytes | _Failure:
        """The body of a 200 answer to ``GET path``, or why there is none."""
        assert self._client is not None, "the pool is not started"
        try:
            status, body = await self._client.fetch(engine.url + path, timeout=self.timeout)
        except UpstreamError as exc:
            if exc.kind == "timeout":
                return _Failure(f"GET {path} did not answer within {self.timeout:g} s", True)
            return _Failure(f"GET {path} failed: {exc.reason}")
        if status != 200:
            return _Failure(f"GET {path} answered {status}")
        return body


_CACHE_INFO = re.compile(rb"^vllm:cache_config_info\{(.*)\}\s", re.MULTILINE)
_LABEL = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')


def cache_blocks(metrics: bytes, rank: int | None = None) -> int | None:
    """The blocks a vLLM engine's KV cache holds for requests, from its Prometheus text
    (``vllm:cache_config_info``'s ``num_gpu_blocks``, less the one block vLLM keeps back as
    its null block); the line of data parallel ``rank`` where each rank has one. None when
    the text does not say."""
    found = None
    for match in _CACHE_INFO.finditer(metrics):
        labels = dict(_LABEL.findall(match.group(1)))
        try:
            blocks = int(labels.get(b"num_gpu_blocks", b""))
        except ValueError:
            continue
        if blocks < 2:
            continue
        if rank is None or labels.get(b"engine", b"") == str(rank).encode():
            return blocks - 1
        found = blocks - 1 if found is None else found
    return found


@dataclass(frozen=True)
class _Failure:
    """Why a health check did not pass; ``timed_out``: no answer within the timeout."""

    reason: str
    timed_out: bool = False
