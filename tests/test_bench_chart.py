"""The benchmark chart: one bar per figure with a baseline, coloured by which way is better."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from chart import lower_is_better, ratio_svg
from harness import Row

SVG = "{http://www.w3.org/2000/svg}"


def test_one_bar_per_row_with_a_baseline_coloured_by_direction() -> None:
    """Rows without a baseline get no bar; a faster throughput and a smaller latency are green,
    a slower throughput is orange."""
    rows = [
        Row("ingest", "live", "blocks/s", 2.0e6, "/s", 1.0e6, "dict"),
        Row("query", "8k", "p50", 40.0, "us", 100.0, "dict"),
        Row("publish", "typical", "batches/s", 50.0, "/s", 100.0, "raw"),
        Row("engine", "trace", "events/s", 5.0, "/s"),
    ]
    assert lower_is_better(rows[1]) and not lower_is_better(rows[0])
    root = ET.fromstring(ratio_svg(rows, "t"))
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert [b.get("fill") for b in bars] == ["#009E73", "#009E73", "#D55E00"]
    titles = [b.find(f"{SVG}title").text for b in bars]  # type: ignore[union-attr]
    assert titles[0].endswith("2.00x") and titles[1].endswith("0.40x")
