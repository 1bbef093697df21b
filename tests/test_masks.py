"""Tests for vramfit.data.masks: finding, checking, loading and fitting loss masks."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vramfit.data.buckets import CropInfo, fit_to_bucket, resized_size
from vramfit.data.masks import alpha_of, find_mask, load_mask, mask_for_bucket, mask_problem

_ORIENTATION = 0x0112


def _save(path: Path, image: Image.Image, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kw)
    return path


def _white_from(size: tuple[int, int], x0: int) -> Image.Image:
    """An "L" mask, black left of column x0 and white from it on."""
    arr = np.zeros((size[1], size[0]), np.uint8)
    arr[:, x0:] = 255
    return Image.fromarray(arr)


def _position_picture(width: int, height: int) -> Image.Image:
    """RGB whose red rises left to right and green top to bottom: every pixel says where it is."""
    y, x = np.mgrid[0:height, 0:width]
    red, green = x * 255.0 / (width - 1), y * 255.0 / (height - 1)
    return Image.fromarray(np.stack([red, green, np.zeros_like(red)], -1).round().astype(np.uint8))


def _cells(image: Image.Image, channel: int, factor: int = 8) -> np.ndarray:
    arr = np.asarray(image, dtype=np.float64)[..., channel] / 255.0
    h, w = arr.shape
    return arr.reshape(h // factor, factor, w // factor, factor).mean(axis=(1, 3))


# --------------------------------------------------------------------------- fitting


def test_half_white_mask_averages_half_and_keeps_the_right_half_after_crop():
    # 300x100 into the 128x64 bucket: resized to 192x64 and 32 px cut from each side, so the
    # bucket shows original columns 50..250 and the white half (from 150) is its right half.
    mask = _white_from((300, 100), 150)
    _, info = fit_to_bucket(Image.new("RGB", (300, 100)), (128, 64))
    assert info.crop_top_left == (0, 32)
    grid = mask_for_bucket(mask, info, flip=False)
    assert grid.shape == (1, 8, 16) and grid.dtype == torch.float32
    assert grid.mean().item() == pytest.approx(0.5, abs=1e-6)
    assert torch.all(grid[..., 8:] == 1) and torch.all(grid[..., :8] == 0)
    mirrored = mask_for_bucket(mask, info, flip=True)
    assert torch.equal(mirrored, torch.flip(grid, dims=[-1]))

    # A latent cell half covered by white weighs exactly 0.5.
    same = _white_from((128, 64), 4)
    _, info = fit_to_bucket(Image.new("RGB", (128, 64)), (128, 64))
    grid = mask_for_bucket(same, info, flip=False)
    assert torch.all(grid[..., 0] == 0.5) and torch.all(grid[..., 1:] == 1)
    assert torch.all(mask_for_bucket(same, info, flip=True)[..., -1] == 0.5)


@pytest.mark.parametrize("size, bucket, random_crop, seed", [
    ((300, 200), (128, 64), False, 0),    # downscaled, cropped top and bottom
    ((301, 517), (64, 128), True, 3),     # odd sizes, random crop across the width
    ((150, 90), (128, 128), True, 5),     # upscaled, random crop
    ((251, 125), (128, 64), False, 0),    # one pixel to spare, from rounding
])
def test_mask_lines_up_with_the_fitted_image_cell_by_cell(size, bucket, random_crop, seed):
    picture = _position_picture(*size)
    fitted, info = fit_to_bucket(picture, bucket, random_crop=random_crop, rng=random.Random(seed))
    mirrored = fitted.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for channel in (0, 1):  # red says the column, green the row
        mask = picture.getchannel(channel)
        grid = mask_for_bucket(mask, info, flip=False)[0].numpy()
        assert np.abs(grid - _cells(fitted, channel)).max() < 3e-3
        flipped = mask_for_bucket(mask, info, flip=True)[0].numpy()
        assert np.abs(flipped - _cells(mirrored, channel)).max() < 3e-3
    # One pixel off in the crop is visible at that tolerance: the check can fail.
    (resized_w, resized_h), (top, left) = resized_size(*size, bucket), info.crop_top_left
    if resized_w > bucket[0]:
        moved, channel = (top, left + 1 if left < resized_w - bucket[0] else left - 1), 0
    else:
        moved, channel = (top + 1 if top < resized_h - bucket[1] else top - 1, left), 1
    shifted = mask_for_bucket(picture.getchannel(channel),
                              CropInfo(info.original_size, moved, info.target_size), flip=False)
    assert np.abs(shifted[0].numpy() - _cells(fitted, channel)).max() > 3e-3


def test_mask_for_bucket_refuses_a_mask_of_another_size():
    _, info = fit_to_bucket(Image.new("RGB", (300, 100)), (128, 64))
    with pytest.raises(ValueError, match="200x100, its image 300x100"):
        mask_for_bucket(Image.new("L", (200, 100)), info, flip=False)


# --------------------------------------------------------------------------- alpha and loading


def test_alpha_of_rgba_la_and_palette_transparency_and_none_for_rgb(tmp_path):
    alpha = np.zeros((8, 12), np.uint8)
    alpha[:, 6:] = 255
    alpha[0, 0] = 100
    rgba = Image.new("RGBA", (12, 8), (10, 200, 30, 255))
    rgba.putalpha(Image.fromarray(alpha))
    got = alpha_of(_save(tmp_path / "rgba.png", rgba))
    assert got.mode == "L" and np.array_equal(np.asarray(got), alpha)

    la = Image.merge("LA", (Image.new("L", (12, 8), 90), Image.fromarray(alpha)))
    assert np.array_equal(np.asarray(alpha_of(_save(tmp_path / "la.png", la))), alpha)

    palette = Image.new("P", (12, 8), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.paste(0, (0, 0, 6, 8))  # index 0, left half, is the transparent one
    got = alpha_of(_save(tmp_path / "p.png", palette, transparency=0))
    assert np.asarray(got)[:, :6].max() == 0 and np.asarray(got)[:, 6:].min() == 255

    exif = Image.Exif()
    exif[_ORIENTATION] = 8  # shown turned 90 degrees counter-clockwise: the opaque half on top
    got = alpha_of(_save(tmp_path / "turned.png", rgba, exif=exif))
    assert got.size == (8, 12) and np.asarray(got)[:6].min() == 255 and np.asarray(got)[6:, 1:].max() == 0

    assert alpha_of(_save(tmp_path / "rgb.png", Image.new("RGB", (12, 8)))) is None
    assert alpha_of(_save(tmp_path / "p_opaque.png", Image.new("P", (12, 8)))) is None


def test_load_mask_takes_luminance_times_alpha_and_rescales_16_bit(tmp_path):
    colour = Image.new("RGBA", (4, 2), (255, 255, 255, 255))
    colour.putpixel((1, 0), (255, 255, 255, 0))  # white but transparent: masked out
    colour.putpixel((2, 0), (255, 0, 0, 255))  # red: its luminance
    colour.putpixel((3, 0), (255, 255, 255, 128))
    got = load_mask(_save(tmp_path / "c.png", colour))
    assert got.mode == "L"
    assert [got.getpixel((x, 0)) for x in range(4)] == [255, 0, 76, 128]

    deep = Image.fromarray(np.array([[0, 65535], [65535, 0]], np.uint16))
    got = load_mask(_save(tmp_path / "deep.png", deep))
    assert got.mode == "L" and np.array_equal(np.asarray(got), [[0, 255], [255, 0]])


def test_exif_rotated_mask_matches_its_upright_image(tmp_path):
    root, masks = tmp_path / "ds", tmp_path / "masks"
    image = _save(root / "a.png", Image.new("RGB", (64, 48)))
    stored = _white_from((48, 64), 24)  # stored portrait, right half white
    exif = Image.Exif()
    exif[_ORIENTATION] = 6  # shown turned 90 degrees clockwise: landscape, the white half at the bottom
    _save(masks / "a.png", stored, exif=exif)
    assert mask_problem(image, (64, 48), root, masks) is None
    upright = np.asarray(load_mask(masks / "a.png"))
    assert upright.shape == (48, 64)
    assert upright[:24].max() == 0 and upright[24:].min() == 255

    _save(masks / "a.png", stored)  # the same mask without the EXIF rotation
    reason = mask_problem(image, (64, 48), root, masks)
    assert "is 48x64, its image 64x48: make them the same size" in reason
    assert "turned by 90 degrees" in reason


# --------------------------------------------------------------------------- finding and checking


def test_mask_found_by_relative_path_and_stem_with_any_suffix_case(tmp_path):
    root, masks = tmp_path / "ds", tmp_path / "masks"
    a = _save(root / "sub" / "a.jpg", Image.new("RGB", (32, 32)))
    b = _save(root / "b.png", Image.new("RGB", (32, 32)))
    c = _save(root / "c.d.png", Image.new("RGB", (32, 32)))
    _save(masks / "sub" / "a.PNG", Image.new("L", (32, 32), 255))
    _save(masks / "a.png", Image.new("L", (32, 32), 255))  # another folder: not a's mask
    _save(masks / "b.jpg", Image.new("L", (32, 32), 255), format="JPEG")
    _save(masks / "b.Jpeg", Image.new("L", (32, 32), 255), format="JPEG")
    _save(masks / "c.d.jpg", Image.new("L", (32, 32), 255), format="JPEG")
    _save(masks / "c.d.png", Image.new("L", (32, 32), 255))  # png preferred
    (masks / "c.d.txt").write_text("not an image")
    assert find_mask(a, root, masks) == masks / "sub" / "a.PNG"
    assert find_mask(b, root, masks) == masks / "b.Jpeg"  # no png: the first by name
    assert find_mask(c, root, masks) == masks / "c.d.png"
    assert find_mask(root / "sub" / "x.png", root, masks) is None
    for image in (a, b, c):
        assert mask_problem(image, (32, 32), root, masks) is None


def test_a_mask_added_later_is_found(tmp_path):
    root, masks = tmp_path / "ds", tmp_path / "masks"
    image = _save(root / "a.png", Image.new("RGB", (32, 32)))
    _save(masks / "other.png", Image.new("L", (32, 32), 255))
    # A folder changed just now: a mask saved within the same timestamp tick must still be seen.
    assert find_mask(image, root, masks) is None
    _save(masks / "a.png", Image.new("L", (32, 32), 255))
    assert find_mask(image, root, masks) == masks / "a.png"
    (masks / "a.png").unlink()
    long_ago = time.time() - 3600
    os.utime(masks, (long_ago, long_ago))  # an old folder's listing is kept...
    assert find_mask(image, root, masks) is None
    assert find_mask(image, root, masks) is None
    _save(masks / "a.png", Image.new("L", (32, 32), 255))  # ...until the folder changes
    assert find_mask(image, root, masks) == masks / "a.png"
    (masks / "a.png").unlink()
    assert find_mask(image, root, masks) is None


def test_missing_mask_and_mismatched_size_reasons(tmp_path):
    root, masks = tmp_path / "ds", tmp_path / "masks"
    image = _save(root / "sub" / "cat.png", Image.new("RGB", (64, 48)))
    assert mask_problem(image, (64, 48), root, masks) == (
        f"no mask {masks}/sub/cat.* (masks: {masks} does not exist)")
    masks.mkdir()
    assert mask_problem(image, (64, 48), root, masks) == f"no mask {masks}/sub/cat.* (masks)"
    _save(masks / "sub" / "cat.png", Image.new("L", (32, 32), 255))
    assert mask_problem(image, (64, 48), root, masks) == (
        f"mask {masks}/sub/cat.png is 32x32, its image 64x48: make them the same size")


def test_broken_blank_and_escaping_masks_are_refused(tmp_path):
    root, masks, outside = tmp_path / "ds", tmp_path / "masks", tmp_path / "elsewhere"
    images = {name: _save(root / f"{name}.png", Image.new("RGB", (64, 48)))
              for name in ("cut", "black", "labels", "escape", "inside", "broken", "own")}
    noise = np.random.default_rng(0).integers(0, 256, (48, 64), dtype=np.uint8)
    whole = _save(tmp_path / "whole.png", Image.fromarray(noise))  # incompressible: cut in its pixels
    _save(masks / "black.png", Image.new("L", (64, 48), 0))
    (masks / "cut.png").write_bytes(whole.read_bytes()[:2000])  # a real truncated PNG
    _save(masks / "labels.png", _white_from((64, 48), 10).point(lambda v: v // 255))  # 0/1 values
    (masks / "escape.png").symlink_to(_save(outside / "escape.png", Image.new("L", (64, 48), 255)))
    (masks / "inside.png").symlink_to(_save(masks / "shared" / "any.png", Image.new("L", (64, 48), 255)))
    (masks / "broken.png").symlink_to(masks / "gone.png")

    def reason(name: str, folder: Path = masks) -> str | None:
        return mask_problem(images[name], (64, 48), root, folder)

    assert "truncated" in reason("cut")
    assert reason("black") == (f"mask {masks}/black.png is all black (its brightest value is 0 of 255): "
                               "nothing of its image would train; paint what should train white (255)")
    assert "brightest value is 1 of 255" in reason("labels")
    assert reason("escape") == (f"mask {masks}/escape.png: symlink leads outside the masks folder {masks} "
                                f"(to {outside / 'escape.png'})")
    assert reason("inside") is None
    assert reason("broken") == f"mask {masks}/broken.png is a broken symlink (to {masks / 'gone.png'})"
    assert "is the image itself" in reason("own", folder=root)
