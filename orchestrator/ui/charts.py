"""SVG line charts drawn on the server: no JavaScript, no charting library, nothing fetched by the page.

A chart is built from numbers and labels only; every label (a run name, a decision, a GPU's name) is
escaped on the way into the SVG, so nothing of it is read as markup. Colours and dashes are presentation
attributes, not `style`, so the dashboard's Content-Security-Policy (no inline styles) leaves them alone.

This module must not read the registry or know what a run is: pages.py hands it series and marks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

from markupsafe import Markup

WIDTH, HEIGHT = 960, 240
EMPTY_HEIGHT = 56
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 26, 34
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@dataclass(frozen=True)
class Series:
    name: str
    points: list[tuple[float, float]]
    colour: str = PALETTE[0]


@dataclass(frozen=True)
class Mark:
    """A vertical line at x (`vertical`), or a horizontal one at y, with a label; `dash` draws it dashed."""

    at: float
    label: str
    colour: str
    dash: bool = False
    vertical: bool = True


@dataclass(frozen=True)
class Band:
    """A horizontal band from `low` to `high` (a 95% interval)."""

    low: float
    high: float
    label: str
    colour: str


@dataclass
class Chart:
    title: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    bands: list[Band] = field(default_factory=list)
    x_label: str = "seconds since the run started"
    y_range: tuple[float, float] | None = None
    empty_text: str = "not reported"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [low, high] (steps of 1, 2 or 5 times a power of ten)."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def tick_text(value: float, step: float) -> str:
    if step >= 1:
        return f"{value:,.0f}"
    decimals = min(max(0, -math.floor(math.log10(step))), 6)
    return f"{value:,.{decimals}f}"


def render(chart: Chart, width: int = WIDTH, height: int = HEIGHT) -> Markup:
    """The chart as an inline <svg> element (safe to put in a page as it is)."""
    if not any(s.points for s in chart.series):
        height = EMPTY_HEIGHT  # a title and a word, not a blank plot
    xs = [x for s in chart.series for x, _ in s.points] + [m.at for m in chart.marks if m.vertical]
    ys = [y for s in chart.series for _, y in s.points] + [m.at for m in chart.marks if not m.vertical]
    ys += [v for b in chart.bands for v in (b.low, b.high)]
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img"'
           f' aria-label="{_e(chart.title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{LEFT}" y="16" font-size="13" font-weight="bold" fill="#222">{_e(chart.title)}</text>']
    if not any(s.points for s in chart.series):
        out.append(f'<text class="empty" x="{width / 2:.0f}" y="{height / 2 + 10:.0f}" text-anchor="middle" fill="#777">'
                   f'{_e(chart.empty_text)}</text></svg>')
        return Markup("".join(out))
    x0, x1 = min(xs), max(xs)
    y0, y1 = chart.y_range or (min(ys), max(ys))
    if not chart.y_range:
        pad = (y1 - y0) * 0.06 or abs(y1) * 0.06 or 1.0
        y0, y1 = (0.0 if y0 >= 0 and y0 - pad < 0 else y0 - pad), y1 + pad
    if x1 <= x0:
        x1 = x0 + 1.0
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y0) / (y1 - y0)) * plot_h

    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fff" stroke="#ccc"/>')
    y_ticks = nice_ticks(y0, y1)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    for tick in y_ticks:
        if y0 <= tick <= y1:
            out.append(f'<line x1="{LEFT}" x2="{width - RIGHT}" y1="{py(tick):.1f}" y2="{py(tick):.1f}" stroke="#eee"/>'
                       f'<text x="{LEFT - 6}" y="{py(tick) + 4:.1f}" font-size="11" text-anchor="end" fill="#555">'
                       f'{_e(tick_text(tick, y_step))}</text>')
    x_ticks = nice_ticks(x0, x1, 8)
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    for tick in x_ticks:
        if x0 <= tick <= x1:
            out.append(f'<text x="{px(tick):.1f}" y="{height - BOTTOM + 15}" font-size="11" text-anchor="middle"'
                       f' fill="#555">{_e(tick_text(tick, x_step))}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{height - 4}" font-size="11" text-anchor="middle" fill="#555">'
               f'{_e(chart.x_label)}</text>'
               f'<text x="14" y="{TOP + plot_h / 2:.0f}" font-size="11" text-anchor="middle" fill="#555"'
               f' transform="rotate(-90 14 {TOP + plot_h / 2:.0f})">{_e(chart.y_label)}</text>')
    for band in chart.bands:
        top, bottom = py(min(max(band.high, y0), y1)), py(min(max(band.low, y0), y1))
        out.append(f'<rect class="band" x="{LEFT}" y="{top:.1f}" width="{plot_w}" height="{max(bottom - top, 1):.1f}"'
                   f' fill="{band.colour}" fill-opacity="0.18"><title>{_e(band.label)}</title></rect>')
    for series in chart.series:
        points = " ".join(f"{px(x):.1f},{py(min(max(y, y0), y1)):.1f}" for x, y in series.points)
        out.append(f'<polyline class="series" data-name="{_e(series.name)}" points="{points}" fill="none"'
                   f' stroke="{series.colour}" stroke-width="1.6"><title>{_e(series.name)}</title></polyline>')
    for k, mark in enumerate(chart.marks):
        dash = ' stroke-dasharray="5 4"' if mark.dash else ""
        if mark.vertical:
            x = px(mark.at)
            out.append(f'<line class="mark" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="{mark.colour}"'
                       f' stroke-width="1.3"{dash}><title>{_e(mark.label)}</title></line>'
                       f'<text class="mark-label" x="{x + 3:.1f}" y="{TOP + 12 + 12 * (k % 3)}" font-size="11"'
                       f' fill="{mark.colour}">{_e(mark.label)}</text>')
        elif y0 <= mark.at <= y1:
            y = py(mark.at)
            out.append(f'<line class="mark" x1="{LEFT}" x2="{width - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"'
                       f' stroke="{mark.colour}" stroke-width="1.3"{dash}><title>{_e(mark.label)}</title></line>')
    out.append(_legend(chart, width))
    out.append("</svg>")
    return Markup("".join(out))


def _legend(chart: Chart, width: int) -> str:
    """The series and horizontal marks named at the top right, one after another."""
    items = [(s.name, s.colour, False) for s in chart.series if len(chart.series) > 1]
    items += [(m.label, m.colour, m.dash) for m in chart.marks if not m.vertical]
    items += [(b.label, b.colour, False) for b in chart.bands]
    parts, x = [], width - RIGHT
    for label, colour, dash in reversed(items):
        x -= 7 * len(label) + 30
        dashed = ' stroke-dasharray="5 4"' if dash else ""
        parts.append(f'<line x1="{x}" x2="{x + 18}" y1="12" y2="12" stroke="{colour}" stroke-width="3"{dashed}/>'
                     f'<text x="{x + 22}" y="16" font-size="11" fill="#333">{_e(label)}</text>')
    return "".join(parts)


def _e(text: str) -> str:
    return escape(str(text), quote=True)
