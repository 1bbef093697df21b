"""Read a training dataset, validate every image and caption, and report what is wrong.

Three layouts are understood:

* ``captions``: a folder (searched recursively) of images with same-name caption files;
* ``kohya-json``: a kohya-style metadata JSON ``{"<image key>": {"caption": ..., "tags": ...}}``;
* ``jsonl``: a Hugging Face imagefolder ``metadata.jsonl`` with ``file_name`` and ``text``/``caption``.

A bad item (corrupt, truncated or tiny image, missing or empty caption, path escaping the
root, ...) never aborts the scan: it becomes a :class:`Problem` and the item is skipped, so a
user sees every issue of a large dataset in one pass instead of one crash at a time.
Only problems with the dataset as a whole (missing root, unreadable metadata) raise.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vramfit.data.fingerprint import file_digest

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
_ORIENTATION_TAG = 0x0112  # EXIF "Orientation"
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # the ones that rotate by 90 or 270 degrees


@dataclass(frozen=True)
class Item:
    """One usable training example. ``width``/``height`` are after EXIF orientation."""

    path: Path
    key: str
    caption: str
    width: int
    height: int
    sha256: str = ""  # of the file's bytes: the cache key and duplicate detection use it


@dataclass(frozen=True)
class Problem:
    """Why one dataset entry was skipped; ``path`` is relative to the root when possible."""

    path: str
    reason: str


@dataclass
class ScanResult:
    items: list[Item] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    source: str = "captions"


class _Rejected(Exception):
    """Internal: carries the human-readable reason an entry is unusable."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Candidate(NamedTuple):
    """An image found by a source, with either its caption or why the caption is unusable."""

    path: Path
    caption: str | None
    caption_problem: str | None


# --------------------------------------------------------------------------- entry point


def scan_dataset(
    root: Path,
    *,
    metadata: Path | None = None,
    caption_extension: str = ".txt",
    min_size: int = 256,
    max_pixels: int = 178_956_970,
    instance_prompt: str | None = None,
) -> ScanResult:
    """Scan ``root`` and return the usable items plus a problem for every unusable one.

    ``metadata`` ending in ``.json`` selects the kohya layout, ``.jsonl`` the imagefolder one;
    without it ``root/metadata.jsonl`` is used when present, else caption files.
    """
    root = Path(os.path.abspath(root))
    if not root.exists():
        raise FileNotFoundError(f"dataset folder {root} does not exist")
    if not root.is_dir():
        raise ValueError(f"dataset root {root} is not a folder")

    if metadata is None and instance_prompt is None and (root / "metadata.jsonl").is_file():
        metadata = root / "metadata.jsonl"
    problems: list[Problem] = []
    if metadata is None:
        source = "captions"
        candidates = _from_caption_files(root, caption_extension, instance_prompt)
    else:
        metadata = _locate_metadata(Path(metadata), root)
        suffix = metadata.suffix.lower()
        if suffix == ".json":
            source = "kohya-json"
            candidates = _from_kohya_json(root, metadata, problems)
        elif suffix == ".jsonl":
            source = "jsonl"
            candidates = _from_jsonl(root, metadata, problems)
        else:
            raise ValueError(
                f"metadata file {metadata} must end in .json (kohya) or .jsonl (imagefolder)"
            )

    items: list[Item] = []
    seen: dict[tuple[str, str], str] = {}
    real_root = root.resolve()
    with _pil_limits(max_pixels):
        for cand in candidates:
            key = cand.path.relative_to(root).as_posix()
            ok = True
            try:
                _check_inside(cand.path, real_root)
                width, height = _check_image(cand.path, min_size, max_pixels)
            except _Rejected as rej:
                problems.append(Problem(key, rej.reason))
                ok = False
            # Report a bad caption even when the image is bad too, so one pass shows everything.
            if cand.caption_problem is not None:
                problems.append(Problem(key, cand.caption_problem))
                ok = False
            if not ok:
                continue
            digest = file_digest(cand.path)
            first = seen.setdefault((digest, cand.caption), key)
            if first != key:
                # Same bytes and same caption: training on both would silently double its weight.
                problems.append(Problem(key, f"duplicate of {first} (same image and caption)"))
                continue
            items.append(Item(cand.path, key, cand.caption, width, height, digest))
    return ScanResult(items=items, problems=problems, source=source)


def _check_inside(path: Path, real_root: Path) -> None:
    """Reject files that are, or sit behind, symlinks leading out of the dataset folder."""
    target = path.resolve()
    if not target.is_relative_to(real_root):
        raise _Rejected(f"symlink leads outside the dataset folder (to {target})")


def _locate_metadata(metadata: Path, root: Path) -> Path:
    if metadata.is_file():
        return Path(os.path.abspath(metadata))
    # A bare relative name usually means "inside the dataset folder".
    if not metadata.is_absolute() and (root / metadata).is_file():
        return root / metadata
    raise FileNotFoundError(f"metadata file {metadata} does not exist")


# --------------------------------------------------------------------------- sources


def _from_caption_files(root: Path, caption_extension: str,
                        instance_prompt: str | None = None) -> list[_Candidate]:
    if not caption_extension.startswith("."):
        caption_extension = "." + caption_extension
    images = [
        p
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_EXTENSIONS
        and p.is_file()
        # Hidden folders (.git, .cache, ...) are tool state, not training data.
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    images.sort(key=lambda p: p.relative_to(root).as_posix())
    out = []
    for image in images:
        if instance_prompt is not None:  # DreamBooth: one prompt for every image, no caption files
            out.append(_Candidate(image, _clean_caption(instance_prompt), None))
            continue
        caption_path = image.with_suffix(caption_extension)
        try:
            caption = _read_caption_file(caption_path)
            out.append(_Candidate(image, caption, None))
        except _Rejected as rej:
            out.append(_Candidate(image, None, rej.reason))
    return out


def _read_caption_file(path: Path) -> str:
    if not path.is_file():
        raise _Rejected(f"missing caption file {path.name}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _Rejected(f"cannot read caption file {path.name} ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8-sig")  # editors on Windows like to prepend a BOM
    except UnicodeDecodeError as exc:
        raise _Rejected("caption is not UTF-8") from exc
    return _clean_caption(text)


def _clean_caption(text: str) -> str:
    # Multi-line caption files are joined; a caption is a single prompt for the text encoders.
    caption = " ".join(line.strip() for line in text.splitlines() if line.strip())
    if not caption:
        raise _Rejected("empty caption")
    return caption


def _from_kohya_json(root: Path, metadata: Path, problems: list[Problem]) -> list[_Candidate]:
    try:
        data = json.loads(metadata.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"metadata file {metadata} is not UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"metadata file {metadata} is not valid JSON: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno})"
        ) from exc
    if not isinstance(data, dict):
        raise ValueError(
            f"metadata file {metadata} must hold a JSON object mapping image keys to entries"
        )
    out: list[_Candidate] = []
    seen: set[Path] = set()
    for name, entry in data.items():
        _add_entry(root, name, lambda e=entry: _kohya_caption(e), True, seen, problems, out)
    return out


def _add_entry(root: Path, name: str, caption_of, allow_missing_extension: bool, seen: set[Path],
               problems: list[Problem], out: list[_Candidate]) -> None:
    """Resolve one metadata entry's image (once per image) and its caption into `out`."""
    try:
        image = _resolve_image(root, name, allow_missing_extension=allow_missing_extension)
        if image in seen:
            raise _Rejected("duplicate metadata entry for the same image")
        seen.add(image)
    except _Rejected as rej:
        problems.append(Problem(_display_name(root, name), rej.reason))
        return
    try:
        out.append(_Candidate(image, caption_of(), None))
    except _Rejected as rej:
        out.append(_Candidate(image, None, rej.reason))


def _kohya_caption(entry: object) -> str:
    if not isinstance(entry, dict):
        raise _Rejected("metadata entry is not a JSON object")
    parts = []
    for column in ("caption", "tags"):
        value = entry.get(column)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _Rejected(f"metadata '{column}' is not a string")
        if value.strip():
            parts.append(value.strip())
    return _clean_caption(", ".join(parts))


def _from_jsonl(root: Path, metadata: Path, problems: list[Problem]) -> list[_Candidate]:
    out: list[_Candidate] = []
    seen: set[Path] = set()
    for lineno, record in _read_jsonl(metadata):
        label = f"{metadata.name} line {lineno}"
        if not isinstance(record, dict):
            problems.append(Problem(label, "metadata line is not a JSON object"))
            continue
        name = record.get("file_name")
        if not isinstance(name, str) or not name:
            problems.append(Problem(label, "metadata line has no 'file_name'"))
            continue
        _add_entry(root, name, lambda r=record: _jsonl_caption(r), False, seen, problems, out)
    return out


def _read_jsonl(metadata: Path) -> Iterator[tuple[int, object]]:
    try:
        text = metadata.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"metadata file {metadata} is not UTF-8") from exc
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"metadata file {metadata} line {lineno} is not valid JSON: {exc.msg}"
            ) from exc


def _jsonl_caption(record: dict) -> str:
    # "text" is what the diffusers training scripts default to; "caption" is the other common name.
    for column in ("text", "caption"):
        if column in record:
            value = record[column]
            if not isinstance(value, str):
                raise _Rejected(f"metadata '{column}' is not a string")
            return _clean_caption(value)
    raise _Rejected("metadata line has no caption column ('text' or 'caption')")


def _resolve_image(root: Path, name: str, *, allow_missing_extension: bool) -> Path:
    """Map a metadata key to an image file inside ``root`` or reject it."""
    # normpath is lexical, so "a/../../x" is caught even when the target does not exist and a
    # symlinked folder inside the dataset is still accepted.
    path = Path(os.path.normpath(root / name))
    if path == root:
        raise _Rejected("metadata key does not name a file")
    if not path.is_relative_to(root):
        raise _Rejected("path is outside the dataset folder")
    if path.is_file():
        return path
    if allow_missing_extension:
        # kohya keys are often the image path without its extension.
        for ext in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS):
            candidate = Path(str(path) + ext)
            if candidate.is_file():
                return candidate
    raise _Rejected("image file not found")


def _display_name(root: Path, name: str) -> str:
    path = Path(os.path.normpath(root / name))
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else name


# --------------------------------------------------------------------------- image checks


@contextlib.contextmanager
def _pil_limits(max_pixels: int) -> Iterator[None]:
    """Temporarily apply our pixel limit and strict truncation handling to PIL.

    PIL's limits are module globals; they are restored on exit so callers and other
    libraries keep whatever they had configured.
    """
    old_max, old_truncated = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
    # PIL raises above twice MAX_IMAGE_PIXELS and only warns above it; our own explicit check
    # rejects anything over max_pixels, PIL's error is the backstop.
    Image.MAX_IMAGE_PIXELS = max_pixels
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # a half-written file must fail, not be padded grey
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = old_max, old_truncated


def _check_image(path: Path, min_size: int, max_pixels: int) -> tuple[int, int]:
    """Fully decode ``path``; return its (width, height) after EXIF orientation or reject it."""
    try:
        if path.stat().st_size == 0:
            raise _Rejected("empty file (0 bytes)")
        with Image.open(path) as im:
            width, height = im.size
            # Header-only so far: refuse huge images before any pixel is decoded.
            if width * height > max_pixels:
                raise _Rejected(
                    f"image has {width * height:,} pixels, over the limit of {max_pixels:,}"
                )
            im.verify()
        # verify() leaves the image unusable, and does not decode pixel data; load() does,
        # which is what catches truncated files.
        with Image.open(path) as im:
            im.load()
            orientation = _exif_orientation(im)
    except _Rejected:
        raise
    except Image.DecompressionBombError as exc:
        # PIL's backstop (it fires at twice its limit), reached only for enormous headers.
        raise _Rejected(
            f"image is over the limit of {max_pixels:,} pixels (possible decompression bomb)"
        ) from exc
    except Exception as exc:  # PIL raises many types on malformed input; none may stop a scan
        raise _Rejected(_describe_decode_error(exc)) from exc
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    if min(width, height) < min_size:
        raise _Rejected(f"image too small: {width}x{height} px, minimum side is {min_size}")
    return width, height


def _describe_decode_error(exc: Exception) -> str:
    if isinstance(exc, UnidentifiedImageError):
        return "not an image (cannot identify image file)"
    message = str(exc)
    if isinstance(exc, OSError) and "truncated" in message.lower():
        return "truncated image file"
    if isinstance(exc, OSError) and exc.strerror:
        return f"cannot read file ({exc.strerror})"
    return f"corrupt image file ({type(exc).__name__}: {message[:200]})"


def _exif_orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
        return int(value)
    except Exception:  # malformed EXIF is common in the wild and must not reject the image
        return 1


# --------------------------------------------------------------------------- loading


def load_image(path: Path) -> Image.Image:
    """Open ``path`` as an upright 8-bit RGB image; transparency is composited on white."""
    with Image.open(path) as im:
        im.load()
        if _exif_orientation(im) != 1:
            try:
                im = ImageOps.exif_transpose(im)
            except Exception:  # broken EXIF: keep the pixels as stored rather than fail
                pass
        return _to_rgb(im)


def _to_rgb(im: Image.Image) -> Image.Image:
    mode = im.mode
    if mode == "RGB":
        return im.copy()
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        mode == "P" and "transparency" in im.info
    )
    if has_alpha:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode.startswith("I") or mode == "F":
        # PIL's own conversion clips high-bit-depth values at 255, turning most of a 16-bit
        # image white; rescale to 8 bits instead.
        return Image.fromarray(_high_depth_to_uint8(np.asarray(im))).convert("RGB")
    return im.convert("RGB")


def _high_depth_to_uint8(arr: np.ndarray) -> np.ndarray:
    is_float = np.issubdtype(arr.dtype, np.floating)
    arr = arr.astype(np.float64)
    if arr.ndim == 3:  # e.g. I;16 variants that numpy exposes with a trailing channel axis
        arr = arr[..., 0]
    peak = float(arr.max()) if arr.size else 0.0
    if is_float and peak <= 1.0:
        scale = 255.0  # float images in [0, 1]
    elif peak <= 255:
        scale = 1.0  # already 8-bit values stored in a wider type
    else:
        scale = 255.0 / 65535.0  # 16-bit range, the common case for I;16 and I
    return np.clip(np.rint(arr * scale), 0, 255).astype(np.uint8)
