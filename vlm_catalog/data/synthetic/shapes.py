"""Drawing the product silhouettes (`SHAPES`) and the glyphs printed on them (`GLYPHS`).

Every function draws into a square box given by its centre and side, so the
same signature looks the same at 128 px and at 2000 px.
"""

from __future__ import annotations

import math

from PIL import ImageDraw

RGB = tuple[int, int, int]
Point = tuple[float, float]


def _regular_polygon(cx: float, cy: float, radius: float, sides: int, turn: float) -> list[Point]:
    return [
        (
            cx + radius * math.cos(turn + 2 * math.pi * k / sides),
            cy + radius * math.sin(turn + 2 * math.pi * k / sides),
        )
        for k in range(sides)
    ]


def draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    cx: float,
    cy: float,
    side: float,
    fill: RGB,
    outline: RGB,
    backdrop: RGB,
) -> tuple[float, float, float]:
    """Draw `shape` filling the box (centre, side); return the glyph's (centre x, y, size)."""
    h = side / 2
    x0, y0, x1, y1 = cx - h, cy - h, cx + h, cy + h
    line = max(1, round(side / 60))
    style = {"fill": fill, "outline": outline, "width": line}
    glyph = (cx, cy, side * 0.42)
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), **style)
    elif shape == "rounded_square":
        draw.rounded_rectangle((x0, y0, x1, y1), radius=side * 0.18, **style)
        glyph = (cx, cy, side * 0.46)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], **style)
        glyph = (cx, y0 + side * 0.64, side * 0.3)
    elif shape == "hexagon":
        draw.polygon(_regular_polygon(cx, cy, h, 6, 0.0), **style)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], **style)
        glyph = (cx, cy, side * 0.34)
    elif shape == "capsule":
        draw.rounded_rectangle(
            (cx - side * 0.27, y0, cx + side * 0.27, y1), radius=side * 0.26, **style
        )
        glyph = (cx, cy, side * 0.36)
    elif shape == "wide_box":
        draw.rounded_rectangle(
            (x0, cy - side * 0.3, x1, cy + side * 0.3), radius=side * 0.05, **style
        )
        glyph = (cx, cy, side * 0.42)
    elif shape == "trapezoid":
        top = y0 + side * 0.12
        draw.polygon([(x0 + side * 0.2, top), (x1 - side * 0.2, top), (x1, y1), (x0, y1)], **style)
        glyph = (cx, cy + side * 0.08, side * 0.38)
    elif shape == "arch":
        radius = side * 0.5
        arc = [
            (cx + radius * math.cos(a), y0 + radius + radius * math.sin(a))
            for a in (math.pi + math.pi * k / 24 for k in range(25))
        ]
        draw.polygon(arc + [(x1, y1), (x0, y1)], **style)
        glyph = (cx, cy + side * 0.06, side * 0.42)
    elif shape == "shield":
        shoulder = y0 + side * 0.55
        left, right = x0 + side * 0.08, x1 - side * 0.08
        draw.polygon(
            [(left, y0), (right, y0), (right, shoulder), (cx, y1), (left, shoulder)], **style
        )
        glyph = (cx, y0 + side * 0.38, side * 0.38)
    elif shape == "bottle":
        draw.rectangle((cx - side * 0.1, y0, cx + side * 0.1, y0 + side * 0.3), **style)
        draw.rounded_rectangle(
            (cx - side * 0.3, y0 + side * 0.24, cx + side * 0.3, y1), radius=side * 0.1, **style
        )
        glyph = (cx, y0 + side * 0.62, side * 0.38)
    elif shape == "tag":
        top, bottom, shoulder = y0 + side * 0.18, y1 - side * 0.18, x0 + side * 0.25
        draw.polygon(
            [(x0, cy), (shoulder, top), (x1, top), (x1, bottom), (shoulder, bottom)], **style
        )
        hole = side * 0.045
        hx = x0 + side * 0.16
        draw.ellipse((hx - hole, cy - hole, hx + hole, cy + hole), fill=backdrop, outline=outline)
        glyph = (cx + side * 0.1, cy, side * 0.4)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return glyph


def draw_glyph(
    draw: ImageDraw.ImageDraw,
    glyph: str,
    cx: float,
    cy: float,
    size: float,
    ink: RGB,
    paper: RGB,
) -> None:
    """Draw `glyph` in colour `ink` inside the box (centre, size); `paper` is the colour beneath."""
    h = size / 2
    width = max(2, round(size * 0.14))
    if glyph == "plus":
        draw.rectangle((cx - width / 2, cy - h, cx + width / 2, cy + h), fill=ink)
        draw.rectangle((cx - h, cy - width / 2, cx + h, cy + width / 2), fill=ink)
    elif glyph == "cross":
        d = h * 0.8
        draw.line((cx - d, cy - d, cx + d, cy + d), fill=ink, width=width)
        draw.line((cx - d, cy + d, cx + d, cy - d), fill=ink, width=width)
    elif glyph == "dot":
        r = h * 0.6
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=ink)
    elif glyph == "ring":
        r = h * 0.85
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=ink, width=width)
    elif glyph in ("hbars", "vbars"):
        for k in (-1, 0, 1):
            offset = k * size * 0.33
            if glyph == "hbars":
                draw.rectangle(
                    (cx - h, cy + offset - width / 2, cx + h, cy + offset + width / 2), fill=ink
                )
            else:
                draw.rectangle(
                    (cx + offset - width / 2, cy - h, cx + offset + width / 2, cy + h), fill=ink
                )
    elif glyph == "chevron":
        draw.line(
            [(cx - h, cy - h * 0.4), (cx, cy + h * 0.5), (cx + h, cy - h * 0.4)],
            fill=ink,
            width=width,
            joint="curve",
        )
    elif glyph == "triangle":
        draw.polygon([(cx, cy - h), (cx + h, cy + h * 0.8), (cx - h, cy + h * 0.8)], fill=ink)
    elif glyph == "square":
        s = h * 0.6
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=ink)
    elif glyph == "hollow_square":
        s = h * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), outline=ink, width=width)
    elif glyph == "dot_grid":
        r = h * 0.24
        for dx in (-0.5, 0.5):
            for dy in (-0.5, 0.5):
                x, y = cx + dx * h * 1.2, cy + dy * h * 1.2
                draw.ellipse((x - r, y - r, x + r, y + r), fill=ink)
    elif glyph == "diagonals":
        for k in (-1, 0, 1):
            offset = k * size * 0.36
            draw.line(
                (cx - h * 0.7 + offset, cy + h * 0.7, cx + h * 0.7 + offset, cy - h * 0.7),
                fill=ink,
                width=width,
            )
    elif glyph == "checker":
        s = h * 0.85
        draw.rectangle((cx - s, cy - s, cx, cy), fill=ink)
        draw.rectangle((cx, cy, cx + s, cy + s), fill=ink)
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), outline=ink, width=max(1, width // 2))
    elif glyph == "star":
        points = []
        for k in range(10):
            radius = h if k % 2 == 0 else h * 0.42
            angle = -math.pi / 2 + math.pi * k / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=ink)
    elif glyph == "zigzag":
        xs = [cx - h + size * k / 4 for k in range(5)]
        ys = [cy + (h * 0.45 if k % 2 else -h * 0.45) for k in range(5)]
        draw.line(list(zip(xs, ys, strict=True)), fill=ink, width=width, joint="curve")
    elif glyph == "crescent":
        r = h * 0.85
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=ink)
        shift = r * 0.55
        draw.ellipse(
            (cx - r + shift, cy - r - shift * 0.3, cx + r + shift, cy + r - shift * 0.3), fill=paper
        )
    else:
        raise ValueError(f"unknown glyph {glyph!r}")
