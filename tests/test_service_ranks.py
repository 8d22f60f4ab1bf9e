"""Ranks registered one at a time (``dp_rank``) and queries scoped by ``model_name``, in the
service and over our own HTTP API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvevents.errors import RegistrationConflict, StreamAddError
from kvevents.http import serve
from kvevents.index.prefix import PrefixIndex
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.feed import OwnEndpoints
from kvevents.service.state import StateFile
from kvevents.subscribe.streams import StreamSpec
from kvevents.testing.index import batch, remove_event, store_event
from test_service import BS, PROMPT, FakeFeed, applied
from test_state_file import serving

E0, E1, E2 = "tcp://127.0.0.1:7100", "tcp://127.0.0.1:7301", "tcp://127.0.0.1:7502"


def rank(worker: str, r: int, endpoint: str, *, model: str | None = "m", size: int = BS):
    """A registration of rank ``r`` alone, publishing on ``endpoint`` itself."""
    return WorkerRegistration(
        worker,
        endpoint,
        size,
        ranks=(r,),
        model_name=model,
        own_endpoints=(OwnEndpoints(r, endpoint, None),),
    )


@pytest.fixture
def feed() -> FakeFeed:
    return FakeFeed()


@pytest.fixture
def service(feed: FakeFeed) -> Iterator[IndexService]:
    with IndexService(PrefixIndex(), feed=feed, poll_interval=0.01) as running:
        yield running


def test_a_second_rank_joins_the_first_on_its_own_endpoint(
    service: IndexService, feed: FakeFeed
) -> None:
    """Rank 1 registered after rank 0 adds a stream on its own endpoint; rank 0 keeps its
    stream and its blocks."""
    service.add_rank(rank("w", 0, E0))
    feed.deliver("w", 0, batch(store_event(PROMPT, BS)))
    applied(service, 1)
    service.add_rank(rank("w", 1, E1))
    assert [(s.rank, s.endpoint) for s in feed.specs] == [(0, E0), (1, E1)]
    assert feed.removed == []
    assert service.query(PROMPT)["scores"] == {"w": {"0": 6}}
    (reg,) = service.workers()
    assert reg.ranks == (0, 1)


def test_reregistering_a_rank_replaces_that_rank_only(
    service: IndexService, feed: FakeFeed
) -> None:
    """A rank registered again moves to its new endpoint and starts afresh; the others stay."""
    service.add_rank(rank("w", 0, E0))
    service.add_rank(rank("w", 1, E1))
    feed.deliver("w", 0, batch(store_event(PROMPT, BS)))
    feed.deliver("w", 1, batch(store_event(PROMPT, BS)))
    applied(service, 2)
    service.add_rank(rank("w", 1, E2))
    assert feed.removed == [("w", 1)]
    assert sorted((s.rank, s.endpoint) for s in feed.specs) == [(0, E0), (1, E2)]
    assert service.query(PROMPT)["scores"] == {"w": {"0": 6}}


def test_a_rank_that_does_not_fit_is_refused_and_changes_nothing(
    service: IndexService, feed: FakeFeed
) -> None:
    """Another model or block size, or a taken rank when replacing is off, is a conflict
    naming the field; the worker keeps what it had."""
    service.add_rank(rank("w", 0, E0))
    cases = [
        (rank("w", 1, E1, model="other"), {}, "model_name"),
        (rank("w", 1, E1, size=BS * 2), {}, "block_size"),
        (rank("w", 0, E1), {"replace": False}, "rank"),
    ]
    for reg, options, name in cases:
        with pytest.raises(RegistrationConflict) as refused:
            service.add_rank(reg, **options)
        assert refused.value.field == name
    assert [(s.rank, s.endpoint) for s in feed.specs] == [(0, E0)]
    assert service.workers() == [rank("w", 0, E0)]


class _RefuseEndpoint(FakeFeed):
    def add_stream(self, spec: StreamSpec) -> None:
        if spec.endpoint == E2:
            raise StreamAddError(worker_id=spec.worker_id, rank=spec.rank, endpoint=E2, reason="no")
        super().add_stream(spec)


def test_a_rank_the_feed_refuses_leaves_the_other_ranks_running() -> None:
    """A refused new rank is rolled back alone: the worker's other ranks keep their streams
    and blocks."""
    feed = _RefuseEndpoint()
    with IndexService(PrefixIndex(), feed=feed, poll_interval=0.01) as service:
        service.add_rank(rank("w", 0, E0))
        feed.deliver("w", 0, batch(store_event(PROMPT, BS)))
        applied(service, 1)
        with pytest.raises(StreamAddError):
            service.add_rank(rank("w", 1, E2))
        assert [(s.rank, s.endpoint) for s in feed.specs] == [(0, E0)]
        assert service.workers() == [rank("w", 0, E0)]
        assert service.query(PROMPT)["scores"] == {"w": {"0": 6}}
        assert service.stats().refused_registrations == 1


def test_a_replacement_the_feed_refuses_puts_the_old_rank_back() -> None:
    """A rank moved to an endpoint the feed refuses comes back on its old endpoint; the
    worker's other ranks were never touched."""
    feed = _RefuseEndpoint()
    with IndexService(PrefixIndex(), feed=feed, poll_interval=0.01) as service:
        service.add_rank(rank("w", 0, E0))
        service.add_rank(rank("w", 1, E1))
        with pytest.raises(StreamAddError):
            service.add_rank(rank("w", 1, E2))
        assert sorted((s.rank, s.endpoint) for s in feed.specs) == [(0, E0), (1, E1)]
        assert feed.removed == [("w", 1)]
        (reg,) = service.workers()
        assert (reg.ranks, reg.own(1)) == ((0, 1), OwnEndpoints(1, E1, None))


def test_add_rank_takes_one_rank_with_its_own_endpoints(service: IndexService) -> None:
    """A registration of base endpoints is not a rank of its own: refused, nothing added."""
    with pytest.raises(ValueError, match="one rank"):
        service.add_rank(WorkerRegistration("w", E0, BS))
    assert service.workers() == []


def test_queries_for_a_model_match_only_its_workers(service: IndexService, feed: FakeFeed) -> None:
    """The same tokens cached by two models' workers: a query for model A neither matches
    nor routes to model B's worker; a query with no model sees both."""
    service.add_rank(rank("a", 0, E0, model="A"))
    service.add_rank(rank("b", 0, E1, model="B"))
    feed.deliver("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    feed.deliver("b", 0, batch(store_event(PROMPT, BS)))
    applied(service, 2)
    only_a = service.query(PROMPT, model_name="A")
    assert only_a["scores"] == {"a": {"0": 2}}
    assert {m["worker_id"] for m in only_a["matches"]} == {"a"}
    assert only_a["decision"]["winner"] == {"worker_id": "a", "rank": 0}
    assert [s["worker_id"] for s in only_a["decision"]["scores"]] == ["a"]
    assert service.query(PROMPT)["scores"] == {"a": {"0": 2}, "b": {"0": 6}}
    assert service.query(PROMPT, model_name="C")["scores"] == {}


def test_ranks_registered_alone_survive_a_restart_from_the_state_file(tmp_path) -> None:
    """The state file keeps each rank's own endpoints: after a restart rank 1 reads E1, not
    rank 0's endpoint + 1."""
    state = StateFile(tmp_path / "state.json")
    with IndexService(PrefixIndex(), feed=FakeFeed(), state=state) as service:
        service.add_rank(rank("w", 0, E0))
        service.add_rank(rank("w", 1, E1))
    (restored,) = state.load()
    assert restored == WorkerRegistration(
        "w",
        E0,
        BS,
        ranks=(0, 1),
        model_name="m",
        own_endpoints=(OwnEndpoints(0, E0, None), OwnEndpoints(1, E1, None)),
    )


def test_dp_rank_over_http_adds_a_rank_and_conflicts_are_409(feed: FakeFeed) -> None:
    """Our /register with dp_rank adds that rank next to the others; a model other than the
    worker's is a 409 naming the field; dp_rank with ranks is a 400."""
    service = IndexService(PrefixIndex(), feed=feed, poll_interval=0.01)
    with (
        serve("127.0.0.1", 0, service=service) as server,
        httpx.Client(base_url=server.url, timeout=10.0) as client,
    ):
        body = {"instance_id": 3, "block_size": BS, "model_name": "m"}
        first = client.post("/register", json={**body, "endpoint": E0, "dp_rank": 0})
        second = client.post("/register", json={**body, "endpoint": E1, "dp_rank": 1})
        assert (first.status_code, second.status_code) == (200, 200), second.text
        assert second.json() == {"worker_id": "3", "ranks": [1], "streams": 1}
        assert [(s.rank, s.endpoint) for s in feed.specs] == [(0, E0), (1, E1)]
        other = {**body, "model_name": "x", "endpoint": E2, "dp_rank": 2}
        conflict = client.post("/register", json=other)
        assert conflict.status_code == 409
        assert conflict.json()["field"] == "model_name"
        both = client.post("/register", json={**body, "endpoint": E2, "dp_rank": 2, "ranks": 2})
        assert both.status_code == 400 and "dp_rank" in both.json()["error"]
        workers = client.get("/workers").json()["workers"]
        assert [r["rank"] for r in workers[0]["ranks"]] == [0, 1]


def test_workers_registered_without_a_model_serve_every_model(
    service: IndexService, feed: FakeFeed
) -> None:
    """A worker registered with no model name (as before models were scoped) still matches
    a query that names a model."""
    service.register(WorkerRegistration("any", E0, BS))
    feed.deliver("any", 0, batch(store_event(PROMPT, BS)))
    applied(service, 1)
    assert service.query(PROMPT, model_name="A")["scores"] == {"any": {"0": 6}}


def test_a_saved_rank_on_a_host_now_refused_is_not_restored(tmp_path: Path) -> None:
    """Restoring from the state file checks every rank's own endpoint against today's
    allow-list, not only the first rank's: a rank on a refused host skips the worker."""
    path = tmp_path / "state.json"
    far = rank("far", 0, E0).with_rank(OwnEndpoints(1, "tcp://10.1.2.3:5557", None))
    StateFile(path).save([far, rank("near", 0, E1)])
    with serving("--state-file", str(path)) as (proc, url):
        workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        assert [w["worker_id"] for w in workers] == ["near"]
        assert workers[0]["own_endpoints"] == [{"rank": 0, "endpoint": E1, "replay_endpoint": None}]
        status, err = proc.stop()
    assert status == 0
    assert "warning: state file: worker 'far' not restored" in err


def test_report_mode_full_over_http_evicts_reannounced_blocks_once(feed: FakeFeed) -> None:
    """A worker registered with report_mode "full" (vLLM's kv_cache_report_mode): a block
    announced again on reuse goes with its one eviction; /workers says the mode; an
    unknown mode is a 400 naming the field."""
    service = IndexService(PrefixIndex(), feed=feed, poll_interval=0.01)
    with (
        serve("127.0.0.1", 0, service=service) as server,
        httpx.Client(base_url=server.url, timeout=10.0) as client,
    ):
        body = {"worker_id": "v", "endpoint": E0, "block_size": BS}
        bad = client.post("/register", json={**body, "report_mode": "partial"})
        assert bad.status_code == 400 and "report_mode" in bad.json()["error"]
        assert client.post("/register", json={**body, "report_mode": "full"}).status_code == 200
        feed.deliver("v", 0, batch(store_event(PROMPT, BS)))
        feed.deliver("v", 0, batch(store_event(PROMPT, BS)))
        applied(service, 2)
        assert client.post("/query", json={"token_ids": PROMPT}).json()["scores"] == {"v": {"0": 6}}
        feed.deliver("v", 0, batch(remove_event(PROMPT, BS)))
        applied(service, 3)
        assert client.post("/query", json={"token_ids": PROMPT}).json()["scores"] == {}
        (worker,) = client.get("/workers").json()["workers"]
        assert worker["report_mode"] == "full"


def test_report_mode_survives_a_restart_from_the_state_file(tmp_path: Path) -> None:
    """The state file keeps a worker's report mode."""
    state = StateFile(tmp_path / "state.json")
    with IndexService(PrefixIndex(), feed=FakeFeed(), state=state) as service:
        service.register(WorkerRegistration("v", E0, BS, report_mode="full"))
    (restored,) = state.load()
    assert restored.report_mode == "full"
