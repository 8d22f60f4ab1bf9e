"""Routing evaluation: a trace routed over a simulated cluster, one policy at a time.

A :class:`PolicyRun` replays trace rows in virtual time over a
:class:`~kvevents.sim.Cluster`. Engines are independent machines, so each keeps its own
virtual clock: before a request arriving at ``t`` is routed, every engine with work is
stepped until its clock reaches ``t`` (an idle one jumps to ``t``), and the cluster is synced
so the index holds every event published until then (minus ``staleness`` seconds, on
purpose). Then the router decides from the index, and the request is queued on the winner.
Nothing depends on wall time or thread timing: the same inputs give the same decisions,
whatever the transport, the load of the machine or the injected drops.

Policies: the router's (``longest_prefix``, the default; ``prefix_load``, ``round_robin``,
``random``) and ``oracle``, which decides like the default policy on the
engines' true cache state (:meth:`~kvevents.sim.SimulatedEngine.cached_prefix_blocks`)
instead of the index: next to the default it measures index fidelity, not routing quality.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvevents._types import Document
from kvevents.events import StreamKey
from kvevents.index import DEFAULT_POLICY, Decision, RouteInputs, Router, make_policy
from kvevents.sim._cluster import Accuracy, Cluster, ClusterConfig, FeedCounters
from kvevents.sim._engine import SimulatedEngine
from kvevents.sim._records import Request
from kvevents.sim._trace import TraceRow, trace_request

__all__ = [
    "KV_AWARE",
    "POLICY_NAMES",
    "PolicyReport",
    "PolicyRun",
    "SimulationConfig",
    "percentile",
    "run_policy",
]

#: Every policy :func:`run_policy` knows, the oracle last.
POLICY_NAMES = (
    "longest_prefix",
    "prefix_load",
    "bounded_prefix",
    "round_robin",
    "random",
    "oracle",
)
#: The policies that read the index.
KV_AWARE = ("longest_prefix", "prefix_load", "bounded_prefix")


@dataclass(frozen=True)
class SimulationConfig:
    """A cluster's shape plus how the run reads its index.

    ``staleness``: seconds of virtual time the index lags the engines (0: it holds every
    event published before the request arrived). ``check_every``: compare the index with
    the engines' true cache every that many arrivals (0: only at the end).
    """

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    staleness: float = 0.0
    check_every: int = 0
    seed: int = 0
    prefill_weight: float = 1.0  #: the router's cost weights (``prefix_load``)
    load_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.staleness < 0 or self.check_every < 0:
            raise ValueError("staleness and check_every must be >= 0")


@dataclass(frozen=True)
class PolicyReport:
    """What one policy achieved on a trace. Times are virtual seconds."""

    policy: str
    requests: int  #: requests routed and accepted
    rejected: int  #: requests no rank could ever hold
    input_tokens: int
    cached_tokens: int  #: prompt tokens served from cache (any tier)
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    per_target: dict[str, int]  #: requests per "worker/rank"
    busy: dict[str, float]  #: virtual seconds each worker spent stepping
    accuracy: Accuracy  #: the index against ground truth at the end
    checks: int  #: accuracy checks during the run
    exact_checks: int  #: of which the index was exact
    feed: FeedCounters
    steps: int
    virtual_seconds: float
    wall_seconds: float
    #: every request's time to first token, queueing included (for charts; not in to_dict)
    ttfts: tuple[float, ...] = field(default=(), repr=False)

    @property
    def reuse(self) -> float:
        """Share of input tokens served from cache."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def balance(self) -> float:
        """Max over mean requests per target (1.0 is perfectly even)."""
        return _max_over_mean(list(self.per_target.values()))

    @property
    def busy_balance(self) -> float:
        """Max over mean busy time per worker (1.0 is perfectly even)."""
        return _max_over_mean(list(self.busy.values()))

    def to_dict(self) -> Document:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "rejected": self.rejected,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "reuse": self.reuse,
            "ttft_mean": self.ttft_mean,
            "ttft_p50": self.ttft_p50,
            "ttft_p99": self.ttft_p99,
            "per_target": dict(self.per_target),
            "balance": self.balance,
            "busy": dict(self.busy),
            "busy_balance": self.busy_balance,
            "accuracy": self.accuracy.to_dict(),
            "checks": self.checks,
            "exact_checks": self.exact_checks,
            "feed": self.feed.to_dict(),
            "steps": self.steps,
            "virtual_seconds": self.virtual_seconds,
            "wall_seconds": self.wall_seconds,
        }


def _max_over_mean(values: list[float] | list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[min(len(ordered), int(rank)) - 1]


class PolicyRun:
    """One policy over one cluster: route, submit, step; see the module docstring."""

    def __init__(
        self, cluster: Cluster, policy: str, config: SimulationConfig, *, live: bool = False
    ) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}")
        self.cluster = cluster
        self.policy = policy
        self.live = live
        self.config = config
        cluster.staleness = config.staleness
        self.router = Router(
            cluster.index,
            DEFAULT_POLICY if policy == "oracle" else policy,
            seed=config.seed,
            prefill_weight=config.prefill_weight,
            load_weight=config.load_weight,
        )
        # The oracle decides like the default policy, but on the engines' true caches: next to
        # that policy it measures how much the index's view costs (index fidelity).
        self._oracle_policy = make_policy(
            DEFAULT_POLICY,
            seed=config.seed,
            prefill_weight=config.prefill_weight,
            load_weight=config.load_weight,
        )
        self._targets = cluster.targets()
        # The engines' cache size is known to the router, as a front door reads it from each
        # vLLM engine's /metrics (bounded_prefix keeps requests within it).
        for worker, rank in self._targets:
            self.router.set_capacity(worker, rank, cluster.config.capacity_blocks)
        self._uses_load = policy in (*KV_AWARE, "oracle")
        self.arrivals: dict[str, float] = {}
        self.routed: Counter[StreamKey] = Counter()
        self.rejected = 0
        self.steps = 0
        #: The router's latest decision (for a live view: what decided, in words).
        self.last_decision: Decision | None = None
        self.busy: defaultdict[str, float] = defaultdict(float)
        self.checks = 0
        self.exact_checks = 0
        self._submitted = 0
        self._start_time = cluster.config.engine_config().start_time

    # ------------------------------------------------------------------ time

    def advance(self, t: float) -> None:
        """Step every engine with work until its virtual clock reaches ``t``."""
        for worker, engine in self.cluster.engines.items():
            while engine.has_work() and engine.now < t:
                self._step(worker, engine)

    def drain(self) -> None:
        """Step every engine until all requests are done."""
        for worker, engine in self.cluster.engines.items():
            while engine.has_work():
                self._step(worker, engine)

    def _step(self, worker: str, engine: SimulatedEngine) -> None:
        before = engine.now
        engine.step()
        self.steps += 1
        self.busy[worker] += engine.now - before

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request, arrival: float) -> StreamKey | None:
        """Route ``request`` arriving at virtual ``arrival`` and queue it on the winner."""
        self.advance(arrival)
        cutoff = self._start_time + arrival - self.config.staleness
        if self.live:  # route on whatever has arrived, as a real router would
            self.cluster.pump(cutoff if self.config.staleness else None)
        else:
            self.cluster.sync(cutoff if self.config.staleness else None)
        target = self.route(request)
        if target is None:
            return None
        engine = self.cluster.engines[target[0]]
        engine.advance_to(arrival)
        if engine.submit(request, rank=target[1]) is None:
            self.rejected += 1
            return None
        self.arrivals[request.request_id] = arrival
        self.routed[target] += 1
        self._submitted += 1
        every = self.config.check_every
        if every and self._submitted % every == 0 and not (self.config.staleness or self.live):
            self.check()
        return target

    def route(self, request: Request) -> StreamKey | None:
        if self._uses_load:
            self._update_loads()
        if self.policy == "oracle":
            return self._oracle(request)
        self.last_decision = self.router.route(request.token_ids, targets=self._targets)
        return self.last_decision.winner

    def _update_loads(self) -> None:
        loads = self.router.loads
        for worker, rank, engine in self.cluster.engine_ranks():
            load = engine.load(rank)
            loads.set(
                worker,
                rank,
                queued_blocks=load.queued_blocks,
                active_blocks=load.active_blocks,
                # bounded_prefix bounds requests in flight: without them every target was
                # within its bound and it routed as longest prefix alone.
                requests=load.waiting_requests + load.running_requests,
                pinned_blocks=load.active_blocks,
            )

    def _oracle(self, request: Request) -> StreamKey | None:
        engines = self.cluster.engines
        first: SimulatedEngine = next(iter(engines.values()))
        hashes = first.block_hashes(request.token_ids)
        matched = [
            engines[w].cached_prefix_blocks(block_hashes=hashes, rank=r) for w, r in self._targets
        ]
        inputs = RouteInputs(
            targets=self._targets,
            matched=matched,
            request_blocks=[len(hashes)] * len(self._targets),
            loads=[self.router.loads.get(w, r) for w, r in self._targets],
            request_tokens=len(request.token_ids),
        )
        return self._oracle_policy.choose(inputs).winner

    def check(self) -> bool:
        """Compare the index with ground truth now (counts into the report)."""
        exact = self.cluster.accuracy().exact
        self.checks += 1
        self.exact_checks += exact
        return exact

    # ------------------------------------------------------------------ report

    def reuse(self) -> tuple[int, int]:
        """(cached, input) prompt tokens over every engine so far."""
        cached = total = 0
        for engine in self.cluster.engines.values():
            m = engine.metrics()
            cached += m.cached_tokens + m.cpu_cached_tokens
            total += m.input_tokens
        return cached, total

    def finish(self, wall_seconds: float) -> PolicyReport:
        """Drain, sync everything, compare with ground truth and summarise."""
        self.drain()
        self.cluster.sync()
        accuracy = self.cluster.accuracy()
        input_tokens = cached = 0
        ttfts = []
        virtual = 0.0
        for engine in self.cluster.engines.values():
            m = engine.metrics()
            input_tokens += m.input_tokens
            cached += m.cached_tokens + m.cpu_cached_tokens
            virtual = max(virtual, engine.now)
            for record in engine.finished_requests:
                ttfts.append(record.first_token_at - self.arrivals[record.request_id])
        return PolicyReport(
            policy=self.policy,
            requests=self._submitted,
            rejected=self.rejected,
            input_tokens=input_tokens,
            cached_tokens=cached,
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else None,
            ttft_p50=percentile(ttfts, 50),
            ttft_p99=percentile(ttfts, 99),
            per_target={f"{w}/{r}": self.routed[(w, r)] for w, r in self._targets},
            busy={worker: self.busy[worker] for worker in self.cluster.engines},
            accuracy=accuracy,
            checks=self.checks,
            exact_checks=self.exact_checks,
            feed=self.cluster.feed_counters(),
            steps=self.steps,
            virtual_seconds=virtual,
            wall_seconds=wall_seconds,
            ttfts=tuple(ttfts),
        )


Progress = Callable[[str, int, int], None]


def run_policy(
    rows: Sequence[TraceRow],
    policy: str,
    config: SimulationConfig | None = None,
    *,
    progress: Progress | None = None,
) -> PolicyReport:
    """Route every row of ``rows`` with ``policy`` over a fresh cluster; report.

    ``progress(policy, done, total)`` is called now and then (every 1% of the rows).
    """
    config = config or SimulationConfig()
    began = time.monotonic()
    order = sorted(range(len(rows)), key=lambda i: rows[i].timestamp)
    every = max(1, len(rows) // 100)
    with Cluster(config.cluster) as cluster:
        run = PolicyRun(cluster, policy, config)
        for done, i in enumerate(order, 1):
            run.submit(trace_request(rows[i], i), rows[i].arrival)
            if progress is not None and (done % every == 0 or done == len(rows)):
                progress(policy, done, len(rows))
        return run.finish(time.monotonic() - began)
