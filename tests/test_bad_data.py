"""Bad or odd dataset entries: each trains or is named (skipped or ignored), and the run goes on."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.config.schema import RunConfig
from vramfit.data.scan import IMAGE_EXTENSIONS, load_image, printable, scan_dataset
from vramfit.data.synth import make_synthetic_dataset
from vramfit.data.datasets import scan_datasets as scan


def _image(path: Path, caption: "str | bytes | None" = "a picture", image: "Image.Image | None" = None,
           colour=(10, 120, 200)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (image or Image.new("RGB", (64, 64), colour)).save(path)
    if caption is not None:
        cap = path.with_suffix(".txt")
        cap.write_bytes(caption) if isinstance(caption, bytes) else cap.write_text(caption, encoding="utf-8")
    return path


def _by_path(problems) -> dict[str, str]:
    return {p.path: p.reason for p in problems}


def _bytes_name(folder: Path, name: bytes, data: bytes) -> None:
    """Write a file whose name is not UTF-8; skip the test where the file system refuses such names."""
    try:
        fd = os.open(os.path.join(os.fsencode(folder), name), os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        pytest.skip(f"this file system refuses non-UTF-8 names ({exc.strerror})")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


# --------------------------------------------------------------------------- symlinks out of the dataset


def test_caption_and_metadata_symlinks_out_of_the_dataset_are_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("the secret words")
    root = tmp_path / "ds"
    _image(root / "leak.png", caption=None)
    (root / "leak.txt").symlink_to(secret)
    _image(root / "inside.png", caption=None, colour=(1, 2, 3))
    (root / "real.txt").write_text("a caption kept elsewhere in the folder")
    (root / "inside.txt").symlink_to(root / "real.txt")  # a link that stays inside is fine
    result = scan_dataset(root, min_size=32)
    assert [(i.key, i.caption) for i in result.items] == [
        ("inside.png", "a caption kept elsewhere in the folder")]
    reasons = _by_path(result.problems)
    assert reasons["leak.png"] == (f"caption file leak.txt: symlink leads outside the dataset folder "
                                   f"(to {secret.resolve()})")
    assert all("secret" not in i.caption for i in result.items)

    # Metadata found in the folder, or given as a path inside it, may not lead out of it either.
    (outside / "metadata.jsonl").write_text(json.dumps({"file_name": "inside.png", "text": "secret"}) + "\n")
    (root / "metadata.jsonl").symlink_to(outside / "metadata.jsonl")
    with pytest.raises(ValueError, match=r"metadata\.jsonl: symlink leads outside the dataset folder"):
        scan_dataset(root, min_size=32)
    (outside / "meta.json").write_text(json.dumps({"inside.png": {"caption": "secret"}}))
    (root / "meta.json").symlink_to(outside / "meta.json")
    with pytest.raises(ValueError, match=r"meta\.json: symlink leads outside the dataset folder"):
        scan_dataset(root, metadata=Path("meta.json"), min_size=32)
    # The user's own metadata file kept outside the folder, named by its path, is read as before.
    assert scan_dataset(root, metadata=outside / "meta.json", min_size=32).items[0].caption == "secret"
    # A FIFO in place of metadata.jsonl is named, not opened (which would wait forever).
    (root / "metadata.jsonl").unlink()
    os.mkfifo(root / "metadata.jsonl")
    with pytest.raises(ValueError, match=r"metadata\.jsonl is not a regular file \(a FIFO\)"):
        scan_dataset(root, min_size=32)


# --------------------------------------------------------------------------- names that are not UTF-8


def test_file_name_that_is_not_utf8_is_named_and_skipped(tmp_path):
    root = tmp_path / "ds"
    _image(root / "good.png")
    png = (root / "good.png").read_bytes()
    _bytes_name(root, b"caf\xe9.png", png[:-1] + b"\x01")  # other bytes: not a duplicate
    _bytes_name(root, b"caf\xe9.txt", b"a cafe")
    _bytes_name(root, b"note\xff.txt", b"a caption without an image")
    os.mkdir(os.path.join(os.fsencode(root), b"d\xe9j\xe0"))
    _bytes_name(root, b"d\xe9j\xe0/vu.png", png[:-1] + b"\x03")
    result = scan_dataset(root, min_size=32)
    assert [i.key for i in result.items] == ["good.png"]
    assert _by_path(result.problems) == {"caf\\xe9.png": "file name is not valid UTF-8; rename it",
                                         "d\\xe9j\\xe0/vu.png": "folder name is not valid UTF-8; rename it"}
    assert [p.path for p in result.ignored] == ["note\\xff.txt"]
    for p in result.problems + result.ignored:  # printable: a log line, run.json and a terminal take them
        p.path.encode("utf-8")
        json.dumps(p.path, ensure_ascii=False).encode("utf-8")
    assert printable("a\nb\udcff") == "a\\x0ab\\xff"


# --------------------------------------------------------------------------- metadata nested too deeply


def test_deeply_nested_metadata_is_a_clear_error(tmp_path):
    _image(tmp_path / "a.png")
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text(json.dumps({"file_name": "a.png", "text": "fine"}) + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep\.jsonl line 2 nests arrays or objects too deeply"):
        scan_dataset(tmp_path, metadata=jsonl, min_size=32)
    kohya = tmp_path / "deep.json"
    kohya.write_text('{"a.png": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"deep\.json nests arrays or objects too deeply"):
        scan_dataset(tmp_path, metadata=kohya, min_size=32)


# --------------------------------------------------------------------------- caption encodings


def test_utf16_and_nul_captions_are_decoded_or_refused(tmp_path):
    nul = "caption holds NUL bytes (UTF-16 without a byte-order mark?); save it as UTF-8"
    _image(tmp_path / "u16.png", "a red fox".encode("utf-16-le"), colour=(1, 0, 0))  # no BOM
    _image(tmp_path / "u16be.png", "a red fox".encode("utf-16-be"), colour=(2, 0, 0))
    _image(tmp_path / "nul.png", b"a red\x00 fox", colour=(3, 0, 0))
    _image(tmp_path / "bom16.png", "a grey w\u00f6lf".encode("utf-16"), colour=(4, 0, 0))  # with a BOM
    _image(tmp_path / "bom32.png", "a grey bear".encode("utf-32"), colour=(5, 0, 0))
    _image(tmp_path / "odd16.png", "a cat".encode("utf-16") + b"\x00", colour=(6, 0, 0))  # odd length
    _image(tmp_path / "utf8.png", "caf\u00e9 au lait", colour=(7, 0, 0))
    result = scan_dataset(tmp_path, min_size=32)
    assert [(i.key, i.caption) for i in result.items] == [
        ("bom16.png", "a grey w\u00f6lf"), ("bom32.png", "a grey bear"), ("utf8.png", "caf\u00e9 au lait")]
    assert _by_path(result.problems) == {
        "u16.png": nul, "u16be.png": nul, "nul.png": nul,
        "odd16.png": "caption is not valid UTF-16 (it starts with a UTF-16 byte-order mark); "
                     "save it as UTF-8",
    }

    # Captions from metadata: a JSON escape can hold a NUL or half a surrogate pair.
    meta = tmp_path / "meta.jsonl"
    meta.write_text('{"file_name": "u16.png", "text": "a\\u0000b"}\n'
                    '{"file_name": "nul.png", "text": "a\\ud800"}\n'
                    '{"file_name": "utf8.png", "text": "fine"}\n')
    result = scan_dataset(tmp_path, metadata=meta, min_size=32)
    assert [i.key for i in result.items] == ["utf8.png"]
    assert _by_path(result.problems) == {
        "u16.png": "caption holds NUL characters",
        "nul.png": "caption holds an invalid character (a lone UTF-16 surrogate)"}


# --------------------------------------------------------------------------- float and 32-bit pixels


def test_float_and_32bit_images_scale_by_their_values_and_nan_is_refused(tmp_path):
    ramp = np.tile(np.linspace(0, 200_000, 64), (64, 1)).astype(np.int32)
    _image(tmp_path / "i32.tif", image=Image.fromarray(ramp))
    unit = np.full((64, 64), 0.25, np.float32)
    _image(tmp_path / "unit.tif", image=Image.fromarray(unit))
    signed = np.tile(np.linspace(-1000, 1000, 64), (64, 1)).astype(np.int32)
    _image(tmp_path / "signed.tif", image=Image.fromarray(signed))
    for name, bad in (("nan.tif", np.nan), ("inf.tif", np.inf)):
        pixels = unit.copy()
        pixels[5, 5:8] = bad
        _image(tmp_path / name, image=Image.fromarray(pixels))
    assert Image.open(tmp_path / "i32.tif").mode == "I" and Image.open(tmp_path / "nan.tif").mode == "F"

    result = scan_dataset(tmp_path, min_size=32)
    assert sorted(i.key for i in result.items) == ["i32.tif", "signed.tif", "unit.tif"]
    assert _by_path(result.problems) == {  # named at scan time, before anything is cached
        "nan.tif": "image holds NaN or infinite pixel values (3 of 4,096 pixels)",
        "inf.tif": "image holds NaN or infinite pixel values (3 of 4,096 pixels)",
    }
    row = [load_image(tmp_path / "i32.tif").getpixel((x, 0))[0] for x in range(64)]
    assert row[0] == 0 and row[-1] == 255 and row == sorted(row)  # the whole range, not saturated
    assert abs(row[32] - 130) <= 2 and len(set(row)) > 60
    assert load_image(tmp_path / "unit.tif").getpixel((3, 3)) == (64, 64, 64)
    row = [load_image(tmp_path / "signed.tif").getpixel((x, 0))[0] for x in range(64)]
    assert row[0] == 0 and row[-1] == 255 and row == sorted(row)  # negatives are not clipped to black
    with pytest.raises(ValueError, match="nan.tif: image holds NaN"):
        load_image(tmp_path / "nan.tif")


# --------------------------------------------------------------------------- formats and odd entries


def test_other_formats_and_odd_entries_train_or_are_named(tmp_path):
    root = tmp_path / "ds"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _image(root / "a.png", colour=(1, 1, 1))
    _image(root / "b.tif", colour=(2, 2, 2))
    _image(root / "c.gif", colour=(3, 3, 3))
    _image(root / "d.jfif", image=Image.new("RGB", (64, 64), (4, 4, 4)).copy(), caption="jpeg")
    expected = ["a.png", "b.tif", "c.gif", "d.jfif"]
    if ".avif" in IMAGE_EXTENSIONS:
        _image(root / "e.avif", colour=(5, 5, 5))
        expected.append("e.avif")
    frames = [Image.new("RGB", (64, 64), (60 * i, 0, 0)) for i in range(3)]
    frames[0].save(root / "anim.gif", save_all=True, append_images=frames[1:])
    (root / "anim.txt").write_text("moving")
    _image(root / "pic.tga")
    (root / "orphan.txt").write_text("a caption without its image")
    (root / "dangling.png").symlink_to(root / "nowhere.png")
    (root / "loop.png").symlink_to(root / "loop.png")
    os.mkfifo(root / "fifo.png")
    _image(root / "nested.png" / "inner.png", colour=(6, 6, 6))
    expected.append("nested.png/inner.png")
    _image(root / ".hidden.png", colour=(7, 7, 7))
    _image(root / ".git" / "x.png", colour=(8, 8, 8))  # hidden folders: tool state, not data
    (root / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (root / "._a.png").write_bytes(b"\x00\x05\x16\x07")  # a macOS resource fork
    (root / "linked").symlink_to(outside, target_is_directory=True)
    (root / "notes.md").write_text("not data and not like data: passed over")
    _image(root / "piped.png", None, colour=(9, 9, 9))
    os.mkfifo(root / "piped.txt")  # a caption that is a FIFO is named, not read (which would block)

    result = scan_dataset(root, min_size=32)
    assert [i.key for i in result.items] == sorted(expected)
    assert _by_path(result.problems) == {
        "anim.gif": "animated image (3 frames); save the frame to train on as a still image",
        "piped.png": "caption file piped.txt is not a regular file (a FIFO)"}
    assert _by_path(result.ignored) == {
        ".hidden.png": "hidden file (its name starts with '.')",
        "dangling.png": f"a broken symlink (to {root / 'nowhere.png'})",
        "fifo.png": "not a regular file (a FIFO)",
        "linked": "symlink to a folder (folders behind symlinks are not searched)",
        "loop.png": "a symlink loop",
        "nested.png": "a folder named like an image file (its contents are searched)",
        "orphan.txt": "caption file without an image (no orphan.png, .jpg, ... beside it)",
        "pic.tga": ".tga is not an image format used for training; convert it to .png or .jpg",
        "pic.txt": "caption file of an ignored entry (pic.tga)",
    }
    # Entries named in a metadata file get the same precise reasons.
    meta = root / "metadata.jsonl"
    meta.write_text("".join(json.dumps({"file_name": n, "text": "x"}) + "\n"
                            for n in ("fifo.png", "loop.png", "dangling.png", "nested.png", "c.gif")))
    result = scan_dataset(root, min_size=32)
    assert [i.key for i in result.items] == ["c.gif"]
    assert _by_path(result.problems) == {
        "fifo.png": "image file is not a regular file (a FIFO)",
        "loop.png": "image file is a symlink loop",
        "dangling.png": f"image file is a broken symlink (to {root / 'nowhere.png'})",
        "nested.png": "image file is a folder",
    }


# --------------------------------------------------------------------------- nothing to train on


@pytest.mark.parametrize("case", ["empty", "all_skipped", "ignored_only", "metadata_lists_none"])
def test_nothing_usable_says_what_was_found(tmp_path, case):
    root = tmp_path / "ds"
    root.mkdir()
    if case == "all_skipped":
        (root / "a.png").write_bytes(b"")
        (root / "a.txt").write_text("a")
    if case in ("all_skipped", "ignored_only"):
        (root / "b.psd").write_bytes(b"8BPS")
    if case == "metadata_lists_none":
        (root / "metadata.jsonl").write_text("\n")
    cfg = RunConfig.model_validate({"data": {"path": str(root), "min_size": 32}})
    with pytest.raises(ValueError) as err:
        scan(cfg)
    message = str(err.value)
    expected = {
        "empty": f"data.path: no images found in {root} (looked for .png, .jpg, .jpeg, ",
        "all_skipped": f"data.path: no usable images in {root}: 1 entry skipped, each named above; "
                       "1 other entry ignored, each named above",
        "ignored_only": f"data.path: no images found in {root} (looked for .png, .jpg, .jpeg, ",
        "metadata_lists_none": f"data.path: no images found in {root}: the metadata file "
                               f"{root / 'metadata.jsonl'} lists none",
    }[case]
    assert message.startswith(expected), message
    assert "warnings above" not in message
    if case in ("empty", "ignored_only"):
        assert ".tif" in message and "each beside a same-name .txt caption file" in message
    assert message.endswith("; 1 entry ignored, each named above") == (case == "ignored_only")


# --------------------------------------------------------------------------- one run through the CLI


def test_run_trains_on_the_rest_and_names_every_bad_entry(tmp_path, cache_root, caplog):
    root = tmp_path / "data"
    make_synthetic_dataset(root, n=3, size=SIZE, seed=5)
    secret = tmp_path / "secret.txt"
    secret.write_text("private words")
    good = (root / "0000.png").read_bytes()
    _bytes_name(root, b"caf\xe9.png", good[:-1] + b"\x02")
    _bytes_name(root, b"caf\xe9.txt", b"a cafe")
    _image(root / "leak.png", None, image=Image.new("RGB", (SIZE, SIZE), (9, 9, 9)))
    (root / "leak.txt").symlink_to(secret)
    _image(root / "utf16.png", "a dog".encode("utf-16-le"), image=Image.new("RGB", (SIZE, SIZE), (9, 9, 19)))
    nan = np.full((SIZE, SIZE), 0.5, np.float32)
    nan[0, 0] = np.nan
    _image(root / "nan.tif", image=Image.fromarray(nan))
    wide = np.tile(np.linspace(0, 300_000, SIZE), (SIZE, 1)).astype(np.int32)
    _image(root / "deep.tif", "a 32-bit ramp", image=Image.fromarray(wide))
    _image(root / "pic.tga", None)
    (root / "orphan.txt").write_text("no image")
    os.mkfifo(root / "pipe.png")
    (root / "gone.png").symlink_to(root / "missing.png")

    out = tmp_path / "run"
    with caplog.at_level("WARNING"):
        code = main(train_args(root, out, cache_root / "bad-data"))
    assert code == 0
    run = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert run["items"] == 4 and run["end_step"] == 2  # the three good ones and the 32-bit TIFF
    skipped = {s["path"]: s["reason"] for s in run["skipped"]}
    ignored = {s["path"]: s["reason"] for s in run["ignored"]}
    assert set(skipped) == {"caf\\xe9.png", "leak.png", "utf16.png", "nan.tif"}
    assert set(ignored) == {"pic.tga", "orphan.txt", "pipe.png", "gone.png"}
    assert "symlink leads outside" in skipped["leak.png"] and "NUL bytes" in skipped["utf16.png"]
    for name in (*skipped, *ignored):
        assert name in caplog.text
    assert "private words" not in caplog.text
