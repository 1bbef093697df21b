"""Tests for vramfit.data: dataset scanning/validation, image loading, bucketing, synthetic data."""

from __future__ import annotations

import io
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from vramfit.data.buckets import (
    CropInfo,
    assign_bucket,
    fit_to_bucket,
    image_to_tensor,
    make_buckets,
)
from vramfit.data.scan import Item, Problem, load_image, scan_dataset
from vramfit.data.synth import make_synthetic_dataset


# --------------------------------------------------------------------------- helpers


def _save(path: Path, size=(300, 300), colour=(10, 120, 200), fmt=None, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format=fmt, **kw)
    return path


def _caption(image: Path, text: str | bytes) -> None:
    cap = image.with_suffix(".txt")
    if isinstance(text, bytes):
        cap.write_bytes(text)
    else:
        cap.write_text(text, encoding="utf-8")


def _reasons(result) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in result.problems:
        out.setdefault(p.path, []).append(p.reason)
    return out


# --------------------------------------------------------------------------- caption folder


def test_caption_folder_keeps_good_items_and_reports_each_bad_one(tmp_path):
    root = tmp_path / "ds"
    good1 = _save(root / "good1.png")
    _caption(good1, "a blue square\n")
    good2 = _save(root / "sub" / "good2.jpg", size=(400, 300))
    _caption(good2, "\ufeffa photo with a BOM".encode("utf-8"))  # utf-8-sig is accepted

    noise = np.random.default_rng(0).integers(0, 255, (300, 300, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    (root / "trunc.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    _caption(root / "trunc.png", "cut in half")
    (root / "zero.jpg").write_bytes(b"")
    _caption(root / "zero.jpg", "nothing")
    (root / "fake.png").write_text("I am not a picture", encoding="utf-8")
    _caption(root / "fake.png", "text file")
    _caption(_save(root / "emptycap.png"), "  \n\t ")
    _save(root / "nocap.png")
    _caption(_save(root / "latin1.png"), "caf\xe9 au lait".encode("latin-1"))
    _caption(_save(root / "small.png", size=(100, 80)), "tiny")
    _caption(_save(root / "bomb.png", size=(600, 500)), "huge")
    _caption(_save(root / "bigbomb.png", size=(1000, 1000)), "past PIL's own backstop too")

    limit_before = Image.MAX_IMAGE_PIXELS
    truncated_before = ImageFile.LOAD_TRUNCATED_IMAGES
    result = scan_dataset(root, max_pixels=200_000)
    # PIL's global settings are only changed for the duration of the scan.
    assert Image.MAX_IMAGE_PIXELS == limit_before
    assert ImageFile.LOAD_TRUNCATED_IMAGES == truncated_before

    assert result.source == "captions"
    assert [i.key for i in result.items] == ["good1.png", "sub/good2.jpg"]
    import hashlib

    digest = hashlib.sha256(good1.read_bytes()).hexdigest()
    assert result.items[0] == Item(good1, "good1.png", "a blue square", 300, 300, digest)
    assert result.items[1].caption == "a photo with a BOM"
    assert (result.items[1].width, result.items[1].height) == (400, 300)

    assert _reasons(result) == {
        "bigbomb.png": ["image is over the limit of 200,000 pixels (possible decompression bomb)"],
        "bomb.png": ["image has 300,000 pixels, over the limit of 200,000"],
        "emptycap.png": ["empty caption"],
        "fake.png": ["not an image (cannot identify image file)"],
        "latin1.png": ["caption is not UTF-8"],
        "nocap.png": ["missing caption file nocap.txt"],
        "small.png": ["image too small: 100x80 px, minimum side is 256"],
        "trunc.png": ["truncated image file"],
        "zero.jpg": ["empty file (0 bytes)"],
    }
    assert all(isinstance(p, Problem) for p in result.problems)


def test_caption_extension_and_both_problems_reported(tmp_path):
    img = _save(tmp_path / "a.png", size=(64, 64))
    img.with_suffix(".caption").write_text("a thing", encoding="utf-8")
    _save(tmp_path / "b.png", size=(64, 64))  # too small and uncaptioned: both reported
    result = scan_dataset(tmp_path, caption_extension="caption", min_size=32)
    assert [i.caption for i in result.items] == ["a thing"]
    result = scan_dataset(tmp_path, caption_extension=".caption", min_size=128)
    assert result.items == []
    assert _reasons(result)["b.png"] == [
        "image too small: 64x64 px, minimum side is 128",
        "missing caption file b.caption",
    ]


# --------------------------------------------------------------------------- metadata sources


def test_kohya_json_source(tmp_path):
    root = tmp_path / "ds"
    _save(root / "a.png")
    _save(root / "sub" / "b.jpg")
    c = _save(root / "c.webp")
    _save(root / "d.png")
    _save(tmp_path / "outside.png")
    meta = {
        "a": {"caption": "a cat", "tags": "1girl, solo"},  # key without extension
        "sub/b.jpg": {"tags": "tag only"},
        str(c.resolve()): {"caption": "  caption only  "},  # absolute path inside root
        "d.png": {"caption": "", "tags": "   "},
        "../outside.png": {"caption": "escape"},
        str((tmp_path / "outside.png").resolve()): {"caption": "absolute escape"},
        "missing": {"caption": "gone"},
        "sub/../a.png": {"caption": "same image again"},
        ".": {"caption": "the root itself"},
    }
    meta_path = tmp_path / "meta.json"
    meta_path.write_text(json.dumps(meta), encoding="utf-8")

    result = scan_dataset(root, metadata=meta_path)
    assert result.source == "kohya-json"
    assert [(i.key, i.caption) for i in result.items] == [
        ("a.png", "a cat, 1girl, solo"),
        ("sub/b.jpg", "tag only"),
        ("c.webp", "caption only"),
    ]
    reasons = _reasons(result)
    assert reasons["d.png"] == ["empty caption"]
    assert reasons["../outside.png"] == ["path is outside the dataset folder"]
    assert reasons[str((tmp_path / "outside.png").resolve())] == [
        "path is outside the dataset folder"
    ]
    assert reasons["missing"] == ["image file not found"]
    assert reasons["a.png"] == ["duplicate metadata entry for the same image"]
    assert reasons["."] == ["metadata key does not name a file"]
    assert len(result.problems) == 6


def test_jsonl_source_is_found_automatically(tmp_path):
    _save(tmp_path / "x.png")
    _save(tmp_path / "imgs" / "y.png")
    _save(tmp_path / "z.png")
    _caption(tmp_path / "z.png", "caption files are ignored when metadata.jsonl exists")
    lines = [
        {"file_name": "x.png", "text": "an x"},
        {"file_name": "imgs/y.png", "caption": "a y"},
        {"file_name": "../x.png", "text": "escape"},
        {"file_name": "z.png"},
        {"text": "no file"},
    ]
    body = "\n".join(json.dumps(line) for line in lines[:2]) + "\n\n"
    body += "\n".join(json.dumps(line) for line in lines[2:]) + "\n"
    (tmp_path / "metadata.jsonl").write_text(body, encoding="utf-8")

    result = scan_dataset(tmp_path)
    assert result.source == "jsonl"
    assert [(i.key, i.caption) for i in result.items] == [("x.png", "an x"), ("imgs/y.png", "a y")]
    reasons = _reasons(result)
    assert reasons["../x.png"] == ["path is outside the dataset folder"]
    assert reasons["z.png"] == ["metadata line has no caption column ('text' or 'caption')"]
    assert reasons["metadata.jsonl line 6"] == ["metadata line has no 'file_name'"]


def test_whole_dataset_errors_raise_with_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        scan_dataset(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        scan_dataset(tmp_path, metadata=tmp_path / "meta.json")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        scan_dataset(tmp_path, metadata=bad_json)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"file_name": "a.png", "text": "ok"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl line 2"):
        scan_dataset(tmp_path, metadata=bad_jsonl)
    with pytest.raises(ValueError, match="must end in"):
        (tmp_path / "meta.csv").write_text("a,b\n", encoding="utf-8")
        scan_dataset(tmp_path, metadata=tmp_path / "meta.csv")


# --------------------------------------------------------------------------- image loading


@pytest.mark.parametrize("kind", ["cmyk", "rgba", "palette", "palette_transparent", "gray", "i16"])
def test_load_image_converts_every_mode_to_rgb(tmp_path, kind):
    path = tmp_path / "img.png"
    if kind == "cmyk":
        path = tmp_path / "img.jpg"
        Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(path)  # pure red in CMYK
        expected = (255, 0, 0)
    elif kind == "rgba":
        im = Image.new("RGBA", (40, 30), (0, 0, 0, 0))  # fully transparent black
        im.putpixel((5, 5), (0, 0, 255, 255))
        im.save(path)
        expected = (255, 255, 255)  # composited on white, not black
    elif kind == "palette":
        Image.new("RGB", (40, 30), (0, 200, 0)).convert("P", palette=Image.Palette.ADAPTIVE).save(path)
        expected = (0, 200, 0)
    elif kind == "palette_transparent":
        im = Image.new("P", (40, 30), 0)
        im.putpalette([0, 0, 0, 255, 0, 0])
        im.info["transparency"] = 0
        im.save(path, transparency=0)
        expected = (255, 255, 255)
    elif kind == "gray":
        Image.new("L", (40, 30), 77).save(path)
        expected = (77, 77, 77)
    else:
        Image.fromarray(np.full((30, 40), 40000, dtype=np.uint16)).save(path)
        assert Image.open(path).mode.startswith("I")
        expected = (156, 156, 156)  # 40000 / 65535 * 255, not clipped to white

    image = load_image(path)
    assert image.mode == "RGB" and image.size == (40, 30)
    pixel = image.getpixel((20, 15))
    assert all(abs(a - b) <= 3 for a, b in zip(pixel, expected)), pixel
    if kind == "rgba":
        assert image.getpixel((5, 5)) == (0, 0, 255)


def test_exif_orientation_swaps_size_in_scan_and_load(tmp_path):
    im = Image.new("RGB", (300, 260), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 150, 260))  # left half red as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rotated.jpg"
    im.save(path, exif=exif, quality=95)
    _caption(path, "rotated")

    result = scan_dataset(tmp_path)
    assert result.problems == []
    assert (result.items[0].width, result.items[0].height) == (260, 300)
    loaded = load_image(path)
    assert loaded.size == (260, 300)
    # After turning clockwise, the stored left half ends up on top.
    top, bottom = loaded.getpixel((130, 20)), loaded.getpixel((130, 280))
    assert top[0] > 200 and top[2] < 60, top
    assert bottom[2] > 200 and bottom[0] < 60, bottom


# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("resolution,step", [(1024, 64), (512, 64), (768, 32)])
def test_make_buckets_invariants(resolution, step):
    buckets = make_buckets(resolution, step, max_aspect=4.0)
    assert buckets == sorted(set(buckets)) == make_buckets(resolution, step, 4.0)
    assert (resolution, resolution) in buckets
    for w, h in buckets:
        assert w * h <= resolution**2
        assert w % step == 0 and h % step == 0
        assert min(w, h) >= resolution // 4
        assert max(w, h) / min(w, h) <= 4.0
        assert (h, w) in buckets
    assert len(buckets) > 10  # a real spread of aspect ratios, not just the square


def test_assign_bucket():
    buckets = make_buckets(1024)
    assert assign_bucket(333, 333, buckets) == (1024, 1024)
    w, h = assign_bucket(2000, 1000, buckets)
    assert w > h
    best = min(abs(math.log(bw / bh) - math.log(2)) for bw, bh in buckets)
    assert abs(math.log(w / h) - math.log(2)) == pytest.approx(best)
    assert assign_bucket(1000, 2000, buckets) == (h, w)
    # Ties go to the larger area.
    assert assign_bucket(10, 10, [(64, 64), (128, 128), (128, 64)]) == (128, 128)


def test_fit_to_bucket_no_crop_and_center_crop():
    image, info = fit_to_bucket(Image.new("RGB", (200, 100)), (128, 64))
    assert image.size == (128, 64)
    assert info == CropInfo(original_size=(100, 200), crop_top_left=(0, 0), target_size=(64, 128))
    assert info.time_ids() == [100, 200, 0, 0, 64, 128]

    wide = Image.new("RGB", (300, 100), (255, 0, 0))
    wide.paste((0, 0, 255), (100, 0, 200, 100))  # blue middle third
    image, info = fit_to_bucket(wide, (128, 64))
    assert image.size == (128, 64)
    # Resized to 192x64, then 32 px cut from each side.
    assert info == CropInfo(original_size=(100, 300), crop_top_left=(0, 32), target_size=(64, 128))
    assert info.time_ids() == [100, 300, 0, 32, 64, 128]
    assert image.getpixel((64, 32))[2] > 200  # the centre survived


def test_fit_to_bucket_random_crop_is_seeded_and_in_bounds():
    tall = Image.new("RGB", (100, 400))
    crops = set()
    for seed in range(8):
        a = fit_to_bucket(tall, (64, 128), random_crop=True, rng=random.Random(seed))
        b = fit_to_bucket(tall, (64, 128), random_crop=True, rng=random.Random(seed))
        assert a[1] == b[1] and a[0].size == (64, 128)
        top, left = a[1].crop_top_left
        assert left == 0 and 0 <= top <= 256 - 128  # resized to 64x256
        crops.add(top)
    assert len(crops) > 1


def test_image_to_tensor():
    image = Image.new("RGB", (5, 3), (255, 255, 255))
    image.putpixel((0, 0), (0, 0, 0))
    tensor = image_to_tensor(image)
    assert tensor.shape == (3, 3, 5) and tensor.dtype == torch.float32
    assert tensor[:, 0, 0].tolist() == [-1.0, -1.0, -1.0]
    assert tensor[:, 2, 4].tolist() == [1.0, 1.0, 1.0]
    assert image_to_tensor(Image.new("L", (4, 4), 128)).shape == (3, 4, 4)


# --------------------------------------------------------------------------- synthetic data


def test_synthetic_dataset_is_deterministic_and_scans_clean(tmp_path):
    start = time.perf_counter()
    paths = make_synthetic_dataset(tmp_path / "a", n=16, size=128, seed=3)
    assert time.perf_counter() - start < 1.0
    again = make_synthetic_dataset(tmp_path / "b", n=16, size=128, seed=3)
    other = make_synthetic_dataset(tmp_path / "c", n=16, size=128, seed=4)
    assert len(paths) == 16
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
    assert [p.read_bytes() for p in paths] != [p.read_bytes() for p in other]

    result = scan_dataset(tmp_path / "a", min_size=128)
    assert result.problems == [] and result.ignored == []
    assert len(result.items) == 16
    shapes = {(i.width > i.height) - (i.width < i.height) for i in result.items}
    assert shapes == {-1, 0, 1}  # tall, square and wide
    for item in result.items:
        assert min(item.width, item.height) >= 128
        words = item.caption.split()
        assert words[0] == "a" and words[2] in {"circle", "square", "triangle"}
        assert item.caption.endswith("background")


def test_symlinks_out_of_the_dataset_and_duplicates_are_reported(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    root = tmp_path / "data"
    make_synthetic_dataset(root, n=3, size=64, seed=2)
    secret = outside / "secret.png"
    secret.write_bytes((root / "0000.png").read_bytes())
    (root / "link.png").symlink_to(secret)
    (root / "link.txt").write_text("a linked image")
    (root / "inside.png").symlink_to(root / "0001.png")  # a link that stays inside is fine
    (root / "inside.txt").write_text("another caption for the same picture")
    (root / "copy.png").write_bytes((root / "0002.png").read_bytes())
    (root / "copy.txt").write_text((root / "0002.txt").read_text())
    result = scan_dataset(root, min_size=64)
    reasons = {p.path: p.reason for p in result.problems}
    assert reasons["link.png"].startswith("symlink leads outside the dataset folder")
    assert reasons["copy.png"] == "duplicate of 0002.png (same image and caption)"
    keys = {i.key for i in result.items}
    assert keys == {"0000.png", "0001.png", "0002.png", "inside.png"}
