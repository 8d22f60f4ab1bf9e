"""A fault-injection conformance suite for KV event consumers (docs/conformance.md).

Scenarios (``scenarios``) stage real publishers that drop, duplicate, reorder, restart and
switch encodings (``stage``); each consumer (``consumers``: ours, our HTTP service, NVIDIA
Dynamo's indexer) is judged on its final index state (``run``).
"""

from kvevents.testing.conformance.run import format_report, report_json, run_conformance
from kvevents.testing.conformance.scenarios import scenario, scenario_names, scenarios

__all__ = [
    "format_report",
    "report_json",
    "run_conformance",
    "scenario",
    "scenario_names",
    "scenarios",
]
