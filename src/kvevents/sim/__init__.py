"""The simulator: engines with a real prefix cache, driven by a request trace, publishing real
event streams; clusters of them behind a router; the routing evaluation and the demo.

The Mooncake synthetic trace ships in ``data/`` and is the default of every command. Names
load on first use, so the engine and its cache work without ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.sim.cache import PrefixCache, RankCache
    from kvevents.sim.cluster import Cluster, ClusterConfig
    from kvevents.sim.engine import EngineConfig, SimulatedEngine
    from kvevents.sim.evaluate import Evaluation, evaluate
    from kvevents.sim.records import Request
    from kvevents.sim.simulate import POLICY_NAMES, PolicyReport, SimulationConfig, run_policy
    from kvevents.sim.trace import TraceRow, default_trace_path, load_trace, trace_request

_HOMES = {
    "kvevents.sim.cache": ("PrefixCache", "RankCache"),
    "kvevents.sim.cluster": ("Cluster", "ClusterConfig"),
    "kvevents.sim.engine": ("EngineConfig", "SimulatedEngine"),
    "kvevents.sim.records": ("Request",),
    "kvevents.sim.evaluate": ("Evaluation", "evaluate"),
    "kvevents.sim.simulate": ("POLICY_NAMES", "PolicyReport", "SimulationConfig", "run_policy"),
    "kvevents.sim.trace": ("TraceRow", "default_trace_path", "load_trace", "trace_request"),
}

__all__ = [
    "POLICY_NAMES",
    "Cluster",
    "ClusterConfig",
    "EngineConfig",
    "Evaluation",
    "PolicyReport",
    "PrefixCache",
    "RankCache",
    "Request",
    "SimulatedEngine",
    "SimulationConfig",
    "TraceRow",
    "default_trace_path",
    "evaluate",
    "load_trace",
    "run_policy",
    "trace_request",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
