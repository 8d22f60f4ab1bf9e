"""Charts of the routing evaluation: well-formed SVG with one mark per policy and reference."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from kvevents.sim._charts import evaluation_svg, sweep_svg
from kvevents.sim._cluster import ClusterConfig
from kvevents.sim._evaluate import evaluate
from kvevents.sim._simulate import SimulationConfig
from kvevents.sim._trace import default_trace_path, load_trace

SVG = "{http://www.w3.org/2000/svg}"


def test_the_evaluation_chart_has_a_bar_and_a_curve_per_policy_and_both_references() -> None:
    """Bars of reuse, TTFT curves, dashed yardstick lines and labels naming every policy."""
    rows = load_trace(default_trace_path(), limit=80)
    cluster = ClusterConfig(workers=3, capacity_blocks=256, transport="direct")
    ev = evaluate(rows, ("round_robin", "longest_prefix"), SimulationConfig(cluster=cluster))
    root = ET.fromstring(evaluation_svg(ev))
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert [b.find(f"{SVG}title").text for b in bars] == ["round_robin", "longest_prefix"]  # type: ignore[union-attr]
    heights = [float(b.get("height", "0")) for b in bars]
    assert (heights[1] > heights[0]) == (ev.reports[1].reuse > ev.reports[0].reuse)
    assert len(list(root.iter(f"{SVG}polyline"))) == 2
    dashed = [ln for ln in root.iter(f"{SVG}line") if ln.get("stroke-dasharray")]
    assert len(dashed) == 2
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "infinite cache" in texts and "pooled cache" in texts and "10 ms" in texts


def test_the_sweep_chart_draws_one_line_per_series() -> None:
    """A sweep chart has a polyline per series and a label per engine count."""
    svg = sweep_svg({"a": [(4, 0.3), (8, 0.4)], "b": [(4, 0.2), (8, 0.25)]}, "reuse by size")
    root = ET.fromstring(svg)
    assert len(list(root.iter(f"{SVG}polyline"))) == 2
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "4 engines" in texts and "8 engines" in texts and "reuse by size" in texts
