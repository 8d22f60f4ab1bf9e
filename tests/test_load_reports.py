"""POST /load: engines' load reports reach the router, expire, and are refused when malformed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest

from kvevents.http import AppOptions, TokenCheck, serve
from kvevents.http import _openapi as openapi
from kvevents.http._schema import MAX_LOAD_BLOCKS, MAX_LOAD_ENTRIES
from kvevents.index.decision import Load, LoadBook
from kvevents.index.prefix import PrefixIndex
from kvevents.index.router import Router
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.loadreports import LoadLedger, LoadReport
from kvevents.subscribe.streams import (
    Delivery,
    FeedHealth,
    Item,
    StreamSpec,
    StreamStats,
    SubscriberStats,
)
from kvevents.testing.index import batch, store_event

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks
TTL = 10.0


@dataclass
class StillFeed:
    """A feed that only records its streams; the tests apply deliveries themselves."""

    specs: dict[tuple[str, int], StreamSpec] = field(default_factory=dict)

    def add_stream(self, spec: StreamSpec) -> None:
        self.specs[spec.key] = spec

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        for key in [k for k in self.specs if k[0] == worker_id and rank in (None, k[1])]:
            del self.specs[key]

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get(self, timeout: float | None = None) -> Item | None:
        return None

    def stats(self) -> SubscriberStats:
        return SubscriberStats(
            streams=len(self.specs), incomplete=0, queued=0, callback_errors=0, max_lag=None
        )

    def stream_stats(self) -> dict[tuple[str, int], StreamStats]:
        return {}

    def health(self) -> FeedHealth:
        return FeedHealth("ok", True)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Running:
    service: IndexService
    clock: Clock
    http: httpx.Client

    def query(self, policy: str) -> dict[str, Any]:
        reply = self.http.post("/query", json={"token_ids": PROMPT, "policy": policy})
        assert reply.status_code == 200, reply.text
        decision: dict[str, Any] = reply.json()["decision"]
        return decision

    def load(self, *entries: dict[str, Any]) -> httpx.Response:
        return self.http.post("/load", json={"loads": list(entries)})


def _service(feed: StillFeed, clock: Clock) -> IndexService:
    return IndexService(PrefixIndex(), feed=feed, pushes=True, load_ttl=TTL, clock=clock)


def _two_equal_workers(service: IndexService, feed: StillFeed) -> None:
    """Workers a and b, each holding the whole prompt: every query ties on matched blocks."""
    for worker, port in (("a", 5557), ("b", 5567)):
        service.register(WorkerRegistration(worker, f"tcp://127.0.0.1:{port}", BS))
        service.consume(Delivery(feed.specs[(worker, 0)], 0, batch(store_event(PROMPT, BS))))


@pytest.fixture
def running() -> Iterator[Running]:
    feed, clock = StillFeed(), Clock()
    service = _service(feed, clock)
    with serve("127.0.0.1", 0, service=service) as server:
        _two_equal_workers(service, feed)
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            yield Running(service, clock, http)


def _winner(decision: dict[str, Any]) -> str:
    winner: str = decision["winner"]["worker_id"]
    return winner


@pytest.mark.parametrize("policy", ["longest_prefix", "prefix_load"])
def test_a_loaded_worker_loses_the_tie_it_would_otherwise_win(
    running: Running, policy: str
) -> None:
    """With equal matches, a load report decides: whichever worker is loaded loses."""
    assert running.query(policy)["tied"] == 2  # no load known: a drawn tie
    for busy, idle in (("a", "b"), ("b", "a")):
        reply = running.load(
            {"worker_id": busy, "queued_blocks": 8, "active_blocks": 30},
            {"worker_id": idle, "rank": 0, "queued_blocks": 0, "active_blocks": 0},
        )
        assert reply.json() == {"applied": 2, "unknown": []}
        decision = running.query(policy)
        assert _winner(decision) == idle and decision["tied"] == 1
        row = next(s for s in decision["scores"] if s["worker_id"] == busy)
        assert (row["queued_blocks"], row["active_blocks"]) == (8, 30)
    assert running.service.stats().load_reports == 4


def test_a_load_report_is_dropped_after_the_ttl(running: Running) -> None:
    """A reporter that went quiet does not pin its worker as busy: its load expires."""
    running.load({"worker_id": "a", "queued_blocks": 8, "active_blocks": 30})
    running.clock.now += TTL / 2
    assert _winner(running.query("longest_prefix")) == "b"
    running.load({"worker_id": "b", "queued_blocks": 1, "active_blocks": 1})
    running.clock.now += TTL / 2  # a's report is TTL old, b's half of it
    decision = running.query("longest_prefix")
    assert _winner(decision) == "a"
    loads = {s["worker_id"]: s["queued_blocks"] + s["active_blocks"] for s in decision["scores"]}
    assert loads == {"a": 0, "b": 2}
    assert running.service.stats().loads_expired == 1
    assert running.service.router.loads.snapshot() == {("b", 0): Load(1, 1)}


def test_workers_show_the_reported_load_until_it_expires(running: Running) -> None:
    """GET /workers shows each rank's last load report, and null once none counts."""

    def loads() -> dict[str, Any]:
        workers = running.http.get("/workers").json()["workers"]
        return {w["worker_id"]: w["ranks"][0]["load"] for w in workers}

    running.load({"worker_id": "a", "queued_blocks": 2, "active_blocks": 9})
    assert loads() == {"a": {"queued_blocks": 2, "active_blocks": 9, "requests": 0}, "b": None}
    running.clock.now += TTL
    assert loads() == {"a": None, "b": None}


def test_loads_of_unknown_workers_are_listed_and_counted_not_kept(running: Running) -> None:
    """A report for a worker (or rank) not registered is not applied: the reply says which."""
    reply = running.load(
        {"worker_id": "a", "queued_blocks": 1, "active_blocks": 2},
        {"worker_id": "ghost", "queued_blocks": 1, "active_blocks": 2},
        {"instance_id": "b", "dp_rank": 3, "queued_blocks": 1, "active_blocks": 2},
    )
    assert reply.status_code == 200
    msgspec.convert(reply.json(), openapi.LoadApplied)  # as /openapi.json describes it
    assert reply.json() == {
        "applied": 1,
        "unknown": [{"worker_id": "ghost", "rank": 0}, {"worker_id": "b", "rank": 3}],
    }
    assert set(running.service.router.loads.snapshot()) == {("a", 0)}
    stats = running.service.stats()
    assert (stats.load_reports, stats.load_unknown) == (1, 2)
    metrics = running.http.get("/metrics").text.splitlines()
    assert {
        "kvevents_service_load_reports_total 1.0",
        "kvevents_service_load_unknown_total 2.0",
    } < set(metrics)


@pytest.mark.parametrize(
    ("loads", "field"),
    [
        ([{"worker_id": "a", "queued_blocks": -1, "active_blocks": 0}], "$.loads[0].queued_blocks"),
        (
            [{"worker_id": "a", "queued_blocks": 0, "active_blocks": MAX_LOAD_BLOCKS + 1}],
            "$.loads[0].active_blocks",
        ),
        ([{"worker_id": "a", "queued_blocks": "5", "active_blocks": 0}], "$.loads[0].queued_blocks"),
        ([{"worker_id": "a", "queued_blocks": 1.5, "active_blocks": 0}], "$.loads[0].queued_blocks"),
        ([{"worker_id": "a", "active_blocks": 0}], "queued_blocks"),
        ([{"worker_id": "a", "rank": -1, "queued_blocks": 0, "active_blocks": 0}], "$.loads[0].rank"),
        ([{"queued_blocks": 0, "active_blocks": 0}], "$.loads[0]"),
        ([], "$.loads"),
        ([{"worker_id": "a", "queued_blocks": 0, "active_blocks": 0}] * (MAX_LOAD_ENTRIES + 1), "$.loads"),
    ],
)  # fmt: skip
def test_bad_load_reports_are_400_naming_the_field(
    running: Running, loads: list[dict[str, Any]], field: str
) -> None:
    """A malformed report is refused whole with a 400 naming the field; nothing is applied."""
    reply = running.http.post("/load", json={"loads": loads})
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("/load: ") and field in reply.json()["error"]
    assert running.service.router.loads.snapshot() == {}


def test_load_needs_the_token_like_register() -> None:
    """POST /load changes routing: behind the bearer token when one is set."""
    feed = StillFeed()
    service = _service(feed, Clock())
    options = AppOptions(auth=TokenCheck("s3cret"))
    body = {"loads": [{"worker_id": "a", "queued_blocks": 5, "active_blocks": 0}]}
    with serve("127.0.0.1", 0, service=service, options=options) as server:
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            assert http.post("/load", json=body).status_code == 401
            assert service.router.loads.snapshot() == {}
            authorized = {"authorization": "Bearer s3cret"}
            assert http.post("/load", json=body, headers=authorized).status_code == 200
    assert service.router.loads.snapshot() == {("a", 0): Load(5, 0)}


def test_unregistering_forgets_the_workers_load() -> None:
    """A worker registered again starts idle, not at the load its last incarnation reported."""
    feed = StillFeed()
    service = _service(feed, Clock())
    reg = WorkerRegistration("a", "tcp://127.0.0.1:5557", BS)
    service.register(reg)
    service.report_loads([LoadReport("a", 0, 3, 4)])
    assert service.unregister("a")
    service.register(reg)
    assert service.router.loads.snapshot() == {}


def test_ledger_expires_oldest_first_and_a_new_report_renews() -> None:
    """Expiry drops exactly the targets whose last report is ttl old; re-reporting renews."""
    clock = Clock(0.0)
    book = LoadBook()
    ledger = LoadLedger(book, ttl=5.0, clock=clock)
    ledger.apply(LoadReport("a", 0, 1, 1))
    clock.now = 2.0
    ledger.apply(LoadReport("b", 0, 2, 2))
    clock.now = 4.0
    ledger.apply(LoadReport("a", 0, 3, 3))  # renewed: now the newest
    clock.now = 7.0
    assert ledger.expire() == 1
    assert book.snapshot() == {("a", 0): Load(3, 3)}
    clock.now = 9.0
    assert ledger.expire() == 1 and book.snapshot() == {}
    with pytest.raises(ValueError, match="ttl"):
        LoadLedger(book, ttl=0)


def test_a_router_given_to_the_service_gets_the_loads() -> None:
    """The service applies loads to its router's own book (a router built with knobs)."""
    index = PrefixIndex()
    router = Router(index, "prefix_load", prefill_weight=2.0)
    service = IndexService(index, router=router, feed=StillFeed(), pushes=True)
    service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
    service.report_loads([LoadReport("a", 0, 7, 0)])
    assert router.loads.get("a") == Load(7, 0)
