"""``kvevents demo``: KV-aware routing against round-robin, live, on simulated engines."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Group, RenderableType

    from kvevents.cli.common import Subparsers
    from kvevents.sim import Demo, DemoConfig, DemoSummary, DemoView, PolicyReport

EXAMPLES = """examples:
  kvevents demo                       20 seconds, a live view when run in a terminal
  kvevents demo --duration 60 --workers 6
  kvevents demo --drop-rate 0.05      lose more live messages: more gaps and replays
  kvevents demo | cat                 plain periodic lines instead of the live view

Each policy gets its own cluster of simulated engines with real ZeroMQ publishers, a
subscriber and a prefix index; both receive the same requests (the end of the synthetic
Mooncake trace, sped up). Ctrl-C stops early; a summary is always printed.
"""


def add_parser(sub: Subparsers) -> None:
    from kvevents.sim import DemoConfig

    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="watch KV-aware routing beat round-robin, live",
        description="Run simulated engines with real publishers, a subscriber, the prefix "
        "index and the router, and show cached blocks, event rates, gaps, replays and "
        "prefix reuse per policy as they happen.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=_positive, default=d.duration, help="wall seconds")
    p.add_argument("--speedup", type=_positive, default=d.speedup, help="trace time per second")
    p.add_argument(
        "--workers",
        type=int,
        choices=range(1, 17),
        default=d.workers,
        metavar="N",
        help="engines per policy (1-16)",
    )
    p.add_argument("--capacity", type=int, default=d.capacity_blocks, help="GPU blocks per engine")
    p.add_argument(
        "--drop-rate",
        type=float,
        default=d.drop_rate,
        help="fraction of live messages lost on the way (seeded)",
    )
    p.add_argument("--trace", help="Mooncake JSON-lines trace (default: $KVEVENTS_TRACE)")
    p.set_defaults(run=run)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    from kvevents.sim import Demo, DemoConfig, default_trace_path, load_trace

    if not 0 <= args.drop_rate < 1:
        raise ValueError(f"--drop-rate must be in [0, 1), got {args.drop_rate}")
    config = DemoConfig(
        workers=args.workers,
        capacity_blocks=args.capacity,
        speedup=args.speedup,
        duration=args.duration,
        drop_rate=args.drop_rate,
    )
    rows = load_trace(args.trace or default_trace_path())
    if args.verbose == 0:
        # The view shows every gap and replay; per-gap warnings would only tear it.
        logging.getLogger("kvevents.subscribe.subscriber").setLevel(logging.ERROR)
    with Demo(rows, config) as demo:
        try:
            summary = _run_live(demo) if sys.stdout.isatty() else _run_plain(demo)
        except KeyboardInterrupt:
            summary = demo.finish()
    print(_summary(demo, summary))
    return 0


def _run_plain(demo: Demo) -> DemoSummary:
    last = [-10.0]

    def show(view: DemoView) -> None:
        if view.elapsed - last[0] >= 2.0:
            last[0] = view.elapsed
            print(_line(view), flush=True)

    return demo.run(show)


def _line(view: DemoView) -> str:
    lanes = " | ".join(
        f"{lane.policy}: {lane.submitted}/{lane.total} requests, reuse {lane.reuse:.1%}, "
        f"{lane.events_per_s:.0f} events/s, gaps {lane.gaps} replays {lane.replays}"
        for lane in view.lanes
    )
    return f"[{view.elapsed:5.1f}s, trace {view.virtual:5.0f}s] {lanes}"


def _run_live(demo: Demo) -> DemoSummary:
    from rich.console import Group
    from rich.live import Live

    with Live(Group(), refresh_per_second=4, transient=False) as live:

        def show(view: DemoView) -> None:
            live.update(_render(view, demo.config))

        return demo.run(show)


def _render(view: DemoView, config: DemoConfig) -> Group:
    """The live view: the lanes side by side when the terminal is wide enough for both,
    stacked otherwise; each with its latest decision and what decided it."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    parts: list[RenderableType] = [
        f"[bold]kvevents demo[/]  {view.elapsed:4.1f}/{config.duration:g} s wall, "
        f"trace {view.virtual:5.0f} s ({config.speedup:g}x), "
        f"{config.drop_rate:.0%} of live messages dropped on purpose"
    ]
    lanes: list[RenderableType] = []
    for lane in view.lanes:
        table = Table(
            title=f"{lane.policy}: reuse [bold]{lane.reuse:.1%}[/], {lane.events_per_s:.0f} "
            f"events/s, gaps {lane.gaps}, replays {lane.replays} ({lane.replayed} batches), "
            f"lost {lane.unrecoverable}",
            title_justify="left",
        )
        for name in ("worker", "index blocks", "engine blocks", "requests", "events"):
            table.add_column(name, justify="right")
        for w in lane.workers:
            style = "" if w.index_blocks == w.true_blocks else "yellow"
            table.add_row(
                w.worker_id,
                str(w.index_blocks),
                str(w.true_blocks),
                str(w.requests),
                str(w.events),
                style=style,
            )
        bar = ProgressBar(total=max(1, lane.total), completed=lane.submitted, width=50)
        decided = f"last decision: {lane.last_decision}" if lane.last_decision else ""
        lanes.append(Group(table, bar, f"{lane.submitted}/{lane.total} requests", decided))
    return Group(*parts, Columns(lanes, padding=(0, 4)))


def _summary(demo: Demo, summary: DemoSummary) -> str:
    """The closing summary, in lines of at most 100 characters so no terminal of that width
    wraps one mid-number."""
    c = demo.config
    lines = [
        f"demo summary: {summary.elapsed:.1f} s wall, {summary.virtual:.0f} s of trace "
        f"({c.speedup:g}x), {c.workers} workers per policy,",
        f"  {c.drop_rate:.0%} of live messages dropped on purpose",
    ]
    for r in summary.reports:
        acc, feed = r.accuracy, r.feed
        p50 = "-" if r.ttft_p50 is None else f"{r.ttft_p50 * 1000:.0f} ms"
        lines.append(
            f"  {r.policy:<14} {r.requests:>5} requests  reuse {r.reuse:6.1%}  TTFT p50 {p50}"
        )
        lines.append(
            f"  {'':<14} index {'exact' if acc.exact else 'NOT exact'} "
            f"({acc.index_blocks}/{acc.true_blocks} blocks), gaps {feed.gaps}, "
            f"replays {feed.replays}, lost {feed.unrecoverable}"
        )
        per_worker = ", ".join(
            f"{h.worker_id} {h.index_blocks}/{h.true_blocks}" for h in acc.holders
        )
        lines.append(f"  {'':<14} blocks per worker (index/engine): {per_worker}")
    lines += _comparison(summary.reports)
    return "\n".join(lines)


def _comparison(reports: Sequence[PolicyReport]) -> list[str]:
    """KV-aware against round-robin, saying so when they did not serve as many requests."""
    from kvevents.index import DEFAULT_POLICY

    by_policy = {r.policy: r for r in reports}
    aware, rr = by_policy.get(DEFAULT_POLICY), by_policy.get("round_robin")
    if aware is None or rr is None:
        return []
    gain = f" ({aware.reuse / rr.reuse:.1f}x)" if rr.reuse else ""
    lines = [
        f"  KV-aware routing reused {aware.reuse:.1%} of prompt tokens, "
        f"round-robin {rr.reuse:.1%}{gain}"
    ]
    if aware.requests != rr.requests:
        lines.append(
            f"  (unequal samples: {aware.requests} requests against {rr.requests}; "
            "reuse is a share of each lane's own prompt tokens)"
        )
    return lines
