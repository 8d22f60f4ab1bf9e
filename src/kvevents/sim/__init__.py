"""The simulator: engines with a real prefix cache, driven by a request trace, publishing real
event streams; clusters of them behind a router; the routing evaluation and the demo.

The Mooncake synthetic trace ships in ``data/`` and is the default of every command. The
fault injector is :class:`LossyRelay` (a relay that loses what a seeded :class:`DropRule`
says). Its modules are private (``_engine``, ``_cluster``...): import from here. Names load on
first use, so the engine and its cache work without ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.sim._cache import PrefixCache, RankCache
    from kvevents.sim._charts import evaluation_svg, sweep_svg
    from kvevents.sim._closedloop import ConversationsRun, LoadView, run_conversations
    from kvevents.sim._cluster import Cluster, ClusterConfig
    from kvevents.sim._demo import Demo, DemoConfig, DemoSummary, DemoView, LaneView, WorkerView
    from kvevents.sim._engine import EngineConfig, SimulatedEngine, zmq_publisher_factory
    from kvevents.sim._evaluate import Evaluation, evaluate, format_table
    from kvevents.sim._faults import DropRule, LossyRelay
    from kvevents.sim._hashing import engine_chain_hashes
    from kvevents.sim._records import Request
    from kvevents.sim._simulate import POLICY_NAMES, PolicyReport, SimulationConfig, run_policy
    from kvevents.sim._sweep import format_sweep, sweep, sweep_series
    from kvevents.sim._trace import (
        TraceRow,
        default_trace_path,
        load_trace,
        run_trace,
        trace_request,
    )
    from kvevents.sim._yardsticks import yardsticks

__all__ = [
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.sim._cache": (
            "PrefixCache",
            "RankCache",
        ),
        "kvevents.sim._charts": (
            "evaluation_svg",
            "sweep_svg",
        ),
        "kvevents.sim._closedloop": (
            "ConversationsRun",
            "LoadView",
            "run_conversations",
        ),
        "kvevents.sim._cluster": (
            "Cluster",
            "ClusterConfig",
        ),
        "kvevents.sim._demo": (
            "Demo",
            "DemoConfig",
            "DemoSummary",
            "DemoView",
            "LaneView",
            "WorkerView",
        ),
        "kvevents.sim._engine": (
            "EngineConfig",
            "SimulatedEngine",
            "zmq_publisher_factory",
        ),
        "kvevents.sim._evaluate": (
            "Evaluation",
            "evaluate",
            "format_table",
        ),
        "kvevents.sim._faults": (
            "DropRule",
            "LossyRelay",
        ),
        "kvevents.sim._hashing": ("engine_chain_hashes",),
        "kvevents.sim._records": ("Request",),
        "kvevents.sim._simulate": (
            "POLICY_NAMES",
            "PolicyReport",
            "SimulationConfig",
            "run_policy",
        ),
        "kvevents.sim._sweep": (
            "format_sweep",
            "sweep",
            "sweep_series",
        ),
        "kvevents.sim._trace": (
            "TraceRow",
            "default_trace_path",
            "load_trace",
            "run_trace",
            "trace_request",
        ),
        "kvevents.sim._yardsticks": ("yardsticks",),
    },
)
