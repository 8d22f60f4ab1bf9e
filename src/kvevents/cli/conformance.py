"""``kvevents conformance``: drive KV event consumers through fault scenarios, side by side."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from kvevents.cli.common import UsageError, positive_float

if TYPE_CHECKING:
    from kvevents.cli.common import Subparsers
    from kvevents.testing.conformance.run import Report, ScenarioResult
    from kvevents.testing.conformance.stage import Consumer, Scenario

EXAMPLES = """examples:
  kvevents conformance
      every scenario against our subscriber + index, in this process
  kvevents conformance --consumer kvevents --consumer dynamo --markdown
      ours and NVIDIA Dynamo's indexer side by side, as a Markdown table
      (Dynamo comes from .venv-dynamo or $KVEVENTS_DYNAMO_PYTHON)
  kvevents conformance --consumer service --consumer service=http://127.0.0.1:8090
      our HTTP service in a process of its own, and a running 'kvevents serve', by HTTP
  kvevents conformance --list
      what each scenario injects and what it expects

Each cell is PASS, FAIL or NOT OBSERVABLE (the adapter cannot see what the scenario checks),
with a one-line reason. Exit status 0 when no kvevents or service consumer fails a scenario:
other consumers failing is information, not an error. See docs/conformance.md.
"""

_OURS = ("kvevents", "service")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "conformance",
        help="fault-injection conformance of KV event consumers",
        description="Publish scripted faults (drops, duplicates, restarts, trimmed replays, "
        "encoding switches, block-size mismatches...) to KV event consumers and check "
        "their final index state against the truth.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--consumer",
        action="append",
        default=[],
        metavar="NAME[=ARG]",
        help="kvevents, dynamo[=PYTHON] or service[=URL] (repeatable; default: kvevents)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this scenario (repeatable; default: all)",
    )
    p.add_argument(
        "--deadline",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for a consumer to show a sentinel",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--markdown", action="store_true", help="print a Markdown table")
    out.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--reasons", action="store_true", help="give the reason of a PASS too")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.set_defaults(run=run)


def _scenarios(names: list[str]) -> list[Scenario]:
    from kvevents.testing.conformance.scenarios import scenario, scenarios

    if not names:
        return scenarios()
    try:
        return [scenario(n) for n in dict.fromkeys(names)]
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None


def _consumer(text: str) -> Consumer:
    from kvevents.testing.conformance import consumers as adapters

    name, _, arg = text.partition("=")
    if name == "kvevents" and not arg:
        return adapters.KVEventsConsumer()
    if name == "dynamo":
        from kvevents.testing.dynamo import dynamo_unavailable_reason

        if not arg and (reason := dynamo_unavailable_reason()) is not None:
            raise RuntimeError(reason)
        return adapters.DynamoConsumer(python=arg or None)
    if name == "service":
        return adapters.ServiceConsumer(url=arg or None)
    raise UsageError(f"--consumer {text!r}: expected kvevents, dynamo[=PYTHON] or service[=URL]")


def _interrupted(finished: list[ScenarioResult]) -> str:
    done = len(finished)
    return f"kvevents conformance: interrupted after {done} result{'' if done == 1 else 's'}"


def _partial(
    consumers: list[Consumer], scenarios: list[Scenario], finished: list[ScenarioResult]
) -> Report:
    """The report of what finished before an interruption (other cells read "not run")."""
    from kvevents.testing.conformance.run import Report

    ran = {r.consumer for r in finished}
    names = tuple(c.name for c in consumers if c.name in ran)
    return Report(names, tuple(s.name for s in scenarios), tuple(finished))


def _list(scenarios: list[Scenario]) -> None:
    for s in scenarios:
        print(f"{s.name}\n  injects: {s.injects}\n  expects: {s.expects}")


def _progress(result: ScenarioResult) -> None:
    print(
        f"{result.consumer} {result.scenario}: {result.outcome} ({result.seconds:.1f} s)",
        file=sys.stderr,
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    from kvevents.testing.conformance.run import format_report, run_conformance

    scenarios = _scenarios(args.scenario)
    if args.list:
        _list(scenarios)
        return 0
    consumers = [_consumer(text) for text in dict.fromkeys(args.consumer or ["kvevents"])]
    if not args.verbose:
        # The faults are deliberate: the gap and mismatch warnings they cause are noise here.
        logging.getLogger("kvevents").setLevel(logging.CRITICAL)
    finished: list[ScenarioResult] = []

    def progress(result: ScenarioResult) -> None:
        finished.append(result)
        _progress(result)

    try:
        report = run_conformance(consumers, scenarios, deadline=args.deadline, progress=progress)
    except KeyboardInterrupt:
        print(_interrupted(finished), file=sys.stderr)
        if finished:
            print(format_report(_partial(consumers, scenarios, finished), markdown=args.markdown))
        return 130
    versions = {c.name: getattr(c, "version", None) for c in consumers}
    if args.json:
        print(json.dumps({**report.to_dict(), "versions": versions}, indent=2))
    else:
        print(format_report(report, markdown=args.markdown, pass_reasons=args.reasons))
        described = [f"{n} {v}" for n, v in versions.items() if v]
        if described:
            print(f"\nversions: {', '.join(described)}")
    ours = [c.name for c in consumers if c.name.split()[0] in _OURS]
    return 1 if any(report.failures(name) for name in ours) else 0
