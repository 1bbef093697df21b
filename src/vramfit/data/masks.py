"""Loss masks: which parts of each training image the loss counts.

A mask is either a separate image (``masks = "<folder>"``: one per training image, at the same
relative path and stem, any image suffix) or the image's own alpha channel (``alpha_mask``).
White (or opaque) trains, black (or transparent) is masked out, grey weighs in between. The mask
follows its image through EXIF orientation, fit_to_bucket's resize and crop and the optional
mirroring, and is then averaged over each latent cell, so the loss of a cell half covered by the
mask weighs 0.5.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image, ImageOps

from vramfit.data.buckets import CropInfo, resized_size
from vramfit.data.scan import (
    SWAPPING_ORIENTATIONS,
    IMAGE_EXTENSIONS,
    describe_decode_error,
    exif_orientation,
    high_depth_to_uint8,
    not_a_file,
    pil_limits,
)

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")  # the modes load_image composites on white
# A folder listing is reused only while the folder is unchanged; one modified this recently is
# listed afresh each time, as a change within the same timestamp tick would not show.
_RECENT_S = 3.0
_LISTINGS: dict[str, tuple[tuple[int, ...], dict[str, list[str]]]] = {}
_MAX_LISTINGS = 256


# --------------------------------------------------------------------------- finding


def find_mask(image: Path, root: Path, masks_dir: Path) -> Optional[Path]:
    """The mask of dataset image ``image`` (under ``root``), or None where there is none.

    It is ``masks_dir / <same relative folder> / <same stem>.<any image suffix, any case>``; of
    several, a .png is preferred, then the first by name.
    """
    try:
        return _find(image, root, masks_dir)
    except OSError:  # an unreadable folder: mask_problem names it
        return None


def _find(image: Path, root: Path, masks_dir: Path) -> Optional[Path]:
    folder = Path(os.path.abspath(masks_dir)) / _relative(image, root).parent
    names = _listing(folder).get(Path(image).stem)
    if not names:
        return None
    return folder / min(names, key=lambda n: (os.path.splitext(n)[1].lower() != ".png", n))


def _relative(image: Path, root: Path) -> Path:
    return Path(os.path.abspath(image)).relative_to(os.path.abspath(root))


def _listing(folder: Path) -> dict[str, list[str]]:
    """Names of the image files in ``folder`` by stem ({} for a missing folder); OSError if unreadable.

    Datasets keep thousands of images in one folder; listing it once per image would make a scan
    quadratic, so the listing is kept while the folder's inode and timestamps stay the same.
    """
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return {}
    if not stat.S_ISDIR(st.st_mode):
        return {}
    key, stamp = os.fspath(folder), (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    hit = _LISTINGS.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    names: dict[str, list[str]] = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            stem, suffix = os.path.splitext(entry.name)
            if stem and suffix.lower() in IMAGE_EXTENSIONS and not entry.is_dir():
                names.setdefault(stem, []).append(entry.name)
    if time.time() - max(st.st_mtime, st.st_ctime) > _RECENT_S:
        if len(_LISTINGS) >= _MAX_LISTINGS:
            _LISTINGS.clear()
        _LISTINGS[key] = (stamp, names)
    return names


# --------------------------------------------------------------------------- checking


def mask_problem(image: Path, image_size: tuple[int, int], root: Path, masks_dir: Path) -> Optional[str]:
    """Why ``image`` cannot train masked, as one line for the scan's skipped list, or None.

    ``image_size`` is the image's (width, height) after EXIF orientation; the mask's is taken after
    its own. The mask is decoded in full, so what passes here loads at training time.
    """
    masks_dir = Path(os.path.abspath(masks_dir))
    rel = _relative(image, root)
    try:
        mask = _find(image, root, masks_dir)
    except OSError as exc:
        return f"cannot read the masks folder {masks_dir / rel.parent} ({exc.strerror or exc})"
    if mask is None:
        wanted = f"no mask {masks_dir / rel.parent / Path(image).stem}.*"
        if not os.path.isdir(masks_dir):
            what = "is not a folder" if os.path.lexists(masks_dir) else "does not exist"
            return f"{wanted} (masks: {masks_dir} {what})"
        return f"{wanted} (masks)"
    odd = not_a_file(mask)
    if odd:
        return f"mask {mask} is {odd}"
    target = Path(os.path.realpath(mask))
    if not target.is_relative_to(os.path.realpath(masks_dir)):
        return f"mask {mask}: symlink leads outside the masks folder {masks_dir} (to {target})"
    if _same_file(mask, image):
        return f"mask {mask} is the image itself; keep the masks in a folder of their own"
    image_size = (int(image_size[0]), int(image_size[1]))
    with pil_limits(Image.MAX_IMAGE_PIXELS):  # also refuses truncated files instead of padding them
        try:
            if os.stat(mask).st_size == 0:
                return f"mask {mask} is an empty file (0 bytes)"
            with Image.open(mask) as im:  # the header alone: a wrong size needs no decoding
                size = im.size[::-1] if exif_orientation(im) in SWAPPING_ORIENTATIONS else im.size
            if size != image_size:
                return _size_problem(mask, size, image_size)
            loaded = load_mask(mask)
        except Exception as exc:  # PIL raises many types on malformed input; none may stop a scan
            return f"mask {mask}: {describe_decode_error(exc)}"
    if loaded.size != image_size:  # EXIF that names a rotation but cannot be applied
        return _size_problem(mask, loaded.size, image_size)
    return blank_reason(loaded, f"mask {mask}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _size_problem(mask: Path, size: tuple[int, int], image_size: tuple[int, int]) -> str:
    why = (f"mask {mask} is {size[0]}x{size[1]}, its image {image_size[0]}x{image_size[1]}: "
           "make them the same size")
    if size == image_size[::-1]:
        why += " (one is turned by 90 degrees, perhaps by EXIF orientation: save the mask upright, " \
               "as the image shows)"
    return why


def blank_reason(mask: Image.Image, what: str) -> Optional[str]:
    """Why an "L" mask trains nothing (black all over, or a 0/1 label map), or None."""
    peak = mask.getextrema()[1]
    if peak > 1:
        return None
    return (f"{what} is all black (its brightest value is {peak} of 255): nothing of its image would "
            "train; paint what should train white (255)")


# --------------------------------------------------------------------------- loading


def load_mask(path: Path) -> Image.Image:
    """The mask file ``path`` as an upright "L" image.

    Colour masks count by luminance; where a mask has alpha, the alpha multiplies the luminance
    (transparent is masked out, as black is).
    """
    with Image.open(path) as im:
        im.load()
        im = _upright(im)
        picture, alpha = _split_alpha(im)
        if picture.mode.startswith("I") or picture.mode == "F":
            try:  # 16-bit and float masks: rescaled to 8 bits, not clipped at 255 as convert() would
                lum = Image.fromarray(high_depth_to_uint8(np.asarray(picture)))
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        elif picture.mode in ("L", "1", "RGB", "P"):
            lum = picture.convert("L")
        else:  # CMYK, YCbCr, LAB, HSV: by way of RGB
            lum = picture.convert("RGB").convert("L")
    if alpha is None:
        return lum
    product = np.asarray(lum, dtype=np.uint32) * np.asarray(alpha, dtype=np.uint32)
    return Image.fromarray(((product + 127) // 255).astype(np.uint8))


def alpha_of(image: Path) -> Optional[Image.Image]:
    """The upright "L" alpha channel of ``image`` (RGBA, LA, P with transparency, ...), None without one.

    Exactly the images load_image composites on white have alpha here.
    """
    with Image.open(image) as im:
        im.load()
        return _split_alpha(_upright(im))[1]


def _upright(im: Image.Image) -> Image.Image:
    """``im`` with its EXIF orientation applied, as load_image does (broken EXIF: as stored)."""
    if exif_orientation(im) != 1:
        try:
            return ImageOps.exif_transpose(im)
        except Exception:
            pass
    return im


def _split_alpha(im: Image.Image) -> tuple[Image.Image, Optional[Image.Image]]:
    """(the picture without alpha, its "L" alpha or None)."""
    if im.mode in ("LA", "La"):
        la = im.convert("LA")
        return la.getchannel(0), la.getchannel(1)
    if im.mode in _ALPHA_MODES or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        return rgba.convert("RGB"), rgba.getchannel("A")
    return im, None


# --------------------------------------------------------------------------- fitting


def mask_for_bucket(mask: Image.Image, info: CropInfo, flip: bool, factor: int = 8) -> torch.Tensor:
    """``mask`` fitted to its image's bucket, as float32 [1, bucket_h // factor, bucket_w // factor].

    The geometry is fit_to_bucket's (the resized size, the crop box in ``info``), mirrored
    left-right when ``flip``; each latent cell (``factor`` pixels square) gets the exact area
    average of the mask over the part of the original picture it shows, in [0, 1].
    """
    height, width = info.original_size
    if mask.size != (width, height):
        raise ValueError(f"mask is {mask.width}x{mask.height}, its image {width}x{height}")
    if factor < 1:
        raise ValueError(f"factor must be at least 1, got {factor}")
    bucket_h, bucket_w = info.target_size
    resized_w, resized_h = resized_size(width, height, (bucket_w, bucket_h))
    top, left = info.crop_top_left
    if not (0 <= top <= resized_h - bucket_h and 0 <= left <= resized_w - bucket_w):
        raise ValueError(f"crop at (top {top}, left {left}) does not fit the {resized_w}x{resized_h} "
                         f"resized image for the {bucket_w}x{bucket_h} bucket")
    values = np.asarray(mask if mask.mode == "L" else mask.convert("L"), dtype=np.float64) / 255.0
    if flip:
        # Mirroring the cropped image equals cropping the mirrored image at the mirrored offset.
        values = values[:, ::-1]
        left = resized_w - bucket_w - left
    rows, cols = bucket_h // factor, bucket_w // factor
    # Cell edges in the resized image's pixels, mapped back into the mask's (as resizing maps them).
    y_edges = (top + factor * np.arange(rows + 1)) * (height / resized_h)
    x_edges = (left + factor * np.arange(cols + 1)) * (width / resized_w)
    cells = _area_sums(_area_sums(values, x_edges, axis=1), y_edges, axis=0)
    cells /= np.diff(y_edges)[:, None] * np.diff(x_edges)[None, :]
    return torch.from_numpy(np.clip(cells, 0.0, 1.0).astype(np.float32)).unsqueeze(0)


def _area_sums(values: np.ndarray, edges: np.ndarray, axis: int) -> np.ndarray:
    """Integrals of the pixel-constant ``values`` between consecutive fractional ``edges`` on ``axis``."""
    n = values.shape[axis]
    pad = [(0, 0)] * values.ndim
    pad[axis] = (1, 0)
    cumulative = np.pad(np.cumsum(values, axis=axis), pad)  # [i] = sum of the first i pixels
    edges = np.clip(edges, 0.0, n)
    index = np.minimum(np.floor(edges).astype(np.int64), n - 1)
    shape = [1] * values.ndim
    shape[axis] = -1
    frac = (edges - index).reshape(shape)
    # The integral grows linearly inside a pixel, so interpolating the cumulative sums is exact.
    at = np.take(cumulative, index, axis=axis) * (1 - frac) + np.take(cumulative, index + 1, axis=axis) * frac
    return np.diff(at, axis=axis)
