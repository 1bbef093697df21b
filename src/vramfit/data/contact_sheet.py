"""The contact sheet of `vramfit data`: a few images of every bucket as the first epoch trains them.

Pure PIL drawing (no torch), so it can be tested and reused on its own. Each tile is an image
already fitted to its bucket's aspect at thumbnail size (train/preview.py does the fitting, as
training does); here it is mirrored where that draw is flipped, dimmed where its loss mask is 0,
and labelled with its dataset and the caption it trains with, wrapped to the tile's width. Each
bucket gets a title row.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Optional

from PIL import Image, ImageDraw, ImageFont, ImageOps

DROPPED = "(caption dropped)"  # the label of a draw that trains on the empty caption
CELL = 160  # a tile's box: the thumbnail's longer side, and the width its label wraps to
PAD = 8
COLUMNS = 8  # tiles side by side; more of a bucket go on further lines
MAX_LINES = 7  # caption lines under a tile; a longer caption ends in "..." (the HTML page has it whole)
DIM = 0.7  # how far a masked-out pixel goes towards black
BACKGROUND, TITLE_BAR, TEXT, FAINT = (255, 255, 255), (225, 228, 235), (20, 20, 20), (90, 90, 90)


@dataclass
class Tile:
    """One draw: its thumbnail (fitted to the bucket, not mirrored), where it comes from, its caption."""

    image: Image.Image
    dataset: str
    caption: str  # as trained; "" where the draw drops it
    flipped: bool = False
    mask: Optional[Image.Image] = None  # "L", the thumbnail's size, not mirrored; 0: masked out
    notes: tuple[str, ...] = ()  # e.g. "class image"

    def picture(self) -> Image.Image:
        """The thumbnail as trained: mirrored where flipped, dimmed where the mask is 0."""
        image = self.image.convert("RGB")
        if self.mask is not None:
            image = dimmed(image, self.mask)
        return ImageOps.mirror(image) if self.flipped else image

    @property
    def shown_caption(self) -> str:
        return self.caption if self.caption else DROPPED

    @property
    def heading(self) -> str:
        return ", ".join((self.dataset, *self.notes, *(("mirrored",) if self.flipped else ())))


@dataclass
class Row:
    """One bucket's title and tiles."""

    title: str
    tiles: list[Tile] = field(default_factory=list)


def dimmed(image: Image.Image, mask: Image.Image) -> Image.Image:
    """`image` darkened where `mask` is low (0: by DIM), untouched where it is 255."""
    if mask.size != image.size:
        raise ValueError(f"mask is {mask.width}x{mask.height}, the image {image.width}x{image.height}")
    dark = Image.blend(image, Image.new("RGB", image.size, (0, 0, 0)), DIM)
    return Image.composite(image, dark, mask.convert("L"))


def font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default()


def line_height(face) -> int:
    return face.getbbox("Agjy|")[3] + 3


def wrap(text: str, face, width: int) -> list[str]:
    """`text` in lines no wider than `width` pixels: at spaces, inside a word only where it alone is wider."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if face.getlength(candidate) <= width:
                line = candidate
                continue
            if line:
                lines.append(line)
            line = ""
            for ch in word:  # a word too wide for a line on its own is cut where it must be
                if line and face.getlength(line + ch) > width:
                    lines.append(line)
                    line = ""
                line += ch
        lines.append(line)
    return lines


def label_lines(tile: Tile, face, width: int) -> list[tuple[str, tuple[int, int, int]]]:
    """(text, colour) of the heading's lines and the caption's, at most MAX_LINES of caption."""
    caption = wrap(tile.shown_caption, face, width)
    if len(caption) > MAX_LINES:
        caption = caption[:MAX_LINES]
        last = caption[-1]
        while last and face.getlength(last + "...") > width:
            last = last[:-1]
        caption[-1] = last + "..."
    return [(line, FAINT) for line in wrap(tile.heading, face, width)] + [(line, TEXT) for line in caption]


def render(rows: list[Row], heading: str, cell: int = CELL) -> Image.Image:
    """The sheet: `heading`, then per row a title bar and its tiles side by side (COLUMNS a line),
    each labelled."""
    face = font()
    step = line_height(face)
    columns = min(max([len(r.tiles) for r in rows] + [1]), COLUMNS)
    width = max(PAD + columns * (cell + PAD), int(face.getlength(heading)) + 2 * PAD)
    laid = []  # (title, [lines of (picture, label lines)], row height)
    for row in rows:
        tiles = [(t.picture(), label_lines(t, face, cell)) for t in row.tiles]
        lines = [tiles[i:i + columns] for i in range(0, len(tiles), columns)] or [[]]
        laid.append((row.title, lines, step + PAD + sum(_line_height(line, step) for line in lines)))
    height = PAD + step + PAD + sum(h for *_, h in laid)
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    draw.text((PAD, PAD), heading, fill=TEXT, font=face)
    y = PAD + step + PAD
    for title, lines, row_h in laid:
        draw.rectangle((0, y, width, y + step + 2), fill=TITLE_BAR)
        draw.text((PAD, y + 1), title, fill=TEXT, font=face)
        top = y + step + PAD
        for line in lines:
            picture_h = max([p.height for p, _ in line] + [0])
            for i, (picture, label) in enumerate(line):
                left = PAD + i * (cell + PAD)
                sheet.paste(picture, (left + (cell - picture.width) // 2, top))
                for j, (text, colour) in enumerate(label):
                    draw.text((left, top + picture_h + 4 + j * step), text, fill=colour, font=face)
            top += _line_height(line, step)
        y += row_h
    return sheet


def _line_height(line: list, step: int) -> int:
    """Height of one line of tiles: the tallest picture, the longest label, the gaps."""
    pictures = max([p.height for p, _ in line] + [0])
    labels = max([len(label) for _, label in line] + [0]) * step
    return pictures + 4 + labels + PAD


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()
