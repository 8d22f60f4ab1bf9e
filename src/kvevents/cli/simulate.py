"""``kvevents simulate``: route a trace over simulated engines with every policy; report."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvevents._types import Document
from kvevents.cli.common import UsageError, non_negative_int

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvevents.cli.common import Subparsers
    from kvevents.sim import Evaluation, SimulationConfig, TraceRow

EXAMPLES = """examples:
  kvevents simulate                              the whole synthetic trace, 8 workers, all policies
  kvevents simulate --limit 500 --json           a quick run, machine-readable
  kvevents simulate --policies prefix_load,round_robin --ranks 2 --workers 4
  kvevents simulate --drop-rate 0.05             lose 5% of live messages; replays recover them
  kvevents simulate --staleness 2                route on an index that lags 2 virtual seconds

The trace defaults to $KVEVENTS_TRACE, else the synthetic Mooncake trace.
Reuse is the share of prompt tokens served from cache. Two references are printed under the
policies: the infinite-cache bound (every block ever computed still cached) and the pooled-cache
reference (one engine holding the whole cluster's cache); "vs pooled" compares with the latter.
The oracle routes on the engines' true caches with prefix_load's cost model: next to
prefix_load it measures index fidelity, not routing quality.
"""


def add_parser(sub: Subparsers) -> None:
    from kvevents.sim import POLICY_NAMES, ClusterConfig

    d = ClusterConfig()
    p = sub.add_parser(
        "simulate",
        help="evaluate routing policies on a trace over simulated engines",
        description="Run simulated engines with real publishers, a subscriber and the prefix "
        "index on a Mooncake trace in virtual time, once per routing policy, and compare "
        "prefix reuse, time to first token, load balance and index accuracy.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", help="Mooncake JSON-lines trace (default: $KVEVENTS_TRACE)")
    p.add_argument("--limit", type=_positive, help="use the first N rows")
    p.add_argument("--workers", type=_positive, default=d.workers, help="engines (default 8)")
    p.add_argument("--ranks", type=_positive, default=d.ranks, help="DP ranks per engine")
    p.add_argument(
        "--policies",
        type=_policies(POLICY_NAMES),
        default=POLICY_NAMES,
        help=f"comma-separated, from {','.join(POLICY_NAMES)} (default: all)",
    )
    p.add_argument("--block-size", type=_positive, default=d.block_size, help="tokens per block")
    p.add_argument(
        "--capacity", type=_positive, default=d.capacity_blocks, help="GPU blocks per rank"
    )
    p.add_argument(
        "--budget",
        type=_positive,
        default=d.max_num_batched_tokens,
        help="tokens per engine step (chunked prefill)",
    )
    p.add_argument(
        "--step-ms",
        type=_positive_float,
        default=d.step_base_s * 1e3,
        help="an engine step's fixed time, ms (default %(default)g: measure yours as the time "
        "between two tokens of an answer running alone)",
    )
    p.add_argument(
        "--token-us",
        type=_non_negative,
        default=d.step_token_s * 1e6,
        help="an engine step's time per token it computes, µs (default %(default)g: measure "
        "yours from a long prompt's time to first token alone, less --step-ms, over its tokens)",
    )
    p.add_argument(
        "--staleness", type=_non_negative, default=0.0, help="index lag, virtual seconds"
    )
    p.add_argument(
        "--drop-rate",
        type=_rate,
        default=0.0,
        help="fraction of live messages lost between publishers and subscriber (seeded)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of drops and the random policy")
    p.add_argument(
        "--check-every",
        type=non_negative_int,
        default=None,
        help="check index fidelity (index == engines' caches) every N requests (default 100; "
        "0: at the end only; with --staleness the index lags by design: at the end only)",
    )
    p.add_argument("--transport", choices=("zmq", "direct"), default="zmq", help=argparse.SUPPRESS)
    p.add_argument(
        "--chart", metavar="PATH.svg", help="also write reuse and TTFT charts as an SVG file"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="run every policy on 4, 8 and 16 engines with small (a quarter of --capacity) and "
        "large (--capacity) caches; the table (and --chart) show reuse against the pooled cache",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _policies(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown policy {bad[0] if bad else text!r}; known: {','.join(known)}"
            )
        return names

    return parse


def run(args: argparse.Namespace) -> int:
    from kvevents.sim import (
        ClusterConfig,
        SimulationConfig,
        default_trace_path,
        format_table,
        load_trace,
    )

    if args.chart and not args.chart.endswith(".svg"):
        raise UsageError(f"--chart {args.chart!r}: the chart is SVG; name the file *.svg")
    if args.staleness and args.check_every:
        raise UsageError(
            "--check-every needs --staleness 0: an index that lags by design differs from the "
            "engines until it catches up, so fidelity is checked once, at the end"
        )
    path = args.trace or default_trace_path()
    rows = load_trace(path, limit=args.limit)
    if not rows:
        raise ValueError(f"{path}: no rows")
    config = SimulationConfig(
        cluster=ClusterConfig(
            workers=args.workers,
            ranks=args.ranks,
            block_size=args.block_size,
            capacity_blocks=args.capacity,
            max_num_batched_tokens=args.budget,
            transport=args.transport,
            drop_rate=args.drop_rate,
            seed=args.seed,
            step_base_s=args.step_ms / 1e3,
            step_token_s=args.token_us / 1e6,
        ),
        staleness=args.staleness,
        check_every=0
        if args.staleness
        else (100 if args.check_every is None else args.check_every),
        seed=args.seed,
    )
    began = time.monotonic()
    if args.sweep:
        return _sweep(args, rows, config)
    result, interrupted = _evaluate(rows, args.policies, config)
    if interrupted is not None:
        done = ", ".join(r.policy for r in result.reports) or "none"
        print(
            f"kvevents simulate: interrupted during {interrupted}; finished: {done}",
            file=sys.stderr,
        )
        if not result.reports:
            return 130
    if args.json:
        doc = {"trace": path, "wall_seconds": time.monotonic() - began, **result.to_dict()}
        print(json.dumps(doc, indent=2))
    else:
        print(_header(path, result.rows, config))
        print(format_table(result, markdown=args.markdown))
    if args.chart:
        from kvevents.sim import evaluation_svg

        with open(args.chart, "w", encoding="utf-8") as out:
            out.write(evaluation_svg(result))
        print(f"chart written to {args.chart}", file=sys.stderr)
    return 0 if interrupted is None else 130


def _sweep(args: argparse.Namespace, rows: Sequence[TraceRow], config: SimulationConfig) -> int:
    from kvevents.sim import format_sweep, sweep, sweep_series, sweep_svg

    policies = [p for p in args.policies if p != "oracle"]  # index fidelity is not swept
    capacities = (max(1, args.capacity // 4), args.capacity)

    def progress(what: str) -> None:
        print(f"simulate: {what}", file=sys.stderr, flush=True)

    try:
        points = sweep(rows, policies, config, capacities=capacities, progress=progress)
    except KeyboardInterrupt:
        print("kvevents simulate: sweep interrupted; nothing to report", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"sweep": [p.to_dict() for p in points]}, indent=2))
    else:
        print(format_sweep(points, markdown=args.markdown))
    if args.chart:
        with open(args.chart, "w", encoding="utf-8") as out:
            out.write(sweep_svg(sweep_series(points), "prefix reuse by cluster size"))
        print(f"chart written to {args.chart}", file=sys.stderr)
    return 0


def _evaluate(
    rows: Sequence[TraceRow], policies: Sequence[str], config: SimulationConfig
) -> tuple[Evaluation, str | None]:
    """Every policy's report, or on Ctrl-C those that finished and the one interrupted."""
    from kvevents.sim import Evaluation, run_policy, yardsticks

    reports = []
    with _progress(len(policies) * len(rows)) as report:
        for policy in policies:
            try:
                reports.append(run_policy(rows, policy, config, progress=report))
            except KeyboardInterrupt:
                return Evaluation(len(rows), config, tuple(reports)), policy
    try:
        marks = yardsticks(rows, config.cluster)
    except KeyboardInterrupt:
        return Evaluation(len(rows), config, tuple(reports)), "the yardsticks"
    return Evaluation(len(rows), config, tuple(reports), marks), None


def _header(path: str, rows: int, config: SimulationConfig) -> str:
    c = config.cluster
    return (
        f"trace {path}: {rows} rows; {c.workers} workers x {c.ranks} rank(s), "
        f"block {c.block_size} tokens, {c.capacity_blocks} blocks per rank, "
        f"{c.max_num_batched_tokens} tokens per step, staleness {config.staleness:g} s, "
        f"drop rate {c.drop_rate:g}; index fidelity checked "
        + (f"every {config.check_every} requests" if config.check_every else "at the end")
    )


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str, int, int], None]]:
    """Progress on stderr: a rich bar on a terminal, a line per quarter otherwise."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} rows"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        tasks: Document = {}

        def show(policy: str, done: int, rows: int) -> None:
            if policy not in tasks:
                tasks[policy] = bar.add_task(policy, total=rows)
            bar.update(tasks[policy], completed=done)

        with bar:
            yield show
        return

    def plain(policy: str, done: int, rows: int) -> None:
        if done == rows or done * 4 // rows != (done - max(1, rows // 100)) * 4 // rows:
            print(f"simulate: {policy} {done}/{rows} rows", file=sys.stderr, flush=True)

    yield plain
