"""Product photos: a backdrop, the product in its colour with its signature, wear marks, JPEG.

The product is always the one large, saturated region, filled with the
record's `colour`; the category shows in the backdrop, the silhouette and the
glyph (see `signature.py`). Second-hand items may show scratches, scuff marks
and a condition sticker. Per-record variation (position, scale, shade, JPEG
quality) is small, so every record of a category carries the same signals.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterable
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

from schemas import Colour
from vlm_catalog.data.synthetic.shapes import RGB, draw_glyph, draw_shape
from vlm_catalog.data.synthetic.signature import VisualSignature

IMAGE_SIZES = ("small", "realistic")
SMALL_SIDES = (128, 160, 192, 224, 256)
# Side lengths of the benchmark's images, with how often each is drawn.
BENCHMARK_SIDES = (500, 512, 600, 800, 1000, 1024, 1200, 1500, 2000)
_BENCHMARK_SIDE_WEIGHTS = (8, 12, 10, 20, 15, 12, 10, 7, 6)
NON_SQUARE_RATE = 0.1  # non-square images keep an aspect ratio between 2:3 and 3:2

COLOUR_RGB: dict[Colour, RGB] = {
    Colour.black: (30, 30, 32),
    Colour.white: (250, 250, 248),
    Colour.grey: (128, 128, 132),
    Colour.red: (200, 32, 36),
    Colour.orange: (240, 128, 20),
    Colour.yellow: (246, 210, 30),
    Colour.green: (40, 150, 62),
    Colour.blue: (32, 82, 200),
    Colour.purple: (122, 52, 162),
    Colour.pink: (240, 128, 180),
    Colour.brown: (120, 74, 40),
    Colour.beige: (212, 186, 146),
}
WEAR_KINDS = ("none", "scratches", "sticker", "sticker+scratches")


def pick_dimensions(image_size: str, rng: random.Random) -> tuple[int, int]:
    """(width, height): `small` is a 128-256 px square; `realistic` the benchmark's mix."""
    if image_size == "small":
        side = rng.choice(SMALL_SIDES)
        return side, side
    if image_size == "realistic":
        width = rng.choices(BENCHMARK_SIDES, weights=_BENCHMARK_SIDE_WEIGHTS)[0]
        if rng.random() >= NON_SQUARE_RATE:
            return width, width
        heights = [
            side for side in BENCHMARK_SIDES if side != width and 2 / 3 <= side / width <= 1.5
        ]
        return width, rng.choice(heights)
    raise ValueError(f"unknown image_size {image_size!r}; choose one of: {', '.join(IMAGE_SIZES)}")


def _rgb(channels: Iterable[float]) -> RGB:
    red, green, blue = (min(255, max(0, round(c))) for c in channels)
    return red, green, blue


def _shade(colour: RGB, factor: float) -> RGB:
    """Darker (factor < 1) or lighter (factor > 1, towards white) version of `colour`."""
    if factor <= 1:
        return _rgb(c * factor for c in colour)
    return _rgb(c + (255 - c) * (factor - 1) for c in colour)


def _mix(a: RGB, b: RGB, t: float) -> RGB:
    return _rgb(x + (y - x) * t for x, y in zip(a, b, strict=True))


def _luminance(colour: RGB) -> float:
    r, g, b = colour
    return 0.299 * r + 0.587 * g + 0.114 * b


def _jitter(colour: RGB, rng: random.Random, amount: int) -> RGB:
    return _rgb(c + rng.randint(-amount, amount) for c in colour)


def _draw_backdrop(
    draw: ImageDraw.ImageDraw,
    pattern: str,
    tint: RGB,
    width: int,
    height: int,
    rng: random.Random,
) -> None:
    side = min(width, height)
    darker = _shade(tint, 0.93)
    if pattern == "horizon":
        top = round(height * rng.uniform(0.68, 0.74))
        draw.rectangle((0, top, width, height), fill=_shade(tint, 0.9))
        draw.line((0, top, width, top), fill=_shade(tint, 0.82), width=max(1, side // 120))
    elif pattern == "stripes":
        step = side * 0.08
        x = rng.uniform(0, step)
        while x < width:
            draw.rectangle((x, 0, x + step * 0.4, height), fill=darker)
            x += step
    elif pattern == "dots":
        step, radius = side * 0.07, max(1.0, side * 0.007)
        phase = rng.uniform(0, step)
        y = phase
        while y < height:
            x = phase
            while x < width:
                draw.ellipse(
                    (x - radius, y - radius, x + radius, y + radius), fill=_shade(tint, 0.85)
                )
                x += step
            y += step
    elif pattern == "frame":
        margin = side * 0.04
        draw.rectangle(
            (margin, margin, width - margin, height - margin),
            outline=_shade(tint, 0.84),
            width=max(1, round(side * 0.012)),
        )
    elif pattern != "plain":
        raise ValueError(f"unknown backdrop pattern {pattern!r}")


def _draw_scratches(
    draw: ImageDraw.ImageDraw, cx: float, cy: float, size: float, fill: RGB, rng: random.Random
) -> None:
    """Scratches and scuffs over the product: light lines and dull blotches."""
    scratch = _mix(fill, (255, 255, 255), 0.55) if _luminance(fill) < 150 else _shade(fill, 0.55)
    scuff = _mix(fill, (112, 100, 88), 0.5)
    reach = size * 0.32
    for _ in range(rng.randint(4, 7)):
        x, y = cx + rng.uniform(-reach, reach), cy + rng.uniform(-reach, reach)
        dx, dy = rng.uniform(-0.16, 0.16) * size, rng.uniform(-0.16, 0.16) * size
        draw.line((x, y, x + dx, y + dy), fill=scratch, width=max(1, round(size / 110)))
    for _ in range(rng.randint(2, 4)):
        x, y = cx + rng.uniform(-reach, reach), cy + rng.uniform(-reach, reach)
        r = size * rng.uniform(0.03, 0.06)
        draw.ellipse((x - r, y - r * 0.7, x + r, y + r * 0.7), fill=scuff)


@lru_cache(maxsize=32)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):  # Pillow without FreeType: fixed bitmap font
        return ImageFont.load_default()


def _draw_sticker(
    draw: ImageDraw.ImageDraw, label: str, width: int, height: int, rng: random.Random
) -> None:
    """A white sticker with a red border and red capitals in a top corner."""
    side = min(width, height)
    sticker_w, sticker_h = side * 0.4, side * 0.16
    margin = side * 0.04
    x0 = margin if rng.random() < 0.5 else width - margin - sticker_w
    y0 = margin
    red = (204, 22, 22)
    draw.rounded_rectangle(
        (x0, y0, x0 + sticker_w, y0 + sticker_h),
        radius=sticker_h * 0.25,
        fill=(252, 252, 252),
        outline=red,
        width=max(1, round(side / 100)),
    )
    font_size = max(8, round(sticker_h * 0.6))
    text_width = _font(font_size).getlength(label)
    if text_width > sticker_w * 0.85:
        font_size = max(8, int(font_size * sticker_w * 0.85 / text_width))
    font = _font(font_size)
    draw.text((x0 + sticker_w / 2, y0 + sticker_h / 2), label, fill=red, font=font, anchor="mm")


def render_product_image(
    signature: VisualSignature,
    colour: Colour,
    width: int,
    height: int,
    rng: random.Random,
    wear: str = "none",
    sticker_label: str = "USED",
) -> Image.Image:
    """Draw one product photo of `width` x `height` pixels."""
    if wear not in WEAR_KINDS:
        raise ValueError(f"unknown wear {wear!r}; choose one of: {', '.join(WEAR_KINDS)}")
    tint = _jitter(signature.backdrop_tint, rng, 3)
    image = Image.new("RGB", (width, height), tint)
    draw = ImageDraw.Draw(image)
    _draw_backdrop(draw, signature.backdrop_pattern, tint, width, height, rng)

    side = min(width, height)
    size = side * rng.uniform(0.62, 0.72)
    cx = width / 2 + rng.uniform(-0.04, 0.04) * side
    cy = height / 2 + rng.uniform(-0.03, 0.03) * side
    shadow = (cx - size * 0.42, cy + size * 0.44, cx + size * 0.42, cy + size * 0.56)
    draw.ellipse(shadow, fill=_shade(tint, 0.8))

    fill = _jitter(COLOUR_RGB[colour], rng, 8)
    outline = _shade(fill, 0.65) if _luminance(fill) > 60 else _mix(fill, (255, 255, 255), 0.35)
    gx, gy, glyph_size = draw_shape(draw, signature.shape, cx, cy, size, fill, outline, tint)
    ink = (38, 38, 40) if _luminance(fill) > 150 else (250, 250, 250)
    draw_glyph(draw, signature.glyph, gx, gy, glyph_size, ink, fill)

    if wear in ("scratches", "sticker+scratches"):
        _draw_scratches(draw, cx, cy, size, fill, rng)
    if wear in ("sticker", "sticker+scratches"):
        _draw_sticker(draw, sticker_label, width, height, rng)
    return image


def encode_jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
