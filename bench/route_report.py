"""What ``bench_route`` reports per router: figures from the client's records and the engines'
counters, the rows for bench/RESULTS.md, and the run's JSON summary.

- **cached fraction**: prompt tokens the engines served from cache over all prompt tokens, as
  the engines reported them to the client in ``usage`` (``prompt_tokens_details.
  cached_tokens``), over the requests that succeeded;
- **engine hit fraction**: the same from the engines' own counters (``vllm:prefix_cache_hits_
  total`` over ``vllm:prefix_cache_queries_total``, deltas over the run), the cross-check;
- **share of pooled**: cached fraction over the pooled reference's (one engine with the
  cluster's whole cache, serving everything);
- **TTFT** p50/p90/p99 at the client (first streamed content chunk);
- **balance**: max over mean of the requests each engine finished
  (``vllm:request_success_total`` deltas);
- **errors** by kind as the client saw them (``HTTP 500``, a reset connection, ...).

A router run several times on a workload (``KVEVENTS_BENCH_ROUTE_REPEATS``) is reported as
one: its runs' requests and counters together (:func:`merged`), each run's cached fraction
beside them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harness import Row, percentile
from route_client import Record
from route_engines import Snapshot


@dataclass
class Outcome:
    """One router on one workload: the client's records and the engines' counter deltas."""

    router: str
    workload: str
    status: str = "ok"  # "ok", "not installed: ...", "failed: ..."
    records: list[Record] = field(default_factory=list)
    engines: list[Snapshot] = field(default_factory=list)
    seconds: float = 0.0
    router_metrics: str = ""
    fault: FaultFigures | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: each run's cached fraction, when the outcome is several runs together (:func:`merged`)
    runs: list[float | None] = field(default_factory=list)

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.error is None]

    def cached_fraction(self) -> float | None:
        prompt = sum(r.prompt_tokens or 0 for r in self.ok)
        return sum(r.cached_tokens or 0 for r in self.ok) / prompt if prompt else None

    def engine_hit_fraction(self) -> float | None:
        queries = sum(s.queries for s in self.engines)
        return sum(s.hits for s in self.engines) / queries if queries else None

    def ttft(self, q: float) -> float | None:
        samples = [r.ttft_ms for r in self.ok if r.ttft_ms is not None]
        return percentile(samples, q) if samples else None

    def per_engine(self) -> list[int]:
        return [round(s.requests) for s in self.engines]

    def balance(self) -> float | None:
        counts = self.per_engine()
        mean = sum(counts) / len(counts) if counts else 0
        return max(counts) / mean if mean else None

    def header_agreement(self) -> tuple[int, int] | None:
        """(requests whose predicted cached tokens equal the engine's, requests with both),
        from the router's response headers; None when it sent none."""
        both = [
            r for r in self.ok if r.predicted_cached is not None and r.cached_tokens is not None
        ]
        if not both:
            return None
        return sum(r.predicted_cached == r.cached_tokens for r in both), len(both)

    def errors(self) -> Counter[str]:
        return Counter(r.error for r in self.records if r.error is not None)


@dataclass
class FaultFigures:
    """The fault run: an engine killed a third of the way through, restarted two thirds in."""

    killed_at: float  # seconds since the client started
    restarted_at: float  # relaunch began
    ready_at: float | None  # the restarted engine answered /health (None: not while it ran)
    victim: str
    after_restart: list[Record] = field(default_factory=list)
    victim_requests_after: int = 0

    def hit_after(self) -> float | None:
        ok = [r for r in self.after_restart if r.error is None]
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        return sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None


def merged(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """One outcome per router: a router's runs together (requests, engine counters, its
    /metrics texts one after the other), in the order the routers first ran."""
    by_router: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_router.setdefault(outcome.router, []).append(outcome)
    out = []
    for runs in by_router.values():
        done = [o for o in runs if o.status == "ok"]
        if len(runs) == 1 or not done:
            out.append(runs[0])
            continue
        engines = done[0].engines
        for other in done[1:]:
            engines = [a + b for a, b in zip(engines, other.engines, strict=True)]
        first = done[0]
        out.append(
            Outcome(
                first.router,
                first.workload,
                records=[r for o in done for r in o.records],
                engines=engines,
                seconds=sum(o.seconds for o in done),
                router_metrics="\n".join(o.router_metrics for o in done),
                extra=dict(first.extra),
                runs=[o.cached_fraction() for o in done],
            )
        )
    return out


def prediction_agreement(metrics_text: str) -> tuple[float, float, float] | None:
    """(exact predictions, eviction races, predictions compared) from ``kvevents route``'s
    /metrics (several texts one after the other: summed), or None.

    The front door's own count (``kvevents_route_planner_exact_total`` and ``_evicted_total``
    of ``kvevents_route_planner_compared_total``): each answer's predicted cached tokens
    against the ``cached_tokens`` the engine reported in it; an eviction race is an answer
    short of its prediction whose engine announced at least as many blocks evicted while it
    was in flight.
    """
    names = {
        "kvevents_route_planner_exact_total": 0,
        "kvevents_route_planner_evicted_total": 1,
        "kvevents_route_planner_compared_total": 2,
    }
    values = [0.0, 0.0, 0.0]
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[names[name]] += float(value)
    exact, evicted, total = values
    return (exact, evicted, total) if total else None


def _metric_sum(metrics_text: str, name: str) -> float | None:
    """The sum of metric ``name``'s samples in ``metrics_text`` (None: it has none)."""
    found = [
        float(line.partition(" ")[2])
        for line in metrics_text.splitlines()
        if line.startswith(name + " ")
    ]
    return sum(found) if found else None


def _pct(value: float | None) -> float:
    return float("nan") if value is None else 100.0 * value


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def outcome_rows(section: str, outcome: Outcome, pooled: float | None) -> list[Row]:
    """The rows of one router on one workload (one row saying why, when it did not run)."""
    case = outcome.router
    if outcome.status != "ok":
        return [Row(section, f"{case}: {outcome.status}", "ran", 0.0, "")]
    cached = outcome.cached_fraction()
    share = cached / pooled if cached is not None and pooled else None
    per_engine = "/".join(str(n) for n in outcome.per_engine())
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.errors().items())) or "none"
    rows = [Row(section, case, "cached fraction (usage)", _pct(cached), "%")]
    if outcome.runs:
        each = ", ".join("-" if r is None else f"{100 * r:.1f}" for r in outcome.runs)
        spread = [r for r in outcome.runs if r is not None]
        low, high = (min(spread), max(spread)) if spread else (None, None)
        rows += [
            Row(
                section,
                case,
                f"cached fraction, lowest of {len(outcome.runs)} runs ({each})",
                _pct(low),
                "%",
            ),
            Row(
                section,
                case,
                f"cached fraction, highest of {len(outcome.runs)} runs",
                _pct(high),
                "%",
            ),
        ]
    rows += [
        Row(
            section,
            case,
            "engine hit fraction (/metrics)",
            _pct(outcome.engine_hit_fraction()),
            "%",
        ),
        Row(section, case, "share of pooled", _pct(share), "%"),
        Row(section, case, "TTFT p50", _nan(outcome.ttft(50)), "ms"),
        Row(section, case, "TTFT p90", _nan(outcome.ttft(90)), "ms"),
        Row(section, case, "TTFT p99", _nan(outcome.ttft(99)), "ms"),
        Row(
            section,
            case,
            f"balance, max/mean (requests {per_engine})",
            _nan(outcome.balance()),
            "x",
        ),
        Row(section, case, f"errors ({errors})", float(len(outcome.records) - len(outcome.ok)), ""),
    ]
    headers = outcome.header_agreement()
    if headers is not None:
        equal, requests = headers
        metric = f"predicted == actual, per request from its headers ({equal}/{requests})"
        rows.append(Row(section, case, metric, 100 * equal / requests, "%"))
    agreement = prediction_agreement(outcome.router_metrics)
    if agreement is not None:
        exact, evicted, total = agreement
        rows += [
            Row(
                section,
                case,
                f"predicted == actual ({exact:.0f}/{total:.0f})",
                100 * exact / total,
                "%",
            ),
            Row(
                section,
                case,
                f"predicted == actual, or short by an eviction race ({exact + evicted:.0f}/{total:.0f})",
                100 * (exact + evicted) / total,
                "%",
            ),
        ]
    return rows


def fault_rows(section: str, outcome: Outcome) -> list[Row]:
    """The fault run's rows: errors the client saw, hit fraction after the restart."""
    case = outcome.router
    fault = outcome.fault
    if outcome.status != "ok" or fault is None:
        return [Row(section, f"{case}: {outcome.status}", "ran", 0.0, "")]
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.errors().items())) or "none"
    after = len(fault.after_restart)
    if fault.ready_at is None:
        down = (
            f"engine down (killed at {fault.killed_at:.0f} s, not back before the client's "
            f"run ended at {outcome.seconds:.0f} s)"
        )
        down_for = outcome.seconds - fault.killed_at
    else:
        down = f"engine down (killed at {fault.killed_at:.0f} s, back at {fault.ready_at:.0f} s)"
        down_for = fault.ready_at - fault.killed_at
    continued = _metric_sum(outcome.router_metrics, "kvevents_route_continued_total")
    rows = (
        []
        if continued is None
        else [Row(section, case, "streams continued on another engine", continued, "")]
    )
    return [
        Row(section, case, down, down_for, "s"),
        *rows,
        Row(
            section,
            case,
            f"client-visible errors ({errors})",
            float(sum(outcome.errors().values())),
            "",
        ),
        Row(section, case, "cached fraction, whole run", _pct(outcome.cached_fraction()), "%"),
        Row(
            section,
            case,
            f"cached fraction after the restart ({after} requests)",
            _pct(fault.hit_after()),
            "%",
        ),
        Row(
            section,
            case,
            "requests on the restarted engine after it was back",
            float(fault.victim_requests_after),
            "",
        ),
    ]


def summary(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """JSON-ready figures of every outcome (the run's ``summary.json``)."""
    out = []
    for o in outcomes:
        entry: dict[str, Any] = {
            "router": o.router,
            "workload": o.workload,
            "status": o.status,
            "requests": len(o.records),
            "seconds": round(o.seconds, 1),
            "cached_fraction": o.cached_fraction(),
            "engine_hit_fraction": o.engine_hit_fraction(),
            "ttft_ms": {f"p{q}": o.ttft(q) for q in (50, 90, 99)},
            "per_engine": o.per_engine(),
            "balance": o.balance(),
            "errors": dict(o.errors()),
            # kvevents route: (requests whose predicted cached tokens were the engine's, both known)
            "predicted_equal_actual": o.header_agreement(),
            **o.extra,
        }
        if o.fault is not None:
            entry["fault"] = {
                "victim": o.fault.victim,
                "killed_at_s": round(o.fault.killed_at, 1),
                "restarted_at_s": round(o.fault.restarted_at, 1),
                "ready_at_s": None if o.fault.ready_at is None else round(o.fault.ready_at, 1),
                "requests_after_restart": len(o.fault.after_restart),
                "cached_fraction_after_restart": o.fault.hit_after(),
                "victim_requests_after": o.fault.victim_requests_after,
            }
        out.append(entry)
    return out
