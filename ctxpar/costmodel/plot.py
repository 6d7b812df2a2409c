"""The scaling plot of docs/scaling.md: predicted TTFT against context length, one
line per P (the fastest layout of that P that fits), log-log, with published
measurements as points, as a self-contained SVG (no plotting library).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ctxpar.costmodel.hardware import HardwareProfile
from ctxpar.costmodel.layout_estimates import estimate
from ctxpar.costmodel.published import META_CP_TTFT, META_HARDWARE, META_MODEL, PublishedTTFT
from ctxpar.costmodel.shapes import ModelShape

W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 420, 70, 110, 40, 50
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def predicted(
    model: ModelShape, hardware: HardwareProfile, contexts: Sequence[int], pcp: Sequence[int]
) -> dict[int, list[tuple[int, float]]]:
    """{P: [(context, TTFT s)]}: the fastest fitting layout of each P at each context."""
    lines: dict[int, list[tuple[int, float]]] = {p: [] for p in pcp}
    for n in contexts:
        for p in pcp:
            fits = [e for e in estimate(model, hardware, n, pcp=[p]) if e.fits]
            if fits:
                lines[p].append((n, min(e.ttft_s for e in fits)))
    return lines


def published_points(model: ModelShape, hardware: HardwareProfile) -> list[PublishedTTFT]:
    """Measurements published for this model and hardware (Meta's CP table), else none."""
    return list(META_CP_TTFT) if (model.name, hardware.name) == (META_MODEL, META_HARDWARE) else []


def svg(title: str, lines: dict[int, list[tuple[int, float]]], points: Sequence[PublishedTTFT]) -> str:
    """The plot: x = context (tokens, log2), y = TTFT (s, log10)."""
    xs = [n for line in lines.values() for n, _ in line] + [pt.context for pt in points]
    ys = [t for line in lines.values() for _, t in line] + [pt.ttft_s for pt in points]
    x0, x1 = math.log2(min(xs)), math.log2(max(xs))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)

    def at(n: float, t: float) -> tuple[float, float]:
        fx = (math.log2(n) - x0) / (x1 - x0)
        fy = (math.log10(t) - y0) / (y1 - y0)
        return LEFT + fx * (W - LEFT - RIGHT), H - BOTTOM - fy * (H - TOP - BOTTOM)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
    ]
    for e in range(int(y0), int(y1) + 1):  # horizontal grid: powers of ten seconds
        _, y = at(2**x0, 10.0**e)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{10.0**e:g} s</text>')
    for k in range(int(x0), int(math.ceil(x1)) + 1, 2):  # vertical grid: every 4x in context
        x, _ = at(2.0**k, 10.0**y0)
        label = f"{2**k // 1024}K" if 2**k < 1 << 20 else f"{2**k >> 20}M"
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle">context (tokens)</text>')
    for i, (p, line) in enumerate(sorted(lines.items())):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(n, t) for n, t in line))
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        ly = TOP + 18 * i
        key = f'x1="{W - RIGHT + 10}" y1="{ly}" x2="{W - RIGHT + 30}" y2="{ly}"'
        out.append(f'<line {key} stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT + 35}" y="{ly + 4}">P = {p}</text>')
        for pt in points:
            if pt.pcp == p:
                x, y = at(pt.context, pt.ttft_s)
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="none" stroke="{colour}" stroke-width="2"/>')
    if points:
        ly = TOP + 18 * len(lines)
        out.append(f'<circle cx="{W - RIGHT + 20}" cy="{ly}" r="4" fill="none" stroke="black" stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT + 35}" y="{ly + 4}">measured</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
