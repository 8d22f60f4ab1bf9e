"""The code keeps its shape: classes whole (no mixin re-declaring its host's state), running
counters typed as their stats records are."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import re
import tokenize
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
        (
            _SourceCounts,
            TokenizerStats,
            {"cache_pieces", "cache_hits", "cache_misses", "uncached", "rendered_directly"},
        ),
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


def _names_any(node: ast.AST) -> bool:
    """Whether the node is ``Any`` or ``typing.Any`` (the import line holds neither)."""
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id == "typing" and node.attr == "Any"
    return False


def _annotation_strings(tree: ast.AST) -> list[ast.Constant]:
    """The quoted annotations, whose names the module's own tree does not show."""
    found = []
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.AnnAssign | ast.arg):
            annotations = [node.annotation]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotations = [node.returns]
        for annotation in annotations:
            for part in ast.walk(annotation) if annotation else ():
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    found.append(part)
    return found


def _lines_using_any(source: str) -> set[int]:
    tree = ast.parse(source)
    lines = {node.lineno for node in ast.walk(tree) if _names_any(node)}
    for quoted in _annotation_strings(tree):
        try:
            inner = ast.parse(quoted.value, mode="eval")
        except SyntaxError:
            continue  # a forward reference's text, not an expression to read
        if any(_names_any(node) for node in ast.walk(inner)):
            lines.add(quoted.lineno)
    return lines


def _comments(source: str) -> tuple[set[int], set[int]]:
    """The lines carrying a reason comment, and those that are only a comment. A bare tool
    pragma (``# noqa``, ``# type: ignore[...]``) says nothing about why, so it is no reason."""
    pragma = re.compile(r"#\s*(noqa\b|type:\s*ignore\b|pragma:|fmt:)[^#]*$")
    commented, comment_only = set(), set()
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line = token.start[0]
        if token.type == tokenize.COMMENT:
            if not pragma.fullmatch(token.string):
                commented.add(line)
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    comment_only = commented - code_lines
    return commented, comment_only


def _unexplained_any(path: Path) -> list[int]:
    source = path.read_text()
    commented, comment_only = _comments(source)
    return sorted(
        line
        for line in _lines_using_any(source)
        if line not in commented and line - 1 not in comment_only
    )


def test_every_any_says_why_beside_it() -> None:
    """Every line of the library that names ``Any`` carries a reason: a comment on the line
    or on a comment line directly above it (an alias's definition carries it for its users)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        for line in _unexplained_any(path)
    ]
    print("\n".join(found))
    assert found == []
