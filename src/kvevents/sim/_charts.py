"""Charts of a routing evaluation as standalone SVG: no plotting library, no fonts to install.

:func:`evaluation_svg` draws two panels side by side: prefix reuse per policy as bars, with the
infinite-cache bound and the pooled-cache reference as dashed lines across them; and the
distribution of time to first token per policy (a CDF over a logarithmic time axis).
:func:`sweep_svg` draws reuse against cluster size for each policy and cache size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape

from kvevents.sim._evaluate import Evaluation

__all__ = ["evaluation_svg", "sweep_svg"]

# One colour per series, readable on white and by most colour-blind readers (Okabe-Ito).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442")
_PANEL_W, _PANEL_H, _PAD = 480, 340, 60
_FONT = 'font-family="sans-serif" font-size="12"'


def _text(x: float, y: float, text: str, *, anchor: str = "middle", extra: str = "") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {_FONT} {extra}>'
        f"{escape(text)}</text>"
    )


def _line(x1: float, y1: float, x2: float, y2: float, colour: str, extra: str = "") -> str:
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" {extra}/>'
    )


def _frame(ox: float, title: str, y_label: str) -> list[str]:
    """Axes, a title and a y label for a panel whose left edge is ``ox``."""
    left, bottom = ox + _PAD, _PANEL_H - _PAD
    return [
        _text(ox + _PANEL_W / 2, 20, title, extra='font-weight="bold"'),
        _line(left, 30, left, bottom, "#333"),
        _line(left, bottom, ox + _PANEL_W - 10, bottom, "#333"),
        _text(
            ox + 14,
            _PANEL_H / 2,
            y_label,
            extra=f'transform="rotate(-90 {ox + 14} {_PANEL_H / 2})"',
        ),
    ]


def _y_ticks(ox: float, top: float, ceiling: float) -> list[str]:
    """Percent ticks on a panel's y axis, from 0 to ``ceiling`` (a share)."""
    left, bottom = ox + _PAD, _PANEL_H - _PAD
    step = next(s for s in (0.05, 0.1, 0.2, 0.25, 0.5) if ceiling / s <= 6)
    out, value = [], 0.0
    while value <= ceiling + 1e-9:
        y = bottom - value / ceiling * (bottom - top)
        out.append(_line(left - 4, y, left, y, "#333"))
        out.append(_text(left - 6, y + 4, f"{value:.0%}", anchor="end"))
        value += step
    return out


def _reuse_panel(ev: Evaluation, ox: float) -> list[str]:
    out = _frame(ox, "prefix reuse per policy", "share of prompt tokens from cache")
    left, bottom, top = ox + _PAD, _PANEL_H - _PAD, 40
    marks = ev.yardsticks
    shares = [r.reuse for r in ev.reports] + ([marks.infinite_cache] if marks else [])
    ceiling = max([*shares, 0.01]) * 1.1
    scale = (bottom - top) / ceiling
    out += _y_ticks(ox, top, ceiling)
    width = (_PANEL_W - _PAD - 20) / max(1, len(ev.reports))
    for i, report in enumerate(ev.reports):
        x, h = left + i * width + width * 0.15, report.reuse * scale
        out.append(
            f'<rect x="{x:.1f}" y="{bottom - h:.1f}" width="{width * 0.7:.1f}" height="{h:.1f}" '
            f'fill="{PALETTE[i % len(PALETTE)]}"><title>{escape(report.policy)}</title></rect>'
        )
        # Inside the bar when it is tall enough: above it is where the reference labels go.
        inside = h > 20
        label_y, colour = (bottom - h + 15, "white") if inside else (bottom - h - 4, "black")
        value = f"{report.reuse:.1%}"
        out.append(_text(x + width * 0.35, label_y, value, extra=f'fill="{colour}"'))
        cx, cy = x + width * 0.35, bottom + 12
        rotate = f'transform="rotate(-25 {cx:.1f} {cy:.1f})"'
        out.append(_text(cx, cy, report.policy, anchor="end", extra=rotate))
    if marks is not None:
        out += _reference_lines(ox, marks.infinite_cache, marks.pooled_cache, scale)
    return out


def _reference_lines(ox: float, infinite: float, pooled: float, scale: float) -> list[str]:
    """Dashed lines for the two yardsticks, labels kept apart when the values are close."""
    left, bottom, right = ox + _PAD, _PANEL_H - _PAD, ox + _PANEL_W - 10
    out: list[str] = []
    upper, lower = bottom - infinite * scale, bottom - pooled * scale
    for y, label_y, name, value in (
        (upper, upper - 4, "infinite cache", infinite),
        (lower, max(lower - 4, upper + 14), "pooled cache", pooled),
    ):
        out.append(_line(left, y, right, y, "#555", 'stroke-dasharray="5,4"'))
        halo = 'stroke="white" stroke-width="3" paint-order="stroke"'  # readable over a bar
        out.append(_text(right - 2, label_y, f"{name} {value:.1%}", anchor="end", extra=halo))
    return out


def _ttft_panel(ev: Evaluation, ox: float) -> list[str]:
    out = _frame(ox, "time to first token (CDF)", "share of requests")
    left, bottom, top, right = ox + _PAD, _PANEL_H - _PAD, 40, ox + _PANEL_W - 10
    samples = [sorted(t for t in r.ttfts if t > 0) for r in ev.reports]
    every = [t for s in samples for t in s]
    if not every:
        return out
    out += _y_ticks(ox, top, 1.0)
    lo, hi = math.log10(min(every)), math.log10(max(every))
    span = max(hi - lo, 1e-9)

    def x_of(seconds: float) -> float:
        return left + (math.log10(seconds) - lo) / span * (right - left)

    for decade in range(math.floor(lo), math.ceil(hi) + 1):
        if lo <= decade <= hi:
            out.append(_text(x_of(10.0**decade), bottom + 16, f"{10.0**decade * 1000:g} ms"))
    for i, (report, times) in enumerate(zip(ev.reports, samples, strict=True)):
        if not times:
            continue
        step = max(1, len(times) // 200)  # 200 points per curve are plenty for the eye
        picked = [*list(enumerate(times))[::step], (len(times) - 1, times[-1])]
        points = " ".join(
            f"{x_of(t):.1f},{bottom - (k + 1) / len(times) * (bottom - top):.1f}" for k, t in picked
        )
        colour = PALETTE[i % len(PALETTE)]
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        # The legend sits top left, where a CDF over a log axis leaves room.
        legend = f'fill="{colour}"'
        out.append(_text(left + 8, top + 14 * i, report.policy, anchor="start", extra=legend))
    return out


def _svg(width: float, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{_PANEL_H}" '
        f'viewBox="0 0 {width:.0f} {_PANEL_H}">'
        f'<rect width="100%" height="100%" fill="white"/>' + "".join(body) + "</svg>\n"
    )


def evaluation_svg(ev: Evaluation) -> str:
    """Reuse per policy against the yardsticks, and each policy's TTFT distribution."""
    return _svg(2 * _PANEL_W, _reuse_panel(ev, 0) + _ttft_panel(ev, _PANEL_W))


def sweep_svg(points: Mapping[str, Sequence[tuple[int, float]]], title: str) -> str:
    """Lines of reuse against engine count, one per series name (e.g. "prefix_load, 4096
    blocks"); series whose name starts with "pooled" are references, drawn dashed. The legend
    sits to the right of the plot."""
    legend_w = 220
    out = _frame(0, title, "prefix reuse")
    left, bottom, top, right = _PAD, _PANEL_H - _PAD, 40, _PANEL_W - 10
    xs = sorted({x for series in points.values() for x, _ in series})
    ceiling = max([y for series in points.values() for _, y in series] + [0.01]) * 1.1
    if not xs:
        return _svg(_PANEL_W + legend_w, out)
    out += _y_ticks(0, top, ceiling)

    def at(x: int, y: float) -> tuple[float, float]:
        slot = xs.index(x) / max(1, len(xs) - 1)
        return left + 30 + slot * (right - left - 60), bottom - y / ceiling * (bottom - top)

    for x in xs:
        out.append(_text(at(x, 0)[0], bottom + 16, f"{x} engines"))
    for i, (name, series) in enumerate(points.items()):
        colour = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in (at(x, y) for x, y in sorted(series)))
        dash = ' stroke-dasharray="6,4"' if name.startswith("pooled") else ""
        out.append(
            f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>'
        )
        y = top + 16 * i
        out.append(
            _line(_PANEL_W + 4, y - 4, _PANEL_W + 24, y - 4, colour, f'stroke-width="2"{dash}')
        )
        out.append(_text(_PANEL_W + 30, y, name, anchor="start"))
    return _svg(_PANEL_W + legend_w, out)
