"""Inline SVG for the status page: the step timeline and the loss / grad-norm curves.

Pure functions from plain values to SVG text (no I/O, no JavaScript: hover texts are SVG
``<title>`` elements, which every browser shows as a tooltip). Every string that came from the
catalog is escaped here with ``html.escape``: reasons quote file names any job can choose.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Sequence

#: display state -> fill colour (the legend and the table use the same)
COLOURS = {
    "restorable": "#1e8e3e",
    "verified": "#7cb342",  # a verified save resume does not offer (a breakpoint save)
    "verifying": "#f9ab00",
    "incomplete": "#9aa0a6",
    "corrupt": "#d93025",
    "marked bad": "#8430ce",
    "unhealthy": "#e8710a",
    "superseded": "#5b7fa6",
    "deleting": "#80868b",
    "deleted": "#3c4043",
}

#: most points a curve keeps (a run reports health every step: 10^5 points would make the page
#: megabytes on every refresh); each bucket keeps its lowest and highest value, so spikes survive
MAX_POINTS = 1200


def timeline(steps: Sequence[dict[str, Any]], width: int = 1200) -> str:
    """One bar per step (training order, left to right), coloured by ``view_state``, hover text
    ``view_reason``. ``steps``: dicts with ``label``, ``view_state``, ``view_reason``."""
    if not steps:
        return '<p class="empty">no steps catalogued yet</p>'
    height, bar_h, top = 70, 34, 8
    slot = width / len(steps)
    gap = 1.0 if slot >= 4 else 0.0
    parts = [f'<svg class="timeline" role="img" aria-label="timeline of {len(steps)} steps" '
             f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">']
    for i, st in enumerate(steps):
        x = i * slot
        colour = COLOURS.get(st["view_state"], "#000000")
        tip = f"step {st['label']}: {st['view_state']}" + (f" — {st['view_reason']}" if st["view_reason"] else "")
        parts.append(f'<rect x="{x:.2f}" y="{top}" width="{max(slot - gap, 0.5):.2f}" height="{bar_h}" '
                     f'fill="{colour}"><title>{escape(tip)}</title></rect>')
    for i, st in _tick_positions(steps):
        x = (i + 0.5) * slot
        parts.append(f'<text x="{x:.2f}" y="{top + bar_h + 16}" font-size="11" text-anchor="middle">'
                     f'{escape(str(st["label"]))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _tick_positions(steps: Sequence[dict[str, Any]], most: int = 12) -> list[tuple[int, dict[str, Any]]]:
    every = max(1, math.ceil(len(steps) / most))
    idx = list(range(0, len(steps), every))
    if idx[-1] != len(steps) - 1:
        idx.append(len(steps) - 1)
        if len(idx) > 2 and idx[-1] - idx[-2] < every / 2:
            del idx[-2]  # keep the last step's label, drop the one crowding it
    return [(i, steps[i]) for i in idx]


def legend() -> str:
    return "".join(f'<span class="key"><svg width="12" height="12"><rect width="12" height="12" fill="{c}"/></svg> '
                   f'{escape(name)}</span>' for name, c in COLOURS.items())


#: the width, in pixels, one non-finite marker stands for
BAD_MARK_PX = 6


def thin(points: Sequence[tuple[int, float]], most: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most ``most`` points: per bucket of consecutive points its lowest and highest (in step order)."""
    if len(points) <= most:
        return list(points)
    per = math.ceil(len(points) / (most // 2))
    out: list[tuple[int, float]] = []
    for i in range(0, len(points), per):
        bucket = points[i:i + per]
        lo, hi = min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out


def curve(name: str, points: Sequence[tuple[int, float | None]], marks: Sequence[tuple[int, str, str]],
          step_range: tuple[int, int], width: int = 1200, height: int = 180) -> str:
    """A line chart of ``points`` (step, value; None/NaN/inf: not drawn, marked at the top in red)
    with vertical ``marks`` (step, display state, reason) over ``step_range`` on the x axis."""
    pad_l, pad_r, pad_t, pad_b = 64, 12, 14, 22
    finite = [(st, v) for st, v in points if v is not None and math.isfinite(v)]
    bad = [(st, v) for st, v in points if v is not None and not math.isfinite(v)]
    lo_x, hi_x = step_range
    span_x = max(hi_x - lo_x, 1)
    lo_y = min((v for _, v in finite), default=0.0)
    hi_y = max((v for _, v in finite), default=1.0)
    if hi_y - lo_y < 1e-12:
        lo_y, hi_y = lo_y - 0.5, hi_y + 0.5
    plot_w, plot_h = width - pad_l - pad_r, height - pad_t - pad_b

    def sx(step: int) -> float:
        return pad_l + (step - lo_x) / span_x * plot_w

    def sy(v: float) -> float:
        return pad_t + (hi_y - v) / (hi_y - lo_y) * plot_h

    parts = [f'<svg class="curve" role="img" aria-label="{escape(name)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
             f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#dadce0"/>',
             f'<text x="4" y="{pad_t + 10}" font-size="11">{_num(hi_y)}</text>',
             f'<text x="4" y="{pad_t + plot_h}" font-size="11">{_num(lo_y)}</text>',
             f'<text x="{pad_l}" y="{height - 6}" font-size="11">step {lo_x}</text>',
             f'<text x="{width - pad_r}" y="{height - 6}" font-size="11" text-anchor="end">step {hi_x}</text>',
             f'<text x="{pad_l + 6}" y="{pad_t + 12}" font-size="12" font-weight="bold">{escape(name)}</text>']
    for step, state, reason in marks:
        x = sx(step)
        parts.append(f'<line x1="{x:.2f}" y1="{pad_t}" x2="{x:.2f}" y2="{pad_t + plot_h}" stroke="{COLOURS.get(state, "#000")}" '
                     f'stroke-width="2" stroke-dasharray="4 3"><title>{escape(f"step {step}: {state} — {reason}")}</title></line>')
    for line in _segments(thin(sorted(finite)), bad):
        coords = " ".join(f"{sx(st):.1f},{sy(v):.1f}" for st, v in line)
        if len(line) == 1:
            st, v = line[0]
            parts.append(f'<circle cx="{sx(st):.1f}" cy="{sy(v):.1f}" r="2" fill="#1a73e8"/>')
        else:
            parts.append(f'<polyline points="{coords}" fill="none" stroke="#1a73e8" stroke-width="1.5"/>')
    # one marker per few pixels: a run with thousands of loss-scale overflows draws a few hundred
    marked: dict[int, list[tuple[int, float]]] = {}
    for st, v in sorted(bad):
        marked.setdefault(int(sx(st) // BAD_MARK_PX), []).append((st, v))
    for group in marked.values():
        st, v = group[0]
        x = sx(st)
        what = (f"{name} is {v} at step {st}" if len(group) == 1 else
                f"{name} is not finite at {len(group)} steps, {group[0][0]}-{group[-1][0]}")
        parts.append(f'<path d="M{x - 5:.1f},{pad_t} L{x + 5:.1f},{pad_t} L{x:.1f},{pad_t + 9} Z" fill="#d93025">'
                     f'<title>{escape(what)}</title></path>')
    if not finite and not bad:
        parts.append(f'<text x="{pad_l + plot_w / 2}" y="{pad_t + plot_h / 2}" font-size="12" text-anchor="middle">'
                     f'no {escape(name)} reported</text>')
    parts.append("</svg>")
    return "".join(parts)


def _segments(finite: list[tuple[int, float]], bad: list[tuple[int, float]]) -> list[list[tuple[int, float]]]:
    """The polyline broken wherever a non-finite value lies between two points."""
    breaks = sorted(st for st, _ in bad)
    out: list[list[tuple[int, float]]] = []
    current: list[tuple[int, float]] = []
    b = 0
    for st, v in finite:
        crossed = False
        while b < len(breaks) and breaks[b] < st:
            b += 1
            crossed = True
        if crossed and current:
            out.append(current)
            current = []
        current.append((st, v))
    if current:
        out.append(current)
    return out


def _num(v: float) -> str:
    return f"{v:.4g}"
