"""The content-addressed cache, driven through `vramfit cache` as a user would."""
from __future__ import annotations

from pathlib import Path

from PIL import Image

from conftest import train_args
from vramfit.cli import main


def _cache(images: Path, tmp_path: Path, cache: Path, capsys, *extra: str) -> str:
    args = train_args(images, tmp_path / "out", cache, *extra)
    args[0] = "cache"
    assert main(args) == 0
    return capsys.readouterr().out


def test_second_run_reuses_and_changes_invalidate_exactly_their_entries(images, tmp_path, capsys):
    cache = tmp_path / "cache"
    first = _cache(images, tmp_path, cache, capsys)
    assert "latents_cached 4" in first and "text_cached 4" in first
    second = _cache(images, tmp_path, cache, capsys)
    assert "latents_cached 0, latents_reused 4" in second and "text_cached 0, text_reused 4" in second
    captions = sorted(images.glob("*.txt"))
    captions[0].write_text("a completely new caption")
    pngs = sorted(images.glob("*.png"))
    img = Image.open(pngs[1]).convert("RGB")
    img.putpixel((0, 0), (1, 2, 3))
    img.save(pngs[1])
    third = _cache(images, tmp_path, cache, capsys)
    assert "latents_cached 1, latents_reused 3" in third
    assert "text_cached 1, text_reused 3" in third
    # a different storage dtype is a different entry for every item
    fourth = _cache(images, tmp_path, cache, capsys, "cache.dtype=bf16")
    assert "latents_cached 4" in fourth and "text_cached 4" in fourth


def test_random_crop_and_bucket_settings_are_part_of_the_key(images, tmp_path, capsys):
    cache = tmp_path / "cache"
    _cache(images, tmp_path, cache, capsys)
    out = _cache(images, tmp_path, cache, capsys, "data.random_crop=true")
    assert "latents_cached 4" in out and "text_reused 4" in out


def test_corrupt_entry_is_rebuilt_not_used(images, tmp_path, capsys):
    cache = tmp_path / "cache"
    _cache(images, tmp_path, cache, capsys)
    entries = sorted((cache / "entries" / "latents").rglob("*.safetensors"))
    assert len(entries) == 4
    entries[0].write_bytes(entries[0].read_bytes()[:50])
    # training reads the damaged entry, notices, and encodes that item again
    args = train_args(images, tmp_path / "run", cache)
    assert main(args) == 0
    assert entries[0].stat().st_size > 50 or not entries[0].exists()
