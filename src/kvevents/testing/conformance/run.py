"""A fault-injection conformance suite for KV event consumers (indexers).

Each :class:`Scenario` drives one or more scriptable publishers
(:class:`~kvevents.testing.peers.RawPublisher`) through a fault: drops, duplicates, a late
join, a restart, trimmed replays, encoding switches, a wrong block size... While it publishes,
it keeps the *truth*: which engine block hashes a correct consumer must hold per (worker,
rank) stream once everything has settled, which prompts it must match and how far, and which
streams it must report as lossy or as sending rejected events.

A consumer is anything with the :class:`Consumer` methods: our in-process subscriber and
index, our HTTP service, NVIDIA Dynamo's indexer (adapters in
:mod:`kvevents.testing.conformance.consumers`). The runner registers the scenario's streams,
waits until a *sentinel* store shows on every stream (a handshake, then again at the end:
everything published before it has been processed), reads the consumer's state back and
compares it with the truth. Each (consumer, scenario) gets ``PASS``, ``FAIL`` or ``NOT
OBSERVABLE`` (the adapter cannot see something the scenario checks), with a one-line reason.

```python
from kvevents.testing.conformance.run import format_report, run_conformance
from kvevents.testing.conformance.consumers import KVEventsConsumer

report = run_conformance([KVEventsConsumer()])
print(format_report(report, markdown=True))
```
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from kvevents._types import Document
from kvevents.events import StreamKey
from kvevents.testing.conformance.stage import (
    Consumer,
    NotObservable,
    Prompt,
    Scenario,
    Stage,
    StreamDef,
    StreamRegistration,
    Truth,
    u64,
)

__all__ = [
    "Consumer",
    "NotObservable",
    "Outcome",
    "Prompt",
    "Report",
    "Scenario",
    "ScenarioResult",
    "Stage",
    "StreamDef",
    "StreamRegistration",
    "Truth",
    "format_report",
    "judge",
    "report_json",
    "run_conformance",
    "run_scenario",
    "u64",
]

Outcome = Literal["PASS", "FAIL", "NOT OBSERVABLE"]


@dataclass(frozen=True)
class ScenarioResult:
    """The outcome of one scenario on one consumer."""

    consumer: str
    scenario: str
    outcome: Outcome
    reason: str
    seconds: float


@dataclass(frozen=True)
class Report:
    """Every result of a run, in (consumer, scenario) order."""

    consumers: tuple[str, ...]
    scenarios: tuple[str, ...]
    results: tuple[ScenarioResult, ...]

    def result(self, consumer: str, scenario: str) -> ScenarioResult:
        for r in self.results:
            if (r.consumer, r.scenario) == (consumer, scenario):
                return r
        raise KeyError(f"no result for consumer {consumer!r}, scenario {scenario!r}")

    def failures(self, consumer: str) -> list[ScenarioResult]:
        return [r for r in self.results if r.consumer == consumer and r.outcome == "FAIL"]

    def to_dict(self) -> Document:
        return {
            "consumers": list(self.consumers),
            "scenarios": list(self.scenarios),
            "results": [asdict(r) for r in self.results],
        }


# ---------------------------------------------------------------------- checks


def judge(consumer: Consumer, truth: Truth, settled: str | None) -> tuple[Outcome, str]:
    """Compare what ``consumer`` shows with ``truth``: the outcome and a one-line reason.

    Any failed check fails; otherwise a check the adapter cannot observe makes the result
    ``NOT OBSERVABLE``. ``settled``: why the final sentinel was not shown, if it was not.
    """
    failed: list[str] = [] if settled is None else [settled]
    blind: list[str] = []
    passed: list[str] = []
    for check in (_check_held, _check_prompts, _check_losses, _check_rejections):
        verdict, text = check(consumer, truth)
        if verdict == "fail" and check is _check_prompts and failed:
            # Already explained by the blocks: only say how many prompts it cost.
            text = text.partition(":")[0]
        if text:
            {"fail": failed, "blind": blind, "pass": passed}[verdict].append(text)
    if failed:
        return "FAIL", "; ".join(failed)
    if blind:
        return "NOT OBSERVABLE", "; ".join(blind + passed)
    return "PASS", "; ".join(passed)


def _check_held(consumer: Consumer, truth: Truth) -> tuple[str, str]:
    held = consumer.held()
    if held is None:
        return "blind", "held blocks not observable"
    want = sum(len(v) for v in truth.held.values())
    got = missing_n = extra_n = 0
    details: list[str] = []
    for key in sorted(truth.held):
        expected, shown = truth.held[key], set(held.get(key, ()))
        missing, extra = expected - shown, shown - expected
        got += len(expected) - len(missing)
        missing_n, extra_n = missing_n + len(missing), extra_n + len(extra)
        where = f"{key[0]}/{key[1]}"
        if missing:
            details.append(f"{where} lacks {_names(truth, missing)}")
        if extra:
            details.append(f"{where} holds stale {_names(truth, extra)}")
    summary = f"held {got}/{want} expected blocks"
    if not details:
        return "pass", summary
    extra_text = f", {extra_n} unexpected" if extra_n else ""
    return "fail", f"{summary}{extra_text} ({'; '.join(details[:2])})"


def _check_prompts(consumer: Consumer, truth: Truth) -> tuple[str, str]:
    wrong: list[str] = []
    for prompt in truth.prompts:
        matched = consumer.matched(prompt.tokens, prompt.block_size)
        if matched is None:
            return "blind", "prefix matches not observable"
        for key in sorted(truth.held):
            want, got = truth.expected_match(prompt, key), matched.get(key, 0)
            if want != got:
                wrong.append(f"{prompt.name} on {key[0]}/{key[1]} matched {got} blocks, not {want}")
    if wrong:
        more = f" (+{len(wrong) - 2} more)" if len(wrong) > 2 else ""
        count = f"{len(wrong)} wrong match{'es' if len(wrong) > 1 else ''}"
        return "fail", f"{count}: {', '.join(wrong[:2])}{more}"
    n = len(truth.prompts)
    return "pass", f"{n} prompt{'s' if n > 1 else ''} matched" if n else ""


def _check_losses(consumer: Consumer, truth: Truth) -> tuple[str, str]:
    losses = consumer.losses()
    if losses is None:
        return ("blind", "loss report not observable") if truth.lossy else ("pass", "")
    unreported = sorted(k for k in truth.lossy if not losses.get(k, False))
    spurious = sorted(k for k, lost in losses.items() if lost and k not in truth.lossy)
    if unreported:
        return "fail", f"loss on {_keys(unreported)} not reported"
    if spurious:
        return "fail", f"reported a loss on {_keys(spurious)} where none happened"
    return "pass", f"loss reported on {_keys(sorted(truth.lossy))}" if truth.lossy else ""


def _check_rejections(consumer: Consumer, truth: Truth) -> tuple[str, str]:
    if not truth.rejecting:
        return "pass", ""
    rejections = consumer.rejections()
    if rejections is None:
        return "blind", "block-size rejection not observable"
    silent = sorted(k for k in truth.rejecting if not rejections.get(k, 0))
    if silent:
        return "fail", f"block-size mismatch on {_keys(silent)} rejected silently"
    return "pass", f"block-size mismatch reported on {_keys(sorted(truth.rejecting))}"


def _keys(keys: Sequence[StreamKey]) -> str:
    return ", ".join(f"{w}/{r}" for w, r in keys)


def _names(truth: Truth, hashes: set[int]) -> str:
    """``B[0-3], sync1-w0/0`` for the hashes a reason mentions (ranges per prompt)."""
    by_prompt: dict[str, list[int]] = {}
    unnamed = 0
    for h in hashes:
        name = truth.names.get(h)
        if name is None:
            unnamed += 1
            continue
        prompt, _, index = name.rpartition("[")
        by_prompt.setdefault(prompt, []).append(int(index.rstrip("]")))
    parts = [f"{p}[{_ranges(sorted(ix))}]" for p, ix in sorted(by_prompt.items())]
    if unnamed:
        parts.append(f"{unnamed} unknown hashes")
    text = ", ".join(parts[:4])
    return text + (f" (+{len(parts) - 4} more)" if len(parts) > 4 else "")


def _ranges(ix: list[int]) -> str:
    runs: list[list[int]] = []
    for i in ix:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---------------------------------------------------------------------- running


def run_scenario(
    consumer: Consumer, scenario: Scenario, *, deadline: float = 5.0
) -> ScenarioResult:
    """Run one scenario on a started consumer; never raises for the consumer's faults."""
    began = time.monotonic()
    stage = Stage(scenario.streams)
    try:
        consumer.begin(scenario.name)
        outcome, reason = _drive(consumer, scenario, stage, deadline)
    except NotObservable as exc:
        outcome, reason = "NOT OBSERVABLE", str(exc)
    except Exception as exc:  # an adapter or peer error is a result, not a crash of the run
        outcome, reason = "FAIL", f"error: {type(exc).__name__}: {exc}"
    finally:
        try:
            consumer.end()
        finally:
            stage.close()
    return ScenarioResult(consumer.name, scenario.name, outcome, reason, time.monotonic() - began)


def _drive(
    consumer: Consumer, scenario: Scenario, stage: Stage, deadline: float
) -> tuple[Outcome, str]:
    if scenario.prelude is not None:
        scenario.prelude(stage)
    consumer.register(stage.registrations())
    hello = stage.sync(consumer, deadline)
    if hello is not None:
        return "FAIL", f"no handshake: {hello}"
    scenario.script(stage)
    settled = stage.sync(consumer, deadline)
    return judge(consumer, stage.truth, settled)


def run_conformance(
    consumers: Sequence[Consumer],
    scenarios: Sequence[Scenario] | None = None,
    *,
    deadline: float = 5.0,
    progress: Callable[[ScenarioResult], None] | None = None,
) -> Report:
    """Start each consumer, run every scenario on it, close it; the whole table.

    ``scenarios`` defaults to :func:`~kvevents.testing.conformance.scenarios.scenarios`.
    ``deadline`` bounds each wait for a sentinel (seconds); ``progress`` sees each result.
    """
    if scenarios is None:
        from kvevents.testing.conformance.scenarios import scenarios as all_scenarios

        scenarios = all_scenarios()
    results = []
    for consumer in consumers:
        consumer.start()
        try:
            for scenario in scenarios:
                result = run_scenario(consumer, scenario, deadline=deadline)
                results.append(result)
                if progress is not None:
                    progress(result)
        finally:
            consumer.close()
    return Report(
        tuple(c.name for c in consumers), tuple(s.name for s in scenarios), tuple(results)
    )


def format_report(report: Report, *, markdown: bool = False, pass_reasons: bool = False) -> str:
    """A table: one row per scenario, one column per consumer.

    Cells hold the outcome and its reason; a PASS shows its reason only with ``pass_reasons``.
    """
    header = ["scenario", *report.consumers]
    done = {(r.consumer, r.scenario): r for r in report.results}
    rows = [
        [s, *(_cell(done.get((c, s)), pass_reasons) for c in report.consumers)]
        for s in report.scenarios
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(out)


def _cell(result: ScenarioResult | None, pass_reasons: bool) -> str:
    if result is None:  # an interrupted run
        return "not run"
    if not result.reason or (result.outcome == "PASS" and not pass_reasons):
        return result.outcome
    return f"{result.outcome}: {result.reason}"


def report_json(report: Report) -> str:
    """The report as JSON (consumers, scenarios, and one object per result)."""
    return json.dumps(report.to_dict(), indent=2)
