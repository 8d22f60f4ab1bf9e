"""The sim layer's face: the names ``kvevents.sim`` exports (the simulator, its traces, evaluation and demo); its modules are
private."""

from __future__ import annotations

import kvevents.sim

EXPORTED = [
    "POLICY_NAMES",
    "Cluster",
    "ClusterConfig",
    "ConversationsRun",
    "Demo",
    "DemoConfig",
    "DemoSummary",
    "DemoView",
    "DropRule",
    "EngineConfig",
    "Evaluation",
    "LaneView",
    "LoadView",
    "LossyRelay",
    "PolicyReport",
    "PrefixCache",
    "RankCache",
    "Request",
    "SimulatedEngine",
    "SimulationConfig",
    "TraceRow",
    "WorkerView",
    "default_trace_path",
    "engine_chain_hashes",
    "evaluate",
    "evaluation_svg",
    "format_sweep",
    "format_table",
    "load_trace",
    "run_conversations",
    "run_policy",
    "run_trace",
    "sweep",
    "sweep_series",
    "sweep_svg",
    "trace_request",
    "yardsticks",
    "zmq_publisher_factory",
]


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.sim.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.sim.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.sim, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.sim))
