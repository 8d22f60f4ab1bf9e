"""The live demo: KV-aware routing and round-robin side by side, in (sped-up) real time.

Each policy gets its own *lane*: a :class:`~kvevents.sim.Cluster` of simulated engines
with real ZeroMQ publishers, a subscriber behind a lossy relay (so gaps and replays happen),
and the prefix index, routed by a :class:`~kvevents.sim._simulate.PolicyRun` in live mode (it
routes on whatever the index has received, as a deployed router does). Both lanes receive
the same trace rows at the same paced times, so their prefix reuse can be compared as it
grows.

The demo replays the last ``duration * speedup`` seconds of the trace (arrival times rebased
to 0): late in the Mooncake trace most prompts continue earlier conversations, so the
difference between the policies shows within seconds.

Nothing here prints: :meth:`Demo.run` hands :class:`DemoView` snapshots to a callback and
returns a :class:`DemoSummary`; ``kvevents demo`` renders them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvevents.index import DEFAULT_POLICY, Decision
from kvevents.sim._cluster import Accuracy, Cluster, ClusterConfig
from kvevents.sim._simulate import PolicyReport, PolicyRun, SimulationConfig
from kvevents.sim._trace import TraceRow, trace_request

__all__ = ["Demo", "DemoConfig", "DemoSummary", "DemoView", "LaneView", "WorkerView", "window"]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. ``duration`` is wall seconds; the trace runs ``speedup`` times
    faster than recorded."""

    workers: int = 4
    policies: tuple[str, ...] = (DEFAULT_POLICY, "round_robin")
    block_size: int = 64
    capacity_blocks: int = 8192
    speedup: float = 10.0
    duration: float = 20.0
    drop_rate: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.speedup <= 0 or self.duration <= 0:
            raise ValueError("speedup and duration must be positive")


def window(rows: Sequence[TraceRow], seconds: float) -> list[TraceRow]:
    """The rows of the last ``seconds`` of the trace, arrival times rebased to 0."""
    if not rows:
        return []
    end = max(r.timestamp for r in rows)
    start = max(0, end - int(seconds * 1000))
    return [
        TraceRow(r.timestamp - start, r.input_length, r.output_length, r.hash_ids)
        for r in sorted(rows, key=lambda r: r.timestamp)
        if r.timestamp >= start
    ]


@dataclass(frozen=True)
class WorkerView:
    """One worker of a lane: blocks the index lists against blocks the engine holds."""

    worker_id: str
    index_blocks: int
    true_blocks: int
    requests: int
    events: int  #: events delivered from it


@dataclass(frozen=True)
class LaneView:
    """One policy's cluster right now."""

    policy: str
    submitted: int
    total: int
    reuse: float
    workers: tuple[WorkerView, ...]
    events_per_s: float
    gaps: int
    replays: int
    replayed: int
    relay_dropped: int
    unrecoverable: int
    last_decision: str = ""  #: the latest routing decision: the winner and what decided


@dataclass(frozen=True)
class DemoView:
    """A snapshot of the whole demo for the live view."""

    elapsed: float  #: wall seconds
    virtual: float  #: trace seconds reached
    lanes: tuple[LaneView, ...]


@dataclass(frozen=True)
class DemoSummary:
    """The end of a demo: each lane's report after quiescence."""

    elapsed: float
    virtual: float
    reports: tuple[PolicyReport, ...]
    accuracy: tuple[Accuracy, ...] = field(default=())


class _Lane:
    def __init__(self, policy: str, rows: Sequence[TraceRow], config: DemoConfig) -> None:
        cluster_config = ClusterConfig(
            workers=config.workers,
            block_size=config.block_size,
            capacity_blocks=config.capacity_blocks,
            drop_rate=config.drop_rate,
            seed=config.seed,
        )
        self.cluster = Cluster(cluster_config)
        self.policy = policy
        self.pending = deque(enumerate(rows))
        self.total = len(rows)
        self.run: PolicyRun | None = None
        self._events = 0
        self._rate = 0.0

    def start(self, config: DemoConfig) -> None:
        self.cluster.start()
        sim = SimulationConfig(cluster=self.cluster.config, seed=config.seed)
        self.run = PolicyRun(self.cluster, self.policy, sim, live=True)

    def advance(self, t: float) -> None:
        """Submit the rows that arrived by trace time ``t``, step engines to ``t``, pump."""
        assert self.run is not None
        while self.pending and self.pending[0][1].arrival <= t:
            i, row = self.pending.popleft()
            self.run.submit(trace_request(row, i), row.arrival)
        self.run.advance(t)
        self.cluster.pump()

    def busy(self) -> bool:
        return bool(self.pending) or any(e.has_work() for e in self.cluster.engines.values())

    def view(self, dt: float) -> LaneView:
        assert self.run is not None
        cluster = self.cluster
        health = cluster.stream_stats()
        tiers = {(s.worker_id, s.rank): s.tiers for s in cluster.index.streams()}
        workers = []
        for worker, rank, engine in cluster.engine_ranks():
            known = tiers.get((worker, rank), {})
            stats = health.get((worker, rank))
            workers.append(
                WorkerView(
                    worker if cluster.config.ranks == 1 else f"{worker}/{rank}",
                    sum(known.values()),
                    engine.caches[rank].cached_count(),
                    self.run.routed[(worker, rank)],
                    stats.events if stats is not None else 0,
                )
            )
        events = sum(w.events for w in workers)
        if dt > 0:
            self._rate = (events - self._events) / dt
        self._events = events
        cached, total = self.run.reuse()
        feed = cluster.feed_counters()
        return LaneView(
            self.policy,
            self.total - len(self.pending),
            self.total,
            cached / total if total else 0.0,
            tuple(workers),
            self._rate,
            feed.gaps,
            feed.replays,
            feed.replayed,
            feed.relay_dropped,
            feed.unrecoverable,
            _decision_line(self.run.last_decision),
        )


def _decision_line(decision: Decision | None) -> str:
    """``w2 <- most matched blocks (31)``, or ``w3 <- in turn`` for a policy without a reason."""
    if decision is None or decision.winner is None:
        return ""
    worker, rank = decision.winner
    where = worker if rank == 0 else f"{worker}/{rank}"
    return f"{where} <- {decision.reason or 'in turn, ignoring the cache'}"


class Demo:
    """Lanes of clusters fed the same rows in paced real time (see the module docstring)."""

    def __init__(self, rows: Sequence[TraceRow], config: DemoConfig | None = None) -> None:
        self.config = config = config or DemoConfig()
        self.rows = window(rows, config.duration * config.speedup)
        self.lanes = [_Lane(p, self.rows, config) for p in config.policies]
        self._began = time.monotonic()
        self._virtual = 0.0
        self._last_view = self._began

    def __enter__(self) -> Demo:
        try:
            for lane in self.lanes:
                lane.start(self.config)
        except BaseException:
            self.close()
            raise
        self._began = self._last_view = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for lane in self.lanes:
            lane.cluster.close()

    def elapsed(self) -> float:
        return time.monotonic() - self._began

    def tick(self) -> bool:
        """Bring every lane to the trace time the wall clock says; False once all is done."""
        self._virtual = min(self.elapsed() * self.config.speedup, self._end())
        for lane in self.lanes:
            lane.advance(self._virtual)
        return any(lane.busy() for lane in self.lanes)

    def _end(self) -> float:
        return self.rows[-1].arrival if self.rows else 0.0

    def view(self) -> DemoView:
        now = time.monotonic()
        dt, self._last_view = now - self._last_view, now
        return DemoView(self.elapsed(), self._virtual, tuple(lane.view(dt) for lane in self.lanes))

    def run(
        self,
        on_view: Callable[[DemoView], None] | None = None,
        *,
        interval: float = 0.25,
    ) -> DemoSummary:
        """Tick until ``duration`` has passed or the rows are done; a view every ``interval``."""
        next_view = 0.0
        while self.elapsed() < self.config.duration and self.tick():
            if on_view is not None and self.elapsed() >= next_view:
                on_view(self.view())
                next_view = self.elapsed() + interval
            # Pacing, not synchronisation: nothing is due before the next trace millisecond.
            time.sleep(0.001)
        return self.finish()

    def finish(self) -> DemoSummary:
        """Finish the requests in flight, let every stream quiesce, compare with the truth."""
        elapsed = self.elapsed()
        reports = []
        for lane in self.lanes:
            assert lane.run is not None
            reports.append(lane.run.finish(elapsed))
        return DemoSummary(
            elapsed, self._virtual, tuple(reports), tuple(r.accuracy for r in reports)
        )
