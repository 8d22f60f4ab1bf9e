"""Conformance adapters: our in-process consumer, our HTTP service, NVIDIA Dynamo's indexer.

An adapter turns a consumer into the :class:`~kvevents.testing.conformance.run.Consumer`
methods: register streams, read back the blocks held per (worker, rank) stream, the matched
prefix of a request, and what the consumer reports (losses, rejected block sizes). To add a
consumer, write a class with those methods; return None from a read-back it cannot observe,
or raise :class:`~kvevents.testing.conformance.run.NotObservable` when it cannot follow a scenario.
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
from collections.abc import Callable, Mapping, Sequence

import httpx

from kvevents._types import Document, JSONValue
from kvevents.events import StreamKey
from kvevents.index import PrefixIndex
from kvevents.service import IndexService, WorkerRegistration, subscriber_feed
from kvevents.subscribe import StreamSpec, SubscriberOptions
from kvevents.testing.conformance.stage import NotObservable, StreamRegistration, u64
from kvevents.testing.dynamo import DynamoIndexer, DynamoIndexerError, find_dynamo_python
from kvevents.testing.service import ServiceIndexer
from kvevents.wire import parse_endpoint

__all__ = ["DynamoConsumer", "KVEventsConsumer", "ServiceConsumer", "dynamo_version"]


def _group(streams: Sequence[StreamRegistration]) -> dict[str, list[StreamRegistration]]:
    workers: dict[str, list[StreamRegistration]] = {}
    for s in streams:
        workers.setdefault(s.worker_id, []).append(s)
    return workers


class KVEventsConsumer:
    """Our subscriber and prefix index in this process, wired as ``kvevents serve`` wires them.

    One :class:`~kvevents.service.IndexService` per scenario with its default feed: a
    :class:`~kvevents.subscribe.Subscriber` that feeds it batches on its I/O thread.
    ``index_factory`` makes the index (tests pass a deliberately broken one to prove the
    suite can fail).
    """

    def __init__(
        self,
        name: str = "kvevents",
        *,
        options: SubscriberOptions | None = None,
        index_factory: Callable[[], PrefixIndex] = PrefixIndex,
    ) -> None:
        self.name = name
        self._options = options
        self._index_factory = index_factory
        self._service: IndexService | None = None

    def start(self) -> None:
        pass

    def begin(self, scenario: str) -> None:
        self.end()

    def register(self, streams: Sequence[StreamRegistration]) -> None:
        specs = {
            s.key: StreamSpec(s.worker_id, s.rank, s.endpoint, s.replay_endpoint) for s in streams
        }
        service = IndexService(
            self._index_factory(),
            feed=subscriber_feed(self._options),
            # Our test publishers bind ephemeral ports, not base + rank: name each one.
            stream_specs=lambda reg: [specs[(reg.worker_id, r)] for r in reg.ranks],
        )
        self._service = service
        service.start()
        for worker, group in _group(streams).items():
            first = group[0]
            service.register(
                WorkerRegistration(
                    worker,
                    endpoint=first.endpoint,
                    block_size=first.block_size,
                    ranks=tuple(s.rank for s in group),
                    replay_endpoint=first.replay_endpoint,
                )
            )

    def _live(self) -> IndexService:
        if self._service is None:
            raise RuntimeError("register() first")
        return self._service

    def held(self) -> Mapping[StreamKey, frozenset[int]]:
        service = self._live()
        with service.lock:
            snapshot = service.index.snapshot()
        out: dict[StreamKey, set[int]] = {}
        for holder, hashes in snapshot.items():
            out.setdefault((holder.worker_id, holder.rank), set()).update(u64(h) for h in hashes)
        return {k: frozenset(v) for k, v in out.items()}

    def matched(self, token_ids: Sequence[int], block_size: int) -> Mapping[StreamKey, int]:
        service = self._live()
        with service.lock:
            return dict(service.index.match(token_ids).streams)

    def losses(self) -> Mapping[StreamKey, bool]:
        return {k: s.unrecoverable > 0 for k, s in self._live().stream_health().items()}

    def rejections(self) -> Mapping[StreamKey, int]:
        service = self._live()
        with service.lock:
            infos = service.index.streams()
        return {(i.worker_id, i.rank): i.block_size_mismatches for i in infos}

    def end(self) -> None:
        service, self._service = self._service, None
        if service is not None:
            service.close()

    def close(self) -> None:
        self.end()


def dynamo_version(python: str) -> str | None:
    """The ``ai-dynamo-runtime`` version installed for ``python``, or None."""
    code = "import importlib.metadata as m; print(m.version('ai-dynamo-runtime'))"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
        if done.returncode == 0:
            return done.stdout.strip() or None
    return None


class DynamoConsumer:
    """NVIDIA Dynamo's standalone indexer (a subprocess, :class:`DynamoIndexer`).

    One process serves every scenario; each scenario gets a model name of its own (Dynamo
    keeps one tree per model, so scenarios cannot see each other's blocks) and fresh instance
    ids. Held blocks come from ``/dump``, matches from ``/query``. Dynamo exposes neither lost
    events nor rejected block sizes through its API, so those checks are not observable.
    """

    def __init__(self, name: str = "dynamo", *, python: str | None = None) -> None:
        self.name = name
        self.python = python
        self.version: str | None = None
        self._indexer: DynamoIndexer | None = None
        self._models = itertools.count(1)
        self._ids = itertools.count(1)
        self._instances: dict[str, int] = {}

    def start(self) -> None:
        python = self.python or find_dynamo_python()
        if python is None:
            raise DynamoIndexerError("NVIDIA Dynamo's indexer is not installed")
        self.version = dynamo_version(python)
        self._indexer = DynamoIndexer(python=python).start()

    def _live(self) -> DynamoIndexer:
        if self._indexer is None:
            raise DynamoIndexerError("start() first")
        return self._indexer

    def begin(self, scenario: str) -> None:
        self._live().model_name = f"conformance-{next(self._models)}-{scenario}"
        self._instances = {}

    def register(self, streams: Sequence[StreamRegistration]) -> None:
        indexer = self._live()
        for s in streams:
            instance = self._instances.setdefault(s.worker_id, next(self._ids))
            indexer.register(
                instance,
                s.endpoint,
                block_size=s.block_size,
                replay_endpoint=s.replay_endpoint,
                dp_rank=s.rank,
            )

    def _names(self) -> dict[int, str]:
        return {i: w for w, i in self._instances.items()}

    def held(self) -> Mapping[StreamKey, frozenset[int]]:
        names = self._names()
        return {
            (names[i], rank): frozenset(u64(h) for h in hashes)
            for (i, rank), hashes in self._live().held_blocks().items()
            if i in names
        }

    def matched(self, token_ids: Sequence[int], block_size: int) -> Mapping[StreamKey, int]:
        names = self._names()
        matched = self._live().matched_blocks(token_ids, block_size)
        return {(names[i], r): n for (i, r), n in matched.items() if i in names}

    def losses(self) -> None:
        return None

    def rejections(self) -> None:
        return None

    def end(self) -> None:
        indexer, instances, self._instances = self._indexer, self._instances, {}
        if indexer is None:
            return
        for instance in instances.values():
            with contextlib.suppress(DynamoIndexerError, OSError):
                indexer.unregister(instance)

    def close(self) -> None:
        self.end()
        indexer, self._indexer = self._indexer, None
        if indexer is not None:
            indexer.close()


def _base_endpoints(group: Sequence[StreamRegistration]) -> tuple[str, str | None]:
    """The base endpoints of a worker whose rank r listens on base port + r (WIRE.md 5)."""
    first = min(group, key=lambda s: s.rank)
    bases = {_base(s.endpoint, s.rank) for s in group}
    replays = {_base(s.replay_endpoint, s.rank) if s.replay_endpoint else None for s in group}
    if len(bases) != 1 or len(replays) != 1:
        raise NotObservable(
            f"worker {first.worker_id}: the service takes base endpoints (rank r on base "
            "port + r) and this scenario's ranks listen on unrelated ports"
        )
    return bases.pop(), replays.pop()


def _base(endpoint: str, rank: int) -> str:
    parsed = parse_endpoint(endpoint)
    if parsed.scheme != "tcp" or rank == 0:
        return endpoint
    return f"tcp://{parsed.host}:{parsed.port - rank}"


class ServiceConsumer:
    """Our HTTP index service (``kvevents serve``), seen only through its HTTP API.

    ``url``: a running service; None starts one in its own process
    (:class:`~kvevents.testing.service.ServiceIndexer`, on a free port). Every
    scenario registers fresh worker ids (``<n>-<scenario>-<worker>``) and unregisters them
    at its end. Held blocks come from ``GET /dump``, matches from ``POST /query``, losses and
    block-size rejections from ``GET /workers``.
    """

    def __init__(self, name: str = "service", *, url: str | None = None) -> None:
        self.name = name
        self.url = url
        self.version: str | None = None
        self._process: ServiceIndexer | None = None
        self._client: httpx.Client | None = None
        self._runs = itertools.count(1)
        self._prefix = ""
        self._workers: dict[str, str] = {}

    def start(self) -> None:
        if self.url is None:
            self._process = ServiceIndexer().start()
            self.url = self._process.url
        self._client = httpx.Client(base_url=self.url, timeout=10.0)

    def _call(self, method: str, path: str, body: JSONValue = None) -> JSONValue:
        if self._client is None:
            raise RuntimeError("start() first")
        response = self._client.request(method, path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> HTTP {response.status_code}: {response.text}")
        return response.json()

    def begin(self, scenario: str) -> None:
        self._prefix = f"{next(self._runs)}-{scenario}"
        self._workers = {}

    def register(self, streams: Sequence[StreamRegistration]) -> None:
        for worker, group in _group(streams).items():
            endpoint, replay = _base_endpoints(group)
            wid = self._workers[worker] = f"{self._prefix}-{worker}"
            body = {
                "worker_id": wid,
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "block_size": group[0].block_size,
                "ranks": [s.rank for s in group],
            }
            self._call("POST", "/register", body)

    def _names(self) -> dict[str, str]:
        return {w: name for name, w in self._workers.items()}

    def held(self) -> Mapping[StreamKey, frozenset[int]]:
        names, out = self._names(), dict[StreamKey, frozenset[int]]()
        for h in self._call("GET", "/dump")["holders"]:
            if h["worker_id"] in names:
                key = (names[h["worker_id"]], int(h["rank"]))
                out[key] = out.get(key, frozenset()) | {u64(e) for e, _ in h["blocks"]}
        return out

    def matched(self, token_ids: Sequence[int], block_size: int) -> Mapping[StreamKey, int]:
        names = self._names()
        scores = self._call("POST", "/query", {"token_ids": list(token_ids)})["scores"]
        return {
            (names[w], int(rank)): int(blocks)
            for w, ranks in scores.items()
            if w in names
            for rank, blocks in ranks.items()
        }

    def _ranks(self) -> list[tuple[StreamKey, Document]]:
        names = self._names()
        return [
            ((names[w["worker_id"]], int(row["rank"])), row)
            for w in self._call("GET", "/workers")["workers"]
            if w["worker_id"] in names
            for row in w["ranks"]
        ]

    def losses(self) -> Mapping[StreamKey, bool]:
        return {k: bool((row.get("stream") or {}).get("unrecoverable")) for k, row in self._ranks()}

    def rejections(self) -> Mapping[StreamKey, int]:
        return {k: int(row.get("block_size_mismatches") or 0) for k, row in self._ranks()}

    def end(self) -> None:
        workers, self._workers = self._workers, {}
        for wid in workers.values():
            with contextlib.suppress(RuntimeError, httpx.HTTPError):
                self._call("POST", "/unregister", {"worker_id": wid})

    def close(self) -> None:
        self.end()
        client, self._client = self._client, None
        if client is not None:
            client.close()
        process, self._process = self._process, None
        if process is not None:
            process.close()
            self.url = None
