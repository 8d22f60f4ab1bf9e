"""Routing evaluation: simulated engines over real ZeroMQ feeding the index, the service path,
and the ``simulate`` / ``demo`` commands end to end."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvevents.http import Server, create_app
from kvevents.index import DEFAULT_POLICY
from kvevents.publish import PublisherOptions, create_publisher
from kvevents.service import IndexService
from kvevents.sim._cluster import Cluster, ClusterConfig
from kvevents.sim._engine import SimulatedEngine
from kvevents.sim._faults import DropRule
from kvevents.sim._records import Request
from kvevents.sim._simulate import PolicyRun, SimulationConfig
from kvevents.sim._trace import default_trace_path
from kvevents.testing.publisher import local_config
from kvevents.testing.sockets import wait_for

pytestmark = pytest.mark.timeout(60)

TRACE = default_trace_path()


def workload(count: int, seed: int = 7) -> Iterator[Request]:
    """Requests sharing a few prefixes (so hits, evictions and chains all happen)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(65536) for _ in range(rng.randrange(32, 160))] for _ in range(6)]
    for i in range(count):
        tail = [rng.randrange(65536) for _ in range(rng.randrange(1, 80))]
        yield Request(f"r{i}", rng.choice(prefixes) + tail, max_output_tokens=rng.randrange(1, 40))


def run_workload(cluster: Cluster, count: int) -> None:
    targets = cluster.targets()
    for i, request in enumerate(workload(count)):
        worker, rank = targets[i % len(targets)]
        cluster.engines[worker].submit(request, rank=rank)
        for engine in cluster.engines.values():
            engine.step()
    for engine in cluster.engines.values():
        while engine.has_work():
            engine.step()


SMALL = ClusterConfig(workers=2, ranks=2, block_size=16, capacity_blocks=48, sync_timeout=15.0)


def test_index_over_zeromq_equals_the_engines_caches() -> None:
    """After quiescence the index holds exactly each engine rank's cached blocks."""
    with Cluster(SMALL) as cluster:
        run_workload(cluster, 120)
        cluster.sync()
        accuracy = cluster.accuracy()
        counters = cluster.feed_counters()
    assert accuracy.exact, accuracy
    assert accuracy.true_blocks > 100  # evictions happened, and something is cached
    assert counters.delivered >= counters.published
    assert counters.unrecoverable == 0


def test_dropped_messages_are_replayed_and_the_index_stays_exact() -> None:
    """Live messages lost on the wire come back through replays; the index ends exact."""
    config = ClusterConfig(**{**SMALL.__dict__, "drop_rate": 0.2, "seed": 3})
    with Cluster(config) as cluster:
        run_workload(cluster, 120)
        cluster.sync()
        accuracy = cluster.accuracy()
        counters = cluster.feed_counters()
    assert counters.relay_dropped > 10
    assert counters.replays > 0 and counters.replayed >= counters.relay_dropped
    assert counters.unrecoverable == 0
    assert accuracy.exact, accuracy


def test_drop_rule_is_seeded_and_disarmed_until_armed() -> None:
    """The same seed drops the same sequence numbers; nothing drops before arm()."""
    a, b, c = DropRule(0.3, seed=1), DropRule(0.3, seed=1), DropRule(0.3, seed=2)
    assert not any(a.drops(("w", 0), s) for s in range(100))
    for rule in (a, b, c):
        rule.arm({("w", 0): 5})
    picks = [a.drops(("w", 0), s) for s in range(5, 1005)]
    assert picks == [b.drops(("w", 0), s) for s in range(5, 1005)]
    assert picks != [c.drops(("w", 0), s) for s in range(5, 1005)]
    assert 200 < sum(picks) < 400
    assert not a.drops(("w", 0), 4) and not a.drops(("other", 0), 7)


def test_kv_aware_routing_on_an_exact_index_matches_the_oracle() -> None:
    """With no lag, the default policy over the index decides like the oracle over true caches
    (same policy, same seed, the engines' caches instead of the index)."""
    config = SimulationConfig(
        ClusterConfig(workers=3, block_size=16, capacity_blocks=64, transport="direct"),
        check_every=10,
    )
    decisions = {}
    for policy in (DEFAULT_POLICY, "oracle"):
        with Cluster(config.cluster) as cluster:
            run = PolicyRun(cluster, policy, config)
            picks = [run.submit(r, i * 0.01) for i, r in enumerate(workload(80))]
            report = run.finish(0.0)
        decisions[policy] = picks
        assert report.accuracy.exact and report.exact_checks == report.checks == 8
    assert decisions[DEFAULT_POLICY] == decisions["oracle"]


def test_bounded_prefix_is_given_requests_in_flight_and_spills_a_hot_prefix() -> None:
    """bounded_prefix in the simulator bounds requests in flight: a burst sharing a prefix one
    engine holds does not all land there (it did when the policy was given no load at all)."""
    config = SimulationConfig(
        ClusterConfig(workers=3, block_size=16, capacity_blocks=256, transport="direct")
    )
    prefix = list(range(1000, 1000 + 8 * 16))
    with Cluster(config.cluster) as cluster:
        run = PolicyRun(cluster, "bounded_prefix", config)
        warm = run.submit(Request("warm", [*prefix, 1], 1), 0.0)
        run.drain()
        burst = [run.submit(Request(f"b{i}", [*prefix, 2 + i], 8), 1.0) for i in range(15)]
        loads = [s.load.requests for s in run.last_decision.scores] if run.last_decision else []
    # Bounds of max(ceil(2 x mean), ceil(mean) + 8), the mean over (in flight + 1): the 14th
    # finds 13 on the warm engine, at its bound of 13, and spills; so does the 15th.
    assert burst[:13] == [warm] * 13 and warm not in burst[13:], burst
    assert sorted(loads) == [0, 1, 13]


def test_staleness_holds_batches_back_until_the_cutoff() -> None:
    """A lagging index applies only batches older than the cutoff; release(None) catches up."""
    with Cluster(ClusterConfig(workers=1, block_size=16, transport="direct")) as cluster:
        cluster.staleness = 5.0
        engine = cluster.engines["w0"]
        engine.submit(next(workload(1)))
        engine.step()
        cluster.sync(cutoff=0.0)
        assert cluster.index.stats().blocks == 0
        cluster.release(None)
        assert cluster.accuracy().exact and cluster.index.stats().blocks > 0


def test_service_with_a_real_subscriber_answers_queries_over_http() -> None:
    """Workers registered over HTTP are followed by the real subscriber; /query finds the
    worker holding a prefix and /workers shows each stream's health."""
    service = IndexService()
    server = Server(create_app(service))
    # Heartbeats: batches published before the subscriber's connection completes are then
    # noticed as a late join and replayed, instead of waiting for the next real batch.
    beat = PublisherOptions(heartbeat_interval=0.05)
    publishers = [create_publisher(local_config(), options=beat) for _ in range(2)]
    try:
        for p in publishers:
            p.start()
        service.start()
        server.start()
        engines = [SimulatedEngine(publishers=[p]) for p in publishers]
        prompt = list(range(1000, 1000 + 16 * 6))
        with httpx.Client(base_url=server.url, timeout=10.0) as client:
            for i, p in enumerate(publishers):
                reply = client.post(
                    "/register",
                    json={
                        "worker_id": f"w{i}",
                        "block_size": 16,
                        "endpoint": p.endpoint,
                        "replay_endpoint": p.replay_endpoint,
                    },
                )
                assert reply.status_code == 200, reply.text
            engines[1].submit(Request("r", prompt, max_output_tokens=2))
            while engines[1].has_work():
                engines[1].step()

            def held() -> dict[str, object] | None:
                body = client.post("/query", json={"token_ids": prompt}).json()
                return body if body["scores"].get("w1", {}).get("0") == 6 else None

            body = wait_for(held, timeout=15.0, what="w1 holding the prompt")
            assert body["decision"]["winner"]["worker_id"] == "w1"
            assert "w0" not in body["scores"]
            workers = {w["worker_id"]: w for w in client.get("/workers").json()["workers"]}
        stream = workers["w1"]["ranks"][0]["stream"]
        assert stream["state"] == "live" and stream["delivered"] >= 1
        assert workers["w1"]["ranks"][0]["tiers"] == {"GPU": 6}
    finally:
        server.close()
        service.close()
        for p in publishers:
            p.shutdown(timeout=0.5)


def _kvevents(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVEVENTS_TRACE": TRACE}
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_simulate_command_reports_every_policy_as_json() -> None:
    """`kvevents simulate --json` parses; KV-aware beats round-robin; the index is exact."""
    done = _kvevents("simulate", "--limit", "150", "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    policies = doc["policies"]
    assert set(policies) == {
        "prefix_load",
        "longest_prefix",
        "bounded_prefix",
        "round_robin",
        "random",
        "oracle",
    }
    assert policies["prefix_load"]["reuse"] > policies["round_robin"]["reuse"]
    assert policies["oracle"]["reuse"] > policies["random"]["reuse"]
    for report in policies.values():
        assert report["accuracy"]["exact"], report["accuracy"]
        assert report["requests"] == 150 and report["ttft_p50"] is not None
    assert policies["prefix_load"]["ratio_to_oracle"] is not None


def test_simulate_rejects_bad_arguments_in_one_line() -> None:
    """A bad policy name is one clear line and exit status 2."""
    done = _kvevents("simulate", "--policies", "fastest", timeout=30)
    assert done.returncode == 2
    assert "unknown policy 'fastest'" in done.stderr and done.stderr.count("\n") == 1


def test_demo_runs_headless_and_prints_a_summary() -> None:
    """`kvevents demo --duration 4` exits 0 with per-policy and per-worker numbers."""
    done = _kvevents("demo", "--duration", "4", timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "demo summary" in out
    summary = out[out.index("demo summary") :].splitlines()
    for policy in (DEFAULT_POLICY, "round_robin"):
        at = next(i for i, x in enumerate(summary) if x.strip().startswith(policy))
        assert "requests" in summary[at] and "reuse" in summary[at]
        assert summary[at + 1].strip().startswith("index exact")
    assert out.count("blocks per worker (index/engine): w0 ") == 2
    assert "KV-aware routing reused" in out
    assert max(len(line) for line in summary[:-1] if "blocks per worker" not in line) <= 100


def test_the_demo_says_when_its_lanes_served_unequal_samples() -> None:
    """The closing comparison names unequal request counts instead of hiding them."""
    from types import SimpleNamespace

    from kvevents.cli.demo import _comparison

    aware = SimpleNamespace(policy=DEFAULT_POLICY, reuse=0.5, requests=800)
    rr = SimpleNamespace(policy="round_robin", reuse=0.25, requests=760)
    lines = _comparison([aware, rr])
    assert lines[0].endswith("reused 50.0% of prompt tokens, round-robin 25.0% (2.0x)")
    assert lines[1] == (
        "  (unequal samples: 800 requests against 760; reuse is a share of each lane's own "
        "prompt tokens)"
    )
    assert len(_comparison([aware, SimpleNamespace(**{**vars(rr), "requests": 800})])) == 1


def test_default_trace_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVEVENTS_TRACE overrides the default trace path."""
    monkeypatch.setenv("KVEVENTS_TRACE", "/tmp/other.jsonl")
    assert default_trace_path() == "/tmp/other.jsonl"
    monkeypatch.delenv("KVEVENTS_TRACE")
    assert default_trace_path().endswith("kvevents/sim/data/mooncake_synthetic_trace.jsonl.gz")


def test_simulate_rejects_a_negative_check_interval_and_checks_under_staleness() -> None:
    """--check-every -5 is an error, and so is asking for periodic checks of an index that
    lags by design (--staleness): the command says why instead of turning them off silently."""
    negative = _kvevents("simulate", "--check-every", "-5", timeout=30)
    assert negative.returncode == 2 and "'-5' is not an integer >= 0" in negative.stderr
    stale = _kvevents("simulate", "--staleness", "2", "--check-every", "10", timeout=30)
    assert stale.returncode == 2 and "--check-every needs --staleness 0" in stale.stderr


def test_simulate_table_shows_requests_rejected_and_how_fidelity_was_checked() -> None:
    """The text table has requests and rejected columns; the header says how often the index's
    fidelity was checked."""
    done = _kvevents(
        "simulate",
        "--limit",
        "60",
        "--policies",
        "round_robin",
        "--capacity",
        "64",
        "--budget",
        "512",
        "--staleness",
        "1",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    header, columns, row = done.stdout.splitlines()[:3]
    assert header.endswith("index fidelity checked at the end")
    assert columns.split()[:3] == ["policy", "requests", "rejected"]
    requests, rejected = (int(v) for v in row.split()[1:3])
    assert requests + rejected <= 60 and rejected > 0


def test_ctrl_c_in_simulate_prints_what_finished() -> None:
    """Ctrl-C during the second policy prints "interrupted", the first policy's row, exit 130."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvevents.cli",
            "simulate",
            "--limit",
            "400",
            "--policies",
            "round_robin,random",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVEVENTS_TRACE": TRACE},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # progress lines; the child exits (EOF) if something breaks
            if line.startswith("simulate: random"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted during random; finished: round_robin" in err
    assert "Traceback" not in err
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == ["round_robin"]


def test_the_router_is_given_each_engines_cache_size_and_pinned_blocks() -> None:
    """As a front door reads each vLLM engine's cache size, the simulated router knows each
    engine's capacity; the engine view gives it the blocks the running requests pin, so a
    new prefix goes to the engine with room (the decision shows both)."""
    config = SimulationConfig(
        ClusterConfig(workers=2, block_size=16, capacity_blocks=64, transport="direct")
    )
    with Cluster(config.cluster) as cluster:
        run = PolicyRun(cluster, "bounded_prefix", config)
        assert run.router.capacity == {("w0", 0): 64, ("w1", 0): 64}
        first = run.submit(Request("long", list(range(1000, 1000 + 40 * 16)), 50), 0.0)
        run.advance(0.05)  # running: its 40 prompt blocks and its answer's first pinned
        second = run.submit(Request("new", list(range(5000, 5000 + 30 * 16)), 1), 0.05)
        assert run.last_decision is not None
        rows = {(s.worker_id, s.rank): s for s in run.last_decision.scores}
    assert first is not None and second != first
    assert rows[first].load.pinned_blocks == 41
    assert rows[first].terms["overflow_blocks"] == 7  # 41 + 30 - 64
    assert rows[first].terms["capacity_blocks"] == 64


def test_the_step_time_reaches_every_engine_and_bad_ones_are_refused() -> None:
    """ClusterConfig's step time is every simulated engine's (a long prompt's first token
    then takes its prefill's time); a step of no time, a negative or infinite time per token
    or NaN is refused naming the field, and `kvevents simulate` refuses them in one line."""
    config = ClusterConfig(workers=2, transport="direct", step_base_s=0.01, step_token_s=0.001)
    with Cluster(config) as cluster:
        for engine in cluster.engines.values():
            assert (engine.config.step_base_s, engine.config.step_token_s) == (0.01, 0.001)
        engine = next(iter(cluster.engines.values()))
        engine.submit(Request("long", list(range(1000)), 4))
        began = engine.now
        while not engine.finished_requests:
            engine.step()
        (record,) = engine.finished_requests
        assert record.first_token_at - began == pytest.approx(0.01 + 0.001 * 1000)
    for bad, field in (
        ({"step_base_s": 0}, "step_base_s"),
        ({"step_token_s": -1e-6}, "step_token_s"),
        ({"step_base_s": float("nan")}, "step_base_s"),
        ({"step_token_s": float("inf")}, "step_token_s"),
    ):
        with pytest.raises(ValueError, match=field):
            ClusterConfig(**bad)
    for flag in ("--step-ms", "--token-us"):
        done = _kvevents("simulate", flag, "-1", timeout=30)
        assert done.returncode == 2 and f"argument {flag}: must be a finite number" in done.stderr
        assert done.stderr.count("\n") == 1
