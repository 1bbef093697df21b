"""A tiny synthetic captioned dataset for smoke tests, demos and CI.

The images are simple coloured shapes with exact captions, so a run can be exercised end to
end (scan, bucket, train) without downloading anything, and a fine-tune that learns at all
shows it quickly. Aspect ratios vary so that bucketing gets exercised too.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

_COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
_SHAPES = ("circle", "square", "triangle")
# (width, height) multipliers of the short side: square, wide and tall in turn.
_ASPECTS = ((1, 1), (3, 2), (2, 3), (2, 1), (1, 2), (4, 3), (3, 4))


def make_synthetic_dataset(
    root: Path, n: int = 16, size: int = 128, seed: int = 0
) -> list[Path]:
    """Write ``n`` PNG images with same-name ``.txt`` captions into ``root``; return the images.

    Every side is at least ``size`` pixels (scan such a folder with ``min_size <= size``).
    The output depends only on ``n``, ``size`` and ``seed``.
    """
    if n < 0 or size < 8:
        raise ValueError(f"need n >= 0 and size >= 8, got n={n}, size={size}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = sorted(_COLOURS)
    paths = []
    for index in range(n):
        aspect_w, aspect_h = _ASPECTS[index % len(_ASPECTS)]
        short = size
        width = short * aspect_w // min(aspect_w, aspect_h)
        height = short * aspect_h // min(aspect_w, aspect_h)
        shape = rng.choice(_SHAPES)
        colour, background = rng.sample(names, 2)  # distinct, so the shape is visible

        image = Image.new("RGB", (width, height), _COLOURS[background])
        _draw_shape(ImageDraw.Draw(image), shape, _COLOURS[colour], width, height, rng)
        path = root / f"{index:04d}.png"
        image.save(path, format="PNG")
        caption = f"a {colour} {shape} on a {background} background"
        path.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    fill: tuple[int, int, int],
    width: int,
    height: int,
    rng: random.Random,
) -> None:
    # Between a third and two thirds of the short side, placed anywhere it fits.
    extent = rng.randint(min(width, height) // 3, 2 * min(width, height) // 3)
    left = rng.randint(0, width - extent)
    top = rng.randint(0, height - extent)
    box = (left, top, left + extent, top + extent)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(
            [(left + extent / 2, top), (left, top + extent), (left + extent, top + extent)],
            fill=fill,
        )
