"""The timeline as a picture: an SVG chart inside a self-contained HTML page."""

from __future__ import annotations

import html
import math

from elastrun.observe.timeline.model import Lane, Timeline
from elastrun.observe.timeline.text import attempt_line, header_lines, rel, render_text, secs

_W, _LEFT, _RIGHT, _TOP, _LANE_H, _LEGEND_H = 1000, 190, 30, 44, 64, 40
_COLORS = {
    "succeeded": "#2e9d57",
    "failed": "#d64545",
    "restarted": "#e0892e",
    "re-formed": "#7a8ba8",
    "stopped": "#8a8a8a",
    "running": "#4a7bd0",
}
_RDZV_COLOR = "#f0b429"
_SMALL = ' font-size="10" fill="#666"'
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
svg { font-family: system-ui, sans-serif; font-size: 12px; }
pre { background: #f6f6f6; padding: 12px; overflow-x: auto; font-size: 12px; }
"""


def _nice_step(span_s: float, target: int = 8) -> float:
    raw = max(span_s / target, 1e-3)
    base = 10 ** math.floor(math.log10(raw))
    return float(next((base * mult for mult in (1, 2, 5) if base * mult >= raw), base * 10))


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


class _Canvas:
    """Maps times to x and collects SVG elements."""

    def __init__(self, tl: Timeline) -> None:
        self.tl = tl
        self.span = max(tl.end_ms - tl.start_ms, 1.0)
        self.plot_w = _W - _LEFT - _RIGHT
        self.height = _TOP + _LANE_H * max(len(tl.lanes), 1) + _LEGEND_H
        self.parts: list[str] = []

    def x(self, t_ms: float) -> float:
        return round(_LEFT + (t_ms - self.tl.start_ms) / self.span * self.plot_w, 2)

    def add(self, element: str) -> None:
        self.parts.append(element)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, title: str) -> None:
        self.add(
            f'<rect x="{x}" y="{y}" width="{max(w, 2.0):.2f}" height="{h}" rx="3" '
            f'fill="{fill}"><title>{_esc(title)}</title></rect>'
        )

    def text(self, x: float, y: float, body: str, extra: str = "") -> None:
        self.add(f'<text x="{x}" y="{y}"{extra}>{_esc(body)}</text>')


def _draw_axis(c: _Canvas) -> None:
    step = _nice_step(c.span / 1000)
    bottom = c.height - _LEGEND_H
    n = 0
    while n * step * 1000 <= c.span + 1e-6:
        x = c.x(c.tl.start_ms + n * step * 1000)
        c.add(f'<line x1="{x}" y1="{_TOP - 6}" x2="{x}" y2="{bottom}" stroke="#e3e3e3"/>')
        c.text(x, _TOP - 12, f"+{n * step:g}s", ' text-anchor="middle" fill="#666"')
        n += 1


def _draw_attempts(c: _Canvas, lane: Lane, y0: float) -> None:
    tl = c.tl
    for a in lane.attempts:
        end = a.end_ms if a.end_ms is not None else tl.end_ms
        x0, x1 = c.x(a.start_ms), c.x(end)
        c.rect(x0, y0 + 22, x1 - x0, 22, _COLORS.get(a.outcome, "#999"), attempt_line(tl, a))
        if x1 - x0 > 70:
            c.text(x0 + 6, y0 + 37, f"attempt {a.number}", ' fill="#fff"')
        for f in a.failures:
            c.add(
                f'<circle cx="{c.x(f.t_ms)}" cy="{y0 + 33}" r="6" fill="#b3001b" '
                f'stroke="#fff" stroke-width="1.5"><title>{_esc(f.describe())} at '
                f"{rel(tl, f.t_ms)}</title></circle>"
            )


def _draw_restarts(c: _Canvas, lane: Lane, y0: float) -> None:
    # A dashed line from the failure to workers running again, labelled with its length
    # so that a screenshot (which has no tooltips) still shows it.
    for r in lane.restarts:
        if r.running_ms is None:
            continue
        x0, x1 = c.x(r.failed_ms), c.x(r.running_ms)
        took = secs(r.running_ms - r.failed_ms)
        title = f"restart {r.number}: {took}"
        c.add(
            f'<line x1="{x0}" y1="{y0 + 50}" x2="{x1}" y2="{y0 + 50}" stroke="#555" '
            f'stroke-width="2" stroke-dasharray="4 3"><title>{_esc(title)}</title></line>'
        )
        c.text(x0, y0 + 61, f"restart {took}", ' font-size="10" fill="#555"')


def _draw_lane(c: _Canvas, lane: Lane, y0: float) -> None:
    tl = c.tl
    c.text(10, y0 + 30, lane.name if len(lane.name) <= 26 else lane.name[:25] + "…")
    outcome = lane.outcome or "no final event"
    c.text(10, y0 + 45, outcome if len(outcome) <= 32 else outcome[:31] + "…", _SMALL)
    for s in lane.rendezvous:
        title = f"rendezvous {s.label}: {secs(s.end_ms - s.start_ms)}"
        c.rect(c.x(s.start_ms), y0 + 8, c.x(s.end_ms) - c.x(s.start_ms), 9, _RDZV_COLOR, title)
    _draw_attempts(c, lane, y0)
    _draw_restarts(c, lane, y0)
    for ev in lane.marks:
        x = c.x(ev.t_ms)
        c.add(
            f'<line x1="{x}" y1="{y0 + 20}" x2="{x}" y2="{y0 + 46}" stroke="#333" '
            f'stroke-width="1"><title>{_esc(ev.name)} at {rel(tl, ev.t_ms)}</title></line>'
        )


def _draw_legend(c: _Canvas) -> None:
    y = c.height - 16
    x = float(_LEFT)
    for label, color in [("rendezvous", _RDZV_COLOR), *_COLORS.items()]:
        c.add(f'<rect x="{x}" y="{y - 10}" width="12" height="12" rx="2" fill="{color}"/>')
        c.text(x + 16, y, label)
        x += 30 + 7 * len(label)
    c.add(f'<circle cx="{x + 6}" cy="{y - 4}" r="6" fill="#b3001b"/>')
    c.text(x + 16, y, "worker failure")


def render_svg(tl: Timeline) -> str:
    """The timeline as one SVG element: a row per agent, time running to the right."""
    c = _Canvas(tl)
    _draw_axis(c)
    for i, lane in enumerate(tl.lanes.values()):
        _draw_lane(c, lane, _TOP + i * _LANE_H)
    _draw_legend(c)
    body = "\n".join(c.parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{c.height}" '
        f'viewBox="0 0 {_W} {c.height}" role="img" aria-label="job timeline">\n{body}\n</svg>'
    )


def render_html(tl: Timeline) -> str:
    """A self-contained page (no scripts, no external files): the chart and the text.

    The markup is also well-formed XML, so it can be checked and post-processed.
    """
    title = f"elastrun timeline: {tl.source or 'events'}"
    header = "<br/>".join(_esc(line) for line in header_lines(tl))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8"/>\n'
        f"<title>{_esc(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{_esc(title)}</h1>\n<p>{header}</p>\n{render_svg(tl)}\n"
        f"<h2>Events and summary</h2>\n<pre>{_esc(render_text(tl))}</pre>\n</body>\n</html>\n"
    )
