"""``bench_route``'s chart: the routers side by side, one panel per workload.

Each panel has a bar per router: its cached fraction (prompt tokens served from cache, as the
engines reported them), with the pooled reference marked as a dashed line, and the router's
TTFT p99 and balance (max/mean requests per engine) written beside the bar. The fault panel
shows the cached fraction after the restart and the errors the client saw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from harness import Row

_ROW_H, _LABEL_W, _PLOT_W, _NOTE_W = 20, 250, 360, 260
_COLOURS = {
    "reference": "#999999",
    "kvevents": "#009E73",
    "peer": "#0072B2",
}


def _kind(case: str) -> str:
    if case.startswith(("pooled", "one engine")):
        return "reference"
    return "kvevents" if case.startswith("kvevents") else "peer"


def _metric(rows: Sequence[Row], case: str, prefix: str) -> Row | None:
    return next((r for r in rows if r.case == case and r.metric.startswith(prefix)), None)


def _panel(rows: Sequence[Row], title: str, top: float, fault: bool) -> tuple[list[str], float]:
    cases = list(dict.fromkeys(r.case for r in rows if ": " not in r.case))
    skipped = [r.case for r in rows if ": " in r.case]
    out = [_text(10, top + 14, title, weight="bold")]
    y = top + 24
    value_prefix = "cached fraction after" if fault else "cached fraction (usage)"
    pooled = _metric(rows, next((c for c in cases if c.startswith("pooled")), ""), value_prefix)
    for case in cases:
        bar = _metric(rows, case, value_prefix)
        value = bar.value if bar is not None and not math.isnan(bar.value) else 0.0
        width = _PLOT_W * min(value, 100.0) / 100.0
        out.append(_text(_LABEL_W - 6, y + 14, case, anchor="end"))
        out.append(
            f'<rect x="{_LABEL_W}" y="{y + 3}" width="{max(width, 1):.1f}" height="{_ROW_H - 6}" '
            f'fill="{_COLOURS[_kind(case)]}"><title>{escape(case)}: {value:.1f}%</title></rect>'
        )
        out.append(_text(_LABEL_W + width + 4, y + 14, f"{value:.1f}%", anchor="start"))
        out.append(_text(_LABEL_W + _PLOT_W + 50, y + 14, _note(rows, case, fault), anchor="start"))
        y += _ROW_H
    for case in skipped:
        out.append(_text(_LABEL_W - 6, y + 14, case, anchor="end", colour="#D55E00"))
        y += _ROW_H
    if pooled is not None and not math.isnan(pooled.value):
        x = _LABEL_W + _PLOT_W * pooled.value / 100.0
        out.append(
            f'<line x1="{x:.1f}" y1="{top + 22}" x2="{x:.1f}" y2="{y}" stroke="#333" '
            'stroke-dasharray="4,3"/>'
        )
    return out, y + 12


def _note(rows: Sequence[Row], case: str, fault: bool) -> str:
    if fault:
        errors = _metric(rows, case, "client-visible errors")
        return f"errors: {errors.value:.0f}" if errors is not None else ""
    p99 = _metric(rows, case, "TTFT p99")
    balance = _metric(rows, case, "balance")
    parts = []
    if p99 is not None and not math.isnan(p99.value):
        parts.append(f"TTFT p99 {p99.value:,.0f} ms")
    if balance is not None and not math.isnan(balance.value):
        parts.append(f"balance {balance.value:.2f}")
    return ", ".join(parts)


def _text(
    x: float,
    y: float,
    text: str,
    *,
    anchor: str = "start",
    weight: str = "normal",
    colour: str = "#000",
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-family="sans-serif" '
        f'font-size="11" font-weight="{weight}" fill="{colour}">{escape(text[:80])}</text>'
    )


def route_svg(rows: Sequence[Row], title: str) -> str:
    """One panel per routing section of ``rows`` (chat, trace, fault), routers as bars."""
    sections = [s for s in dict.fromkeys(r.section for r in rows) if s.startswith("Routers on")]
    body = [_text(10, 20, title, weight="bold")]
    top = 34.0
    for section in sections:
        chosen = [r for r in rows if r.section == section]
        panel, top = _panel(chosen, section, top, "killed" in section)
        body += panel
    legend = "bars: cached fraction (engine-reported); dashed line: pooled reference"
    body.append(_text(10, top + 8, legend, colour="#555"))
    width, height = _LABEL_W + _PLOT_W + _NOTE_W, top + 20
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
        f'viewBox="0 0 {width} {height:.0f}"><rect width="100%" height="100%" fill="white"/>'
        + "".join(body)
        + "</svg>\n"
    )
