"""Aspect-ratio bucketing with SDXL's size and crop conditioning.

Training every image at one square size either squashes or crops away much of a non-square
picture. Bucketing instead groups images by aspect ratio into a set of resolutions of roughly
the same pixel area, so each batch has one shape and little is cropped. SDXL additionally
conditions on the original size, the crop offset and the target size ("time ids"); the crop
information produced here is recorded exactly the way the diffusers SDXL training scripts
record it, so a model fine-tuned with vramfit sees the conditioning it was pre-trained with.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


def make_buckets(
    resolution: int = 1024, step: int = 64, max_aspect: float = 4.0
) -> list[tuple[int, int]]:
    """Return the (width, height) buckets for a base ``resolution``, sorted.

    For every width that is a multiple of ``step`` the largest multiple-of-``step`` height
    with ``width * height <= resolution**2`` is taken (kohya's construction), limited so the
    aspect ratio stays within ``max_aspect`` and both sides are at least a quarter of the
    resolution. The square bucket is always included. Of several buckets with exactly the
    same aspect ratio only the largest is kept: the smaller ones could never be chosen.
    """
    if resolution < step or step <= 0:
        raise ValueError(f"resolution ({resolution}) must be at least step ({step}) > 0")
    if max_aspect < 1.0:
        raise ValueError(f"max_aspect must be >= 1, got {max_aspect}")
    max_area = resolution * resolution
    min_side = max(step, (resolution // 4) // step * step)
    square = resolution // step * step

    best: dict[tuple[int, int], tuple[int, int]] = {}  # reduced aspect -> largest bucket

    def add(width: int, height: int) -> None:
        g = math.gcd(width, height)
        ratio = (width // g, height // g)
        if ratio not in best or width * height > best[ratio][0] * best[ratio][1]:
            best[ratio] = (width, height)

    add(square, square)
    for width in range(min_side, max_area // min_side + 1, step):
        # Largest height within the area budget and the aspect limit.
        height = min(max_area // width, int(width * max_aspect)) // step * step
        if height < min_side or width > height * max_aspect:
            continue
        add(width, height)
        add(height, width)  # keep the set symmetric, as kohya does
    return sorted(best.values())


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """Pick the bucket whose aspect ratio is closest in log space; ties go to the larger area."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if not buckets:
        raise ValueError("no buckets to choose from")
    target = math.log(width / height)
    # Rounded so that ratios equal up to float noise count as ties.
    return min(
        buckets,
        key=lambda b: (round(abs(math.log(b[0] / b[1]) - target), 12), -b[0] * b[1], b),
    )


@dataclass(frozen=True)
class CropInfo:
    """SDXL micro-conditioning for one training image; all pairs are (height, width)-ordered."""

    original_size: tuple[int, int]  # (h, w) of the image before resizing
    crop_top_left: tuple[int, int]  # (top, left) in the resized image's pixels
    target_size: tuple[int, int]  # (h, w) of the bucket

    def time_ids(self) -> list[int]:
        """SDXL's add_time_ids: orig_h, orig_w, crop_top, crop_left, target_h, target_w."""
        return [*self.original_size, *self.crop_top_left, *self.target_size]


def resized_size(width: int, height: int, bucket: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) fit_to_bucket resizes a ``width`` x ``height`` image to before cropping.

    Public so that masks and other per-pixel data can follow the image's geometry exactly.
    """
    bucket_w, bucket_h = bucket
    scale = max(bucket_w / width, bucket_h / height)
    # max() guards against float rounding leaving the image one pixel short of the bucket.
    return max(bucket_w, round(width * scale)), max(bucket_h, round(height * scale))


def fit_to_bucket(
    image: Image.Image,
    bucket: tuple[int, int],
    *,
    random_crop: bool = False,
    rng: random.Random | None = None,
) -> tuple[Image.Image, CropInfo]:
    """Resize ``image`` to cover the (width, height) ``bucket`` keeping aspect, then crop to it.

    The crop is centred unless ``random_crop`` is set, in which case ``rng`` (or a fresh
    unseeded generator) picks the offset.
    """
    bucket_w, bucket_h = bucket
    width, height = image.size
    resized_w, resized_h = resized_size(width, height, bucket)
    if (resized_w, resized_h) != (width, height):
        image = image.resize((resized_w, resized_h), Image.Resampling.LANCZOS)

    spare_w, spare_h = resized_w - bucket_w, resized_h - bucket_h
    if random_crop:
        rng = rng if rng is not None else random.Random()
        top, left = rng.randint(0, spare_h), rng.randint(0, spare_w)
    else:
        # Same rounding as the diffusers SDXL scripts' center-crop bookkeeping.
        top, left = int(round(spare_h / 2.0)), int(round(spare_w / 2.0))
    if spare_w or spare_h:
        image = image.crop((left, top, left + bucket_w, top + bucket_h))
    info = CropInfo(
        original_size=(height, width),
        crop_top_left=(top, left),
        target_size=(bucket_h, bucket_w),
    )
    return image, info


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """Convert a PIL image to a float32 [3, H, W] tensor scaled to [-1, 1] (the VAE's range)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    array = np.asarray(image, dtype=np.uint8)
    tensor = torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
    return tensor.to(torch.float32).div_(127.5).sub_(1.0)
