"""The benchmark figures that have a same-run baseline, as one SVG bar chart of ratios.

Each bar is one row's ``value / baseline`` on a logarithmic axis with 1.0 (as fast or as
large as the baseline) marked; the label says which way is better for that metric, since a
throughput ratio above 1 is good and a latency or memory ratio above 1 is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from harness import Row

_LOWER_IS_BETTER = ("us", "ms", "ns", "s", "B", "bytes", "MB", "KB")
_ROW_H, _LABEL_W, _PLOT_W = 22, 520, 420


def lower_is_better(row: Row) -> bool:
    """Whether a smaller value wins for this row (times and sizes), judged by its unit."""
    return row.unit.split("/")[0].strip() in _LOWER_IS_BETTER or "p99" in row.metric


def ratio_svg(rows: Sequence[Row], title: str) -> str:
    """Bars of ``value / baseline`` for every row that has a baseline."""
    rated = [r for r in rows if r.ratio is not None and r.ratio > 0]
    height = 60 + _ROW_H * len(rated)
    lo = min([math.log10(r.ratio) for r in rated] + [-1.0])  # type: ignore[arg-type]
    hi = max([math.log10(r.ratio) for r in rated] + [1.0])  # type: ignore[arg-type]

    def x_of(ratio: float) -> float:
        return _LABEL_W + (math.log10(ratio) - lo) / (hi - lo) * _PLOT_W

    one = x_of(1.0)
    out = [
        f'<text x="10" y="20" font-family="sans-serif" font-size="14" font-weight="bold">'
        f"{escape(title)}</text>",
        f'<line x1="{one:.1f}" y1="30" x2="{one:.1f}" y2="{height - 10}" stroke="#333" '
        'stroke-dasharray="4,3"/>',
        f'<text x="{one + 4:.1f}" y="42" font-family="sans-serif" font-size="11">1.0 = baseline</text>',
    ]
    for i, row in enumerate(rated):
        y = 50 + i * _ROW_H
        ratio = row.ratio or 1.0
        better = (ratio < 1) if lower_is_better(row) else (ratio > 1)
        colour = "#009E73" if better else "#D55E00"
        x = x_of(ratio)
        left, width = min(x, one), abs(x - one)
        arrow = "lower is better" if lower_is_better(row) else "higher is better"
        label = f"{row.section}: {row.case}, {row.metric} ({arrow})"
        out.append(
            f'<text x="{_LABEL_W - 6}" y="{y + 14}" text-anchor="end" font-family="sans-serif" '
            f'font-size="11">{escape(label[:90])}</text>'
        )
        out.append(
            f'<rect x="{left:.1f}" y="{y + 3}" width="{max(width, 1):.1f}" height="{_ROW_H - 6}" '
            f'fill="{colour}"><title>{escape(label)}: {ratio:.2f}x</title></rect>'
        )
        out.append(
            f'<text x="{max(x, one) + 4:.1f}" y="{y + 14}" font-family="sans-serif" '
            f'font-size="11">{ratio:.2f}x</text>'
        )
    width = _LABEL_W + _PLOT_W + 60
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><rect width="100%" height="100%" fill="white"/>'
        + "".join(out)
        + "</svg>\n"
    )
