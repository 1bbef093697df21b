"""Read a training dataset, validate every image and caption, and report what is wrong.

Three layouts are understood:

* ``captions``: a folder (searched recursively) of images with same-name caption files;
* ``kohya-json``: a kohya-style metadata JSON ``{"<image key>": {"caption": ..., "tags": ...}}``;
* ``jsonl``: a Hugging Face imagefolder ``metadata.jsonl`` with ``file_name`` and ``text``/``caption``.

A bad item (corrupt, truncated or tiny image, missing or empty caption, path escaping the
root, ...) never aborts the scan: it becomes a :class:`Problem` and the item is skipped, so a
user sees every issue of a large dataset in one pass instead of one crash at a time. Entries of a
caption folder that are not training data but look as if they were meant to be (images in other
formats, captions without an image, broken links, FIFOs, ...) are named in ``ignored``.
Only problems with the dataset as a whole (missing root, unreadable metadata) raise.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError, features

from vramfit.data.fingerprint import file_digest


def _trained_extensions() -> tuple[str, ...]:
    """Still-image formats trained from a caption folder; AVIF where the installed PIL reads it."""
    exts = (".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".bmp", ".tif", ".tiff", ".gif")
    try:
        if features.check_module("avif"):
            exts += (".avif",)
    except ValueError:  # a PIL without an AVIF plugin at all
        pass
    return exts


IMAGE_EXTENSIONS = _trained_extensions()
# Animated images would train on one arbitrary frame; MPO (camera JPEGs) and multi-page TIFFs are
# stills with extra pictures and train on their first.
_ANIMATED_FORMATS = ("GIF", "PNG", "WEBP", "AVIF")
# Left alone without a word: operating-system litter, never training data.
_JUNK_NAMES = frozenset({".ds_store", "thumbs.db", "desktop.ini", "__macosx", ".localized"})
_ORIENTATION_TAG = 0x0112  # EXIF "Orientation"
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # the ones that rotate by 90 or 270 degrees


@dataclass(frozen=True)
class Item:
    """One usable training example. ``width``/``height`` are after EXIF orientation."""

    path: Path
    key: str
    caption: str  # its captions joined into one (a caption file's lines, a metadata list)
    width: int
    height: int
    sha256: str = ""  # of the file's bytes: the cache key and duplicate detection use it
    captions: tuple[str, ...] = ()  # each line of its caption file (or entry of a metadata list)

    @property
    def caption_lines(self) -> tuple[str, ...]:
        return self.captions or (self.caption,)


@dataclass(frozen=True)
class Problem:
    """Why one dataset entry was skipped or ignored; ``path`` is relative to the root when possible."""

    path: str
    reason: str

    def __post_init__(self) -> None:
        # File names need not be UTF-8 nor printable; logs, run.json and cache metadata need both.
        object.__setattr__(self, "path", printable(self.path))
        object.__setattr__(self, "reason", printable(self.reason))


@dataclass
class ScanResult:
    items: list[Item] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)  # skipped: each was meant to train
    source: str = "captions"
    ignored: list[Problem] = field(default_factory=list)  # not training data, but looks meant to be
    metadata: Path | None = None  # the metadata file read (kohya-json and jsonl layouts)
    caption_extension: str | None = ".txt"  # None: one prompt for all (data.instance_prompt)

    def nothing_usable(self, folder: object) -> str:
        """Why there is nothing to train on in ``folder``, true to what the scan found."""
        if self.problems:
            why = f"no usable images in {folder}: {_count(self.problems, 'entry')} skipped, each named above"
        elif self.metadata is not None:
            why = f"no images found in {folder}: the metadata file {self.metadata} lists none"
        else:
            captions = (f", each beside a same-name {self.caption_extension} caption file"
                        if self.caption_extension else "")
            why = (f"no images found in {folder} (looked for {', '.join(IMAGE_EXTENSIONS)} files, "
                   f"in subfolders too{captions})")
        if self.ignored:
            other = "other entry" if self.problems else "entry"
            why += f"; {_count(self.ignored, other)} ignored, each named above"
        return why


def _count(things: list, noun: str) -> str:
    return f"{len(things)} {noun if len(things) == 1 else noun[:-1] + 'ies'}"


def printable(text: str) -> str:
    """``text`` with undecodable file-name bytes and control characters escaped (``caf\\xe9.png``)."""
    if _has_surrogates(text):
        try:  # names read from the file system carry undecodable bytes as surrogate escapes
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a lone surrogate from elsewhere (a JSON escape)
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        text = "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c for c in text)
    return text


def _has_surrogates(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


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
    default_caption: str | None = None,
    item_problem: Callable[[Path, Path, tuple[int, int]], str | None] | None = None,
) -> ScanResult:
    """Scan ``root`` and return the usable items plus a problem for every unusable one.

    ``metadata`` ending in ``.json`` selects the kohya layout, ``.jsonl`` the imagefolder one;
    without it ``root/metadata.jsonl`` is used when present, else caption files. ``default_caption``
    captions the images of a caption folder that have no caption file. ``item_problem(image, root,
    (width, height))`` may name a further reason to skip an image (a missing mask, say).
    """
    root = Path(os.path.abspath(root))
    if not root.exists():
        raise FileNotFoundError(f"dataset folder {root} does not exist")
    if not root.is_dir():
        raise ValueError(f"dataset root {root} is not a folder")
    real_root = Path(os.path.realpath(root))
    if not caption_extension.startswith("."):
        caption_extension = "." + caption_extension

    auto = root / "metadata.jsonl"
    if metadata is None and instance_prompt is None and os.path.lexists(auto):
        metadata = auto
    problems: list[Problem] = []
    ignored: list[Problem] = []
    if metadata is None:
        source = "captions"
        candidates = _from_caption_files(root, real_root, caption_extension, instance_prompt, ignored,
                                         default_caption)
    else:
        metadata = _locate_metadata(Path(metadata), root, real_root)
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
    with pil_limits(max_pixels):
        for cand in candidates:
            key = cand.path.relative_to(root).as_posix()
            if _has_surrogates(key):
                # Not UTF-8 on disk: every later step (cache metadata, run.json, logs) needs text.
                part = "file" if _has_surrogates(cand.path.name) else "folder"
                problems.append(Problem(key, f"{part} name is not valid UTF-8; rename it"))
                continue
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
            if ok and item_problem is not None:
                reason = item_problem(cand.path, root, (width, height))
                if reason:
                    problems.append(Problem(key, reason))
                    ok = False
            if not ok:
                continue
            digest = file_digest(cand.path)
            first = seen.setdefault((digest, cand.caption), key)
            if first != key:
                # Same bytes and same caption: training on both would silently double its weight.
                problems.append(Problem(key, f"duplicate of {first} (same image and caption)"))
                continue
            lines = tuple(cand.caption.split("\n"))
            items.append(Item(cand.path, key, " ".join(lines), width, height, digest,
                              lines if len(lines) > 1 else ()))
    return ScanResult(items=items, problems=problems, source=source, ignored=ignored,
                      metadata=metadata if source != "captions" else None,
                      caption_extension=caption_extension if instance_prompt is None else None)


def _check_inside(path: Path, real_root: Path, what: str = "") -> None:
    """Reject files that are, or sit behind, symlinks leading out of the dataset folder."""
    target = Path(os.path.realpath(path))  # realpath, unlike resolve(), does not raise on a loop
    if not target.is_relative_to(real_root):
        raise _Rejected(f"{what}symlink leads outside the dataset folder (to {target})")


def _locate_metadata(metadata: Path, root: Path, real_root: Path) -> Path:
    """The metadata file to read: given as is, or a bare relative name inside the dataset folder."""
    if not os.path.lexists(metadata):
        if metadata.is_absolute() or not os.path.lexists(root / metadata):
            raise FileNotFoundError(f"metadata file {metadata} does not exist")
        metadata = root / metadata
    metadata = Path(os.path.abspath(metadata))
    odd = not_a_file(metadata)
    if odd:
        raise ValueError(f"metadata file {metadata} is {odd}; it must be a JSON or JSON Lines file")
    # One inside the folder is part of the dataset, and like its images may not lead out of it
    # (a path given outside the folder is the user's own choice).
    if metadata.is_relative_to(root):
        try:
            _check_inside(metadata, real_root)
        except _Rejected as rej:
            raise ValueError(f"metadata file {metadata}: {rej.reason}; put the file itself there") from None
    return metadata


def not_a_file(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (after following links), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if os.path.islink(path):
            return f"a broken symlink (to {os.readlink(path)})"
        return "missing" if exc.errno == errno.ENOENT else f"unreadable ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "not a regular file (a FIFO)"
    if stat.S_ISSOCK(mode):
        return "not a regular file (a socket)"
    return "not a regular file (a device)"


# --------------------------------------------------------------------------- sources


def _from_caption_files(root: Path, real_root: Path, caption_extension: str, instance_prompt: str | None,
                        ignored: list[Problem], default_caption: str | None = None) -> list[_Candidate]:
    images, captions = _walk(root, caption_extension, ignored)
    out = []
    for image in images:
        if instance_prompt is not None:  # DreamBooth: one prompt for every image, no caption files
            try:
                out.append(_Candidate(image, _clean_caption(instance_prompt), None))
            except _Rejected as rej:
                out.append(_Candidate(image, None, rej.reason))
            continue
        caption_path = image.with_suffix(caption_extension)
        captions.pop(caption_path, None)
        if default_caption is not None and not os.path.lexists(caption_path):
            out.append(_Candidate(image, _clean_caption(default_caption), None))
            continue
        try:
            caption = _read_caption_file(caption_path, real_root)
            out.append(_Candidate(image, caption, None))
        except _Rejected as rej:
            out.append(_Candidate(image, None, rej.reason))
    if instance_prompt is None:
        # What is left has no image to train beside it; name the entry that stands in its place.
        stems = {os.path.splitext(p.path)[0]: p.path for p in ignored}
        for caption_path, odd in captions.items():
            key = _rel(caption_path, root)
            stem = key[:-len(caption_extension)]
            other = stems.get(printable(stem))
            reason = (f"caption file of an ignored entry ({other})" if other else
                      f"caption file without an image (no {Path(stem).name}.png, .jpg, ... beside it)")
            ignored.append(Problem(key, odd or reason))
    ignored.sort(key=lambda p: p.path)
    return out


def _walk(root: Path, caption_extension: str, ignored: list[Problem]) -> tuple[list[Path], dict[Path, str]]:
    """The images under ``root`` (sorted), and its caption files, each mapped to "" or to what is
    wrong with it. What looks like training data but is not goes to ``ignored``, with the reason.

    Hidden folders (.git, .cache, ...) are tool state and OS litter is no data: both are passed over
    silently. Symlinked folders are not followed.
    """
    known = {ext.lower() for ext in Image.registered_extensions()}  # what PIL could read
    images: list[Path] = []
    captions: dict[Path, str] = {}
    folders = [root]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                entries = sorted(entries, key=lambda e: e.name)
        except OSError as exc:
            ignored.append(Problem(_rel(folder, root), f"folder cannot be read ({exc.strerror}); "
                                   "its contents were not searched"))
            continue
        for entry in entries:
            name, path = entry.name, Path(entry.path)
            ext = os.path.splitext(name)[1].lower()
            if name.lower() in _JUNK_NAMES or name.startswith("._"):  # ._x: macOS resource forks
                continue
            hidden = name.startswith(".")
            try:
                is_link = entry.is_symlink()
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_link = is_dir = False
            if is_dir:
                if hidden:
                    continue
                if ext in known or ext in IMAGE_EXTENSIONS:
                    ignored.append(Problem(_rel(path, root), "a folder named like an image file "
                                           "(its contents are searched)"))
                folders.append(path)
                continue
            odd = not_a_file(path)
            if name.lower().endswith(caption_extension.lower()) and not hidden:
                captions[path] = f"caption file is {odd}" if odd else ""
                continue
            if odd == "a folder" and is_link:
                if not hidden:
                    ignored.append(Problem(_rel(path, root), "symlink to a folder (folders behind "
                                           "symlinks are not searched)"))
                continue
            if odd:
                if not hidden:
                    ignored.append(Problem(_rel(path, root), odd))
                continue
            if ext in IMAGE_EXTENSIONS:
                if hidden:
                    ignored.append(Problem(_rel(path, root), "hidden file (its name starts with '.')"))
                else:
                    images.append(path)
            elif ext in known and not hidden:
                ignored.append(Problem(_rel(path, root), f"{ext} is not an image format used for "
                                       "training; convert it to .png or .jpg"))
    images.sort(key=lambda p: _rel(p, root))
    return images, captions


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _read_caption_file(path: Path, real_root: Path) -> str:
    if not os.path.lexists(path):
        raise _Rejected(f"missing caption file {path.name}")
    odd = not_a_file(path)
    if odd:
        raise _Rejected(f"caption file {path.name} is {odd}")
    _check_inside(path, real_root, what=f"caption file {path.name}: ")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _Rejected(f"cannot read caption file {path.name} ({exc.strerror or exc})") from exc
    return _clean_caption(_decode_caption(raw))


_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
         (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def _decode_caption(raw: bytes) -> str:
    """UTF-8 (with or without a BOM), or UTF-16/32 when a byte-order mark says so."""
    for bom, codec in _BOMS:  # UTF-32 first: its little-endian mark starts like UTF-16's
        if raw.startswith(bom):
            try:
                return raw.decode(codec.lower())  # the codec reads the mark and drops it
            except UnicodeDecodeError as exc:
                raise _Rejected(f"caption is not valid {codec} (it starts with a {codec} "
                                "byte-order mark); save it as UTF-8") from exc
    if b"\x00" in raw:
        # Valid UTF-8 to a decoder, but every other byte of English text in UTF-16 is a NUL.
        raise _Rejected("caption holds NUL bytes (UTF-16 without a byte-order mark?); save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")  # editors on Windows like to prepend a BOM
    except UnicodeDecodeError as exc:
        raise _Rejected("caption is not UTF-8") from exc


def _clean_caption(text: str) -> str:
    if "\x00" in text:
        raise _Rejected("caption holds NUL characters")
    if _has_surrogates(text):  # half a pair, from a JSON escape: no tokenizer takes it
        raise _Rejected("caption holds an invalid character (a lone UTF-16 surrogate)")
    # A caption's lines, each stripped, held as one text: Item.caption joins them (one prompt for
    # the text encoders), Item.captions keeps them apart (data.caption_per_line)
    caption = "\n".join(line.strip() for line in text.splitlines() if line.strip())
    if not caption:
        raise _Rejected("empty caption")
    return caption


def _load_json(text: str, metadata: Path, where: str = ""):
    """json.loads that names the file (and line) of every way the text can fail to parse."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if where:
            raise ValueError(f"metadata file {metadata}{where} is not valid JSON: {exc.msg}") from exc
        raise ValueError(
            f"metadata file {metadata} is not valid JSON: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno})"
        ) from exc
    except RecursionError:
        # '[[[[...': the parser recurses once per level. No real metadata nests that deep.
        raise ValueError(f"metadata file {metadata}{where} nests arrays or objects too deeply to read; "
                         "it is not image metadata") from None


def _from_kohya_json(root: Path, metadata: Path, problems: list[Problem]) -> list[_Candidate]:
    try:
        data = _load_json(metadata.read_text(encoding="utf-8-sig"), metadata)
    except UnicodeDecodeError as exc:
        raise ValueError(f"metadata file {metadata} is not UTF-8") from exc
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
        yield lineno, _load_json(line, metadata, f" line {lineno}")


def _jsonl_caption(record: dict) -> str:
    # "text" is what the diffusers training scripts default to; "caption" is the other common name.
    for column in ("text", "caption"):
        if column in record:
            value = record[column]
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                return "\n".join(_clean_caption(v) for v in value)  # several captions of one image
            if not isinstance(value, str):
                raise _Rejected(f"metadata '{column}' is not a string or a list of strings")
            return _clean_caption(value)
    raise _Rejected("metadata line has no caption column ('text' or 'caption')")


def _resolve_image(root: Path, name: str, *, allow_missing_extension: bool) -> Path:
    """Map a metadata key to an image file inside ``root`` or reject it."""
    # normpath is lexical, so "a/../../x" is caught even when the target does not exist and a
    # symlinked folder inside the dataset is still accepted.
    if "\x00" in name:
        raise _Rejected("file name holds a NUL character")
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
    if os.path.lexists(path):  # there, but a FIFO, a folder, a broken or looping link
        raise _Rejected(f"image file is {not_a_file(path)}")
    raise _Rejected("image file not found")


def _display_name(root: Path, name: str) -> str:
    path = Path(os.path.normpath(root / name))
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else name


# --------------------------------------------------------------------------- image checks


@contextlib.contextmanager
def pil_limits(max_pixels: int) -> Iterator[None]:
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
            orientation = exif_orientation(im)
            _check_pixels(im)
    except _Rejected:
        raise
    except Image.DecompressionBombError as exc:
        # PIL's backstop (it fires at twice its limit), reached only for enormous headers.
        raise _Rejected(
            f"image is over the limit of {max_pixels:,} pixels (possible decompression bomb)"
        ) from exc
    except Exception as exc:  # PIL raises many types on malformed input; none may stop a scan
        raise _Rejected(describe_decode_error(exc)) from exc
    if orientation in SWAPPING_ORIENTATIONS:
        width, height = height, width
    if min(width, height) < min_size:
        raise _Rejected(f"image too small: {width}x{height} px, minimum side is {min_size}")
    return width, height


def _check_pixels(im: Image.Image) -> None:
    """Refuse what decodes but cannot train: animations, and float pixels that are NaN or inf."""
    if im.format in _ANIMATED_FORMATS and getattr(im, "is_animated", False):
        raise _Rejected(f"animated image ({im.n_frames} frames); save the frame to train on "
                        "as a still image")
    if im.mode == "F":  # 32-bit float (TIFF): NaN would turn black, inf would set the whole scale
        bad = _non_finite(np.asarray(im))
        if bad:
            raise _Rejected(f"image holds NaN or infinite pixel values ({bad:,} of "
                            f"{im.width * im.height:,} pixels)")


def _non_finite(arr: np.ndarray) -> int:
    return int(arr.size - np.count_nonzero(np.isfinite(arr))) if np.issubdtype(arr.dtype, np.floating) else 0


def describe_decode_error(exc: Exception) -> str:
    if isinstance(exc, UnidentifiedImageError):
        return "not an image (cannot identify image file)"
    message = str(exc)
    if isinstance(exc, OSError) and "truncated" in message.lower():
        return "truncated image file"
    if isinstance(exc, OSError) and exc.strerror:
        return f"cannot read file ({exc.strerror})"
    return f"corrupt image file ({type(exc).__name__}: {message[:200]})"


def exif_orientation(im: Image.Image) -> int:
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
        if exif_orientation(im) != 1:
            try:
                im = ImageOps.exif_transpose(im)
            except Exception:  # broken EXIF: keep the pixels as stored rather than fail
                pass
        try:
            return _to_rgb(im)
        except ValueError as exc:  # the file changed since the scan, which refuses such pixels
            raise ValueError(f"{path}: {exc}") from None


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
        return Image.fromarray(high_depth_to_uint8(np.asarray(im))).convert("RGB")
    return im.convert("RGB")


def high_depth_to_uint8(arr: np.ndarray) -> np.ndarray:
    """8-bit values of a wide single-channel image.

    Floats in [0, 1] and 16-bit integers are scaled by their type's range, so a dark picture stays
    dark; values beyond those ranges (negatives, 32-bit integers, HDR floats) by the actual range
    of the values, from 0 (or the minimum, when below 0) to the maximum, instead of saturating.
    """
    is_float = np.issubdtype(arr.dtype, np.floating)
    arr = arr.astype(np.float64)
    if arr.ndim == 3:  # e.g. I;16 variants that numpy exposes with a trailing channel axis
        arr = arr[..., 0]
    if _non_finite(arr):
        raise ValueError("image holds NaN or infinite pixel values")
    low = min(0.0, float(arr.min())) if arr.size else 0.0
    peak = float(arr.max()) if arr.size else 0.0
    if low == 0 and is_float and peak <= 1.0:
        arr = arr * 255.0  # float images in [0, 1]
    elif low == 0 and peak <= 255:
        pass  # already 8-bit values stored in a wider type
    elif low == 0 and not is_float and peak <= 65535:
        arr = arr * (255.0 / 65535.0)  # 16-bit range, the common case for I;16 and I
    else:
        arr = (arr - low) * (255.0 / (peak - low)) if peak > low else np.zeros_like(arr)
    return np.clip(np.rint(arr), 0, 255).astype(np.uint8)
