"""The code keeps its shape: classes whole (no mixin re-declaring its host's state), running
counters typed as their stats records are."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import msgspec
import pytest
from pydantic import BaseModel

import kvevents
from kvevents.http import HttpCounters, HttpStats
from kvevents.index import ApplyResult, IndexStats
from kvevents.index._records import Counts
from kvevents.integrations.tensorrt_llm import BridgeStats, _BridgeCounts
from kvevents.publish import RecorderStats
from kvevents.publish._recorder import RecorderCounts
from kvevents.route import TokenizerStats
from kvevents.route._tokens import _SourceCounts
from kvevents.scaleout import RelayStats, ReplicaStats
from kvevents.scaleout._relay import RelayCounts
from kvevents.scaleout._replica_records import ReplicaCounts
from kvevents.service import ServiceStats
from kvevents.service._feed import ServiceCounts
from kvevents.sim._cache import CacheCounts, CacheStats
from kvevents.sim._engine import EngineCounts
from kvevents.sim._records import EngineMetrics
from kvevents.subscribe._live import StreamCounts
from kvevents.subscribe._streams import STREAM_COUNTERS

ROOT = Path(kvevents.__file__).parent


def _module(path: Path) -> str:
    parts = ("kvevents", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _declares_fields(cls: type) -> bool:
    """Whether the class's annotations are its fields or an interface's, not state: a
    record (dataclass, named tuple, msgspec struct, pydantic model) or a declared interface
    (a Protocol, an abstract base)."""
    if dataclasses.is_dataclass(cls) or issubclass(cls, tuple | msgspec.Struct | BaseModel):
        return True
    return bool(getattr(cls, "_is_protocol", False) or getattr(cls, "__abstractmethods__", ()))


def _assigned_on_self(node: ast.ClassDef) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
            targets = [sub.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and getattr(part.value, "id", "") == "self":
                    names.add(part.attr)
    return names


def test_no_class_declares_state_it_does_not_set() -> None:
    """A class that annotates an attribute in its body sets it itself: no mixin declares its
    host's private state (those declarations drift from the host's)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # importing it runs the program
        module = importlib.import_module(_module(path))
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef) or _declares_fields(getattr(module, node.name)):
                continue
            declared = {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign)
                and item.value is None
                and isinstance(item.target, ast.Name)
            }
            unset = declared - _assigned_on_self(node)
            if unset:
                found.append(f"{path.relative_to(ROOT)}: {node.name} declares {sorted(unset)}")
    assert found == []


@pytest.mark.parametrize(
    ("running", "stats", "beyond"),
    [
        (ServiceCounts, ServiceStats, set()),
        (ReplicaCounts, ReplicaStats, {"degraded_streams"}),
        (RelayCounts, RelayStats, set()),
        (HttpCounters, HttpStats, set()),
        (RecorderCounts, RecorderStats, set()),
        (CacheCounts, CacheStats, set()),
        (EngineCounts, EngineMetrics, {"virtual_time"}),
        (_BridgeCounts, BridgeStats, {"last_error"}),
        (_SourceCounts, TokenizerStats, {"cache_pieces", "cache_hits", "cache_misses", "uncached"}),
    ],
)
def test_running_counters_are_the_twins_of_their_stats(
    running: type, stats: type, beyond: set[str]
) -> None:
    """Each record of running counters has the fields of its stats record, in order, but
    the levels the stats add (``beyond``): one name per counter."""
    names = [f.name for f in dataclasses.fields(running)]
    assert names == [f.name for f in dataclasses.fields(stats) if f.name not in beyond]


def test_stream_and_index_counters_are_named_as_their_stats() -> None:
    """A stream's running counters are StreamCounters' fields; the index's Counts and every
    ApplyResult field are named as IndexStats' totals."""
    assert [f.name for f in dataclasses.fields(StreamCounts)] == list(STREAM_COUNTERS)
    index_totals = {f.name for f in dataclasses.fields(IndexStats)}
    counts = [f.name for f in dataclasses.fields(Counts)]
    assert set(counts) <= index_totals
    assert set(ApplyResult._fields) <= set(counts)
