"""`vramfit data`: the preview of what a run trains (counts, skipped files, buckets, caption tokens,
cache entries, a contact sheet and an HTML page) through the CLI, without loading a weight."""
from __future__ import annotations

import contextlib
import io
import re
import shutil
import statistics
from pathlib import Path

import pytest
from PIL import Image
from transformers import CLIPTokenizer

from vramfit.cli import main
from vramfit.data.contact_sheet import Tile
from vramfit.data.synth import make_synthetic_dataset

SIZE = 64
BOLD = "a <b>bold</b> & caption"
LONG = "word " * 40  # 40 words of the tiny byte-level vocabulary: far over CLIP's 77 tokens
CONFIG = """
[[data.datasets]]
name = "main"
path = "{main}"
repeats = 3

[[data.datasets]]
name = "flips"
path = "{flips}"
flip = true
caption_dropout = 0.5
shuffle_tags = true
"""


def _sets(root: Path, cache: Path, *extra: str) -> list[str]:
    sets = ["model.path=tiny:ssd1b", f"data.resolution={SIZE}", f"data.min_size={SIZE}",
            "data.bucket_step=32", f"cache.dir={cache}", f"output.dir={root / 'out'}", "train.batch_size=2",
            "train.epochs=2", *extra]
    return [arg for s in sets for arg in ("--set", s)]


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def previewed(tmp_path_factory, cache_root) -> dict:
    """Two datasets (repeats 3 with a broken file; flip, caption dropout and tag shuffles), previewed
    once with an HTML page."""
    root = tmp_path_factory.mktemp("preview")
    main_dir, flips = root / "main", root / "flips"
    make_synthetic_dataset(main_dir, n=5, size=SIZE, seed=1)  # sides 1:1, 3:2, 2:3, 2:1, 1:2
    make_synthetic_dataset(flips, n=4, size=SIZE, seed=2)  # 1:1, 3:2, 2:3, 2:1
    (main_dir / "0002.txt").write_text(BOLD + "\n")
    (main_dir / "0004.txt").write_text(LONG + "\n")
    (main_dir / "broken.png").write_bytes(b"not a png at all")
    (main_dir / "broken.txt").write_text("a broken file\n")
    for i in (0, 2, 3):  # captions of their own (the synthetic ones may repeat main's)
        (flips / f"000{i}.txt").write_text(f"flipped image {i}\n")
    (flips / "0001.txt").write_text("sks, dog\n")  # two tags: two orders, two caption variants
    config = root / "preview.toml"
    config.write_text(CONFIG.format(main=main_dir, flips=flips))
    cache = cache_root / "data-preview"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        code, out, err = _run(["data", str(config), "--no-progress", "--html", str(root / "report.html"),
                               *_sets(root, cache)])
    assert code == 0, err
    return {"root": root, "config": config, "cache": cache, "out": out, "main": main_dir, "flips": flips}


def _section(out: str, name: str) -> str:
    """The report's lines about one dataset (up to the blank line after them)."""
    start = out.index(f"('{name}'):")
    return out[start:out.index("\n\n", start)]


def test_the_report_counts_each_dataset_its_repeats_skipped_files_and_buckets(previewed):
    out = previewed["out"]
    main_part, flips = _section(out, "main"), _section(out, "flips")
    assert out.startswith(f"data.datasets[0] ('main'): {previewed['main']}\n")
    assert "usable images: 5; repeats 3: 15 images an epoch" in main_part
    assert "usable images: 4; repeats 1: 4 images an epoch" in flips
    assert "held out (validation): 0" in main_part and "regularization: no" in flips
    assert "skipped: 1\n    broken.png: not an image" in main_part and "skipped: 0" in flips
    # 1:1, 3:2 and 2:3 go to the square bucket, 2:1 to 96x32, 1:2 to 32x96 (the 64 px buckets)
    buckets = dict(re.findall(r"^\s+(\d+x\d+)\s+(\d+)\s+#+$", main_part, re.M))
    assert buckets == {"64x64": "3", "96x32": "1", "32x96": "1"}
    assert dict(re.findall(r"^\s+(\d+x\d+)\s+(\d+)\s+#+$", flips, re.M)) == {"64x64": "3", "96x32": "1"}
    # the epoch: main's images three times over, flips' once; micro-batches of 2 per bucket
    assert "the first epoch: 19 images in 10 micro-batches at train.batch_size 2" in out
    rows = re.findall(r"^\s+(\d+x\d+)\s+(\d+)\s+(\d+)\s+#+$", out, re.M)
    totals = {b: (int(n), int(m)) for b, n, m in rows}
    assert totals == {"64x64": (12, 6), "96x32": (4, 2), "32x96": (3, 2)}
    assert "train.epochs = 2: 20 micro-batches at grad_accum 1: train.steps = 20" in out
    # main's 5 captions, flips' 3 plus 2 orders of "sks, dog", and the dropped caption's empty one;
    # 9 images, the 4 of flips mirrored too
    assert "text cache entries: 11: 10 distinct caption variants and the empty caption" in out
    assert "latent cache entries: 13: 9 as the images are, 4 mirrored (flip)" in out
    assert f"contact sheet: {previewed['root'] / 'out' / 'data-preview.png'}" in out


def test_caption_lengths_are_counted_in_each_tokenizers_tokens(previewed, cache_root):
    folder = next((previewed["cache"] / "tiny").glob("tiny-ssd1b*"))
    captions = [p.read_text().strip() for p in sorted(previewed["main"].glob("000*.txt"))]
    stats = []
    for sub in ("tokenizer", "tokenizer_2"):
        lengths = [len(ids) for ids in CLIPTokenizer.from_pretrained(folder / sub)(captions).input_ids]
        assert sum(n > 77 for n in lengths) == 1  # the long caption
        stats.append(f"    {sub} (CLIP): min {min(lengths)} / median {statistics.median(lengths):g} / "
                     f"max {max(lengths)}; 1 over its limit of 77")
    assert "\n".join(stats) in _section(previewed["out"], "main")
    assert "caption tokens (5 caption variants):" in _section(previewed["out"], "main")
    assert "caption tokens (5 caption variants):" in _section(previewed["out"], "flips")


def test_the_contact_sheet_and_the_html_page(previewed):
    sheet = previewed["root"] / "out" / "data-preview.png"
    with Image.open(sheet) as im:
        im.verify()
    with Image.open(sheet) as im:
        # three bucket rows, the widest with four tiles of 160 px
        assert im.format == "PNG" and 4 * 160 <= im.width <= 800 and 3 * 160 < im.height < 2000
    page = (previewed["root"] / "report.html").read_text()
    assert "data.datasets[0] (&#x27;main&#x27;)" in page and "data.datasets[1] (&#x27;flips&#x27;)" in page
    assert html_escaped(BOLD) in page and BOLD not in page
    assert page.count("data:image/png;base64,") == 4 + 2 + 1  # the tiles: 64x64 4, 96x32 2, 32x96 1
    # flips' tiles carry its captions as trained: a variant, or dropped
    flips = re.findall(r"<span class='meta'>flips[^<]*</span><br>([^<]*)</figcaption>", page)
    allowed = {p.read_text().strip() for p in previewed["flips"].glob("*.txt")} | {"dog, sks",
                                                                                     "(caption dropped)"}
    assert flips and set(flips) <= allowed


def html_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_a_flipped_masked_tile_is_mirrored_and_dimmed_where_masked():
    image = Image.new("RGB", (20, 10), (200, 0, 0))
    image.paste((0, 0, 200), (10, 0, 20, 10))  # left red, right blue
    mask = Image.new("L", (20, 10), 255)
    mask.paste(0, (0, 0, 10, 10))  # the red half is masked out
    picture = Tile(image, "d", "c", flipped=True, mask=mask).picture()
    assert picture.getpixel((2, 5)) == (0, 0, 200)  # blue now on the left, as trained
    red = picture.getpixel((17, 5))
    assert red[1:] == (0, 0) and 40 < red[0] < 100  # red on the right, dimmed


def test_missing_tokenizers_are_one_line_and_the_rest_goes_on(previewed, tmp_path):
    single = next((previewed["cache"] / "tiny").glob("tiny-ssd1b*/*.safetensors"))
    alone = tmp_path / "alone" / "model.safetensors"
    alone.parent.mkdir()
    shutil.copy(single, alone)
    code, out, err = _run(["data", str(previewed["config"]), "--no-progress", "--per-bucket", "0",
                           *_sets(tmp_path, previewed["cache"], f"model.path={alone}")])
    assert code == 0, err
    notes = [line for line in out.splitlines() if "caption tokens not counted" in line]
    assert len(notes) == 1 and "has no tokenizers" in notes[0] and "model.tokenizers" in notes[0]
    assert "(CLIP)" not in out and "train.steps = 20" in out
    assert not (tmp_path / "out" / "data-preview.png").exists()  # --per-bucket 0: no contact sheet


def test_an_empty_dataset_is_one_line_and_exit_code_2(previewed, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    config = tmp_path / "bad.toml"
    config.write_text(CONFIG.format(main=previewed["flips"], flips=empty))  # no file to skip: no warning
    code, out, err = _run(["data", str(config), "--no-progress", *_sets(tmp_path, previewed["cache"])])
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: data.datasets[1] ('flips'): no images found in {empty} ")


def test_an_unwritable_sheet_is_named_after_the_report(previewed, tmp_path, read_only_folder):
    target = read_only_folder / "sheet.png"
    code, out, err = _run(["data", str(previewed["config"]), "--no-progress", "--out", str(target),
                           *_sets(tmp_path, previewed["cache"])])
    assert code == 2
    assert "the first epoch: 19 images in 10 micro-batches" in out  # the report came first, whole
    assert err.strip().splitlines()[-1] == f"error: --out: cannot write {target} (Read-only file system)"
    assert list(read_only_folder.iterdir()) == []
