"""Import kohya sd-scripts datasets: a dataset config TOML, or a train_data_dir (and reg_data_dir).

kohya's dataset config nests [general] -> [[datasets]] -> [[datasets.subsets]], each level the
default of the next. vramfit has one level of datasets, so every subset becomes one dataset dict
that carries every value it inherits, named with vramfit's keys and ready for DatasetConfig. A
kohya folder (train_data_dir) holds subfolders named `<repeats>_<class tokens>`, each one dataset.

What vramfit cannot follow (a kohya option it lacks, an unknown key, a bad value) is never dropped
in silence: every such problem is collected and raised at once as a KohyaImportError naming the
file and the table path of the key. Keys left at kohya's own default are accepted.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pydantic import ValidationError

from vramfit.config.schema import DatasetConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class KohyaImportError(ValueError):
    """A kohya dataset config or folder vramfit cannot follow; `problems` holds one line per
    problem, each naming the file or folder and the table path of the key."""

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = list(problems) or [message]


@dataclass(frozen=True)
class KohyaImport:
    """What a kohya config or folder gives: vramfit dataset dicts, train keys, notes."""

    datasets: list[dict]  # each a dict of DatasetConfig keys, ready for DatasetConfig(**d)
    train: dict = field(default_factory=dict)  # train keys the kohya config sets ("batch_size")
    notes: list[str] = field(default_factory=list)  # what was skipped, and why


# Where a kohya key may be written: "d" a dataset key ([general], [[datasets]]), "a" a subset key
# that a subset inherits ([general], [[datasets]], [[datasets.subsets]]), "s" a subset's own key.
_LEVELS = {"d": ("general", "dataset"), "a": ("general", "dataset", "subset"), "s": ("subset",)}
_TABLES = {"general": "[general]", "dataset": "[[datasets]]", "subset": "[[datasets.subsets]]"}
# The kinds of kohya subset: DreamBooth (image_dir and caption files or class tokens), fine-tuning
# (a metadata_file), masked loss (a conditioning_data_dir of masks: kohya's ControlNet subset).
_KINDS = {"db": "DreamBooth subsets (image_dir without metadata_file)",
          "ft": "fine-tuning subsets (with metadata_file)",
          "cn": "mask subsets (with conditioning_data_dir)"}
_ALL = frozenset(_KINDS)

# kohya key -> (value type, where it may be written, subset kinds that read it). From kohya's
# config schema (library/config_util.py) and docs/config_README-en.md.
_KEYS: dict[str, tuple[str, str, frozenset]] = {
    "image_dir": ("str", "s", _ALL),
    "metadata_file": ("str", "s", frozenset({"ft"})),
    "conditioning_data_dir": ("str", "s", frozenset({"cn"})),
    "is_reg": ("bool", "s", frozenset({"db"})),
    "alpha_mask": ("bool", "s", frozenset({"db", "ft"})),
    "num_repeats": ("int", "a", _ALL),
    "class_tokens": ("str", "a", frozenset({"db"})),
    "caption_extension": ("str", "a", frozenset({"db", "cn"})),
    "cache_info": ("bool", "a", frozenset({"db", "cn"})),
    "shuffle_caption": ("bool", "a", _ALL),
    "caption_separator": ("str", "a", _ALL),
    "keep_tokens": ("int", "a", _ALL),
    "keep_tokens_separator": ("str", "a", _ALL),
    "secondary_separator": ("str", "a", _ALL),
    "enable_wildcard": ("bool", "a", _ALL),
    "color_aug": ("bool", "a", _ALL),
    "flip_aug": ("bool", "a", _ALL),
    "face_crop_aug_range": ("pair", "a", _ALL),
    "random_crop": ("bool", "a", _ALL),
    "caption_prefix": ("str", "a", _ALL),
    "caption_suffix": ("str", "a", _ALL),
    "caption_dropout_rate": ("num", "a", _ALL),
    "caption_dropout_every_n_epochs": ("int", "a", _ALL),
    "caption_tag_dropout_rate": ("num", "a", _ALL),
    "token_warmup_min": ("int", "a", _ALL),
    "token_warmup_step": ("num", "a", _ALL),
    "custom_attributes": ("table", "a", _ALL),
    "resize_interpolation": ("str", "a", _ALL),  # kohya takes it for datasets too
    "batch_size": ("int", "d", _ALL),
    "resolution": ("reso", "d", _ALL),
    "enable_bucket": ("bool", "d", _ALL),
    "bucket_reso_steps": ("int", "d", _ALL),
    "min_bucket_reso": ("int", "d", _ALL),
    "max_bucket_reso": ("int", "d", _ALL),
    "bucket_no_upscale": ("bool", "d", _ALL),
    "network_multiplier": ("num", "d", _ALL),
    "validation_split": ("num", "d", _ALL),
    "validation_seed": ("int", "d", _ALL),
}

# kohya key -> vramfit dataset key, for the keys whose value carries over as it is.
_SAME = {"num_repeats": "repeats", "class_tokens": "default_caption", "is_reg": "regularization",
         "caption_extension": "caption_extension", "keep_tokens": "keep_tokens",
         "shuffle_caption": "shuffle_tags", "flip_aug": "flip", "caption_dropout_rate": "caption_dropout",
         "random_crop": "random_crop", "alpha_mask": "alpha_mask", "caption_separator": "tag_separator",
         "bucket_reso_steps": "bucket_step", "validation_split": "validation_share"}
_PATHS = {"image_dir": "path", "metadata_file": "metadata", "conditioning_data_dir": "masks"}

_KOHYA_MIN_BUCKET, _KOHYA_MAX_BUCKET = 256, 1024
# kohya options vramfit lacks: (is the value kohya's no-op default, why it cannot be followed).
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "color_aug": (lambda v: v is False, "vramfit has no colour augmentation (latents are cached once)"),
    "face_crop_aug_range": (lambda v: False, "vramfit has no face-centred crop augmentation"),
    "token_warmup_min": (lambda v: v == 1, "vramfit has no token warm-up (captions are encoded once)"),
    "token_warmup_step": (lambda v: v == 0, "vramfit has no token warm-up (captions are encoded once)"),
    "caption_prefix": (lambda v: v == "", "vramfit adds no prefix to captions (write it into them)"),
    "caption_suffix": (lambda v: v == "", "vramfit adds no suffix to captions (write it into them)"),
    "caption_tag_dropout_rate": (lambda v: v == 0, "vramfit has no per-tag dropout (caption_dropout_rate "
                                 "drops whole captions)"),
    "caption_dropout_every_n_epochs": (lambda v: v == 0, "vramfit drops captions at random draws only "
                                       "(caption_dropout_rate), not every n epochs"),
    "keep_tokens_separator": (lambda v: v == "", "vramfit keeps the first keep_tokens tags, with no "
                              "separator that ends the kept part"),
    "secondary_separator": (lambda v: v == "", "vramfit has no secondary tag separator"),
    "enable_wildcard": (lambda v: v is False, "vramfit has no {a|b} wildcards (for one caption per line "
                        "set data.caption_per_line = true)"),
    "cache_info": (lambda v: v is False, "vramfit caches image sizes itself"),
    "custom_attributes": (lambda v: v == {}, "vramfit passes no custom attributes"),
    "resize_interpolation": (lambda v: v.lower() == "lanczos", "vramfit resizes with Lanczos only"),
    "bucket_no_upscale": (lambda v: v is False, "vramfit scales every image to its bucket (images "
                          "smaller than data.min_size are skipped)"),
    "network_multiplier": (lambda v: v == 1, "vramfit trains at network multiplier 1"),
    "validation_seed": (lambda v: False, "vramfit picks the validation images by a hash of their file "
                        "names, the same every run"),
    "min_bucket_reso": (lambda v: v == _KOHYA_MIN_BUCKET, ""),  # text: _bucket_limits
    "max_bucket_reso": (lambda v: v == _KOHYA_MAX_BUCKET, ""),
}
# kohya options that are not dataset-config keys, and where vramfit takes them.
_ELSEWHERE = {"prior_loss_weight": "a kohya training option; set prior.loss_weight in the vramfit config",
              "train_data_dir": "a kohya training option; give the folder as data.kohya",
              "reg_data_dir": "a kohya training option; give the folder as data.kohya_reg",
              "train_batch_size": "kohya calls it batch_size in a dataset config"}
_TYPE_NAMES = {"bool": "true or false", "int": "an integer", "num": "a number", "str": "a string",
               "pair": "a list of two numbers", "table": "a table",
               "reso": "an integer or a list of two integers"}
_FOLDER = re.compile(r"(\d+)(?:_(.*))?", re.DOTALL)


def kohya_datasets(source: Path, reg: Optional[Path] = None) -> KohyaImport:
    """The vramfit datasets of a kohya dataset config (`source` a .toml file) or of a kohya
    train_data_dir (`source` a folder), plus `reg` (a reg_data_dir) as regularization datasets.
    Raises KohyaImportError listing every problem."""
    source = Path(source)
    problems: list[str] = []
    notes: list[str] = []
    datasets: list[dict] = []
    train: dict = {}
    if os.path.isdir(source):
        datasets += _from_folder(source, False, problems, notes)
    elif source.suffix.lower() == ".toml" and os.path.isfile(source):
        datasets += _from_toml(source, problems, notes, train)
    elif not os.path.lexists(source):
        problems.append(f"{source}: not there (a kohya dataset config .toml or a train_data_dir folder)")
    else:
        problems.append(f"{source}: neither a kohya dataset config (.toml) nor a folder (a kohya "
                        "train_data_dir of <repeats>_<class tokens> subfolders)")
    if reg is not None:
        reg = Path(reg)
        if os.path.isdir(reg):
            datasets += _from_folder(reg, True, problems, notes)
        else:
            problems.append(f"{reg}: {'not a folder' if os.path.lexists(reg) else 'not there'} (a kohya "
                            "reg_data_dir of <repeats>_<class tokens> subfolders)")
    problems = list(dict.fromkeys(map(_printable, problems)))
    notes = [_printable(n) for n in notes]
    if problems:
        head = (f"{len(problems)} problems importing the kohya datasets:\n  " if len(problems) > 1 else "")
        raise KohyaImportError(head + "\n  ".join(problems), problems)
    _name_apart(datasets)
    return KohyaImport(datasets, train, notes)


# --------------------------------------------------------------------------- folders


def _from_folder(root: Path, is_reg: bool, problems: list[str], notes: list[str]) -> list[dict]:
    """A train_data_dir or reg_data_dir: each `<repeats>_<class tokens>` subfolder is one dataset."""
    what = "reg_data_dir" if is_reg else "train_data_dir"
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        problems.append(f"{root}: cannot list the {what}: {exc.strerror or exc}")
        return []
    out, files = [], 0
    for entry in entries:
        if entry.name.startswith("."):
            continue
        folder = root / entry.name
        if not _is_dir(entry):
            files += _is_file(entry)
            continue
        match = _FOLDER.fullmatch(entry.name)
        if match is None:
            notes.append(f"{folder}: skipped, not named <repeats>_<class tokens> (e.g. 10_sks dog); "
                         "kohya skips it too")
            continue
        repeats, caption = int(match.group(1)), match.group(2) or None
        if not _utf8(entry.name):
            problems.append(f"{folder}: its name is not UTF-8 text, and it would be the caption of its "
                            "images; rename the folder")
            continue
        if repeats == 0:
            problems.append(f"{folder}: 0 repeats train none of its images; rename it with 1 or more "
                            "(e.g. 1_" + (caption or "name") + ") or move it out of the " + what)
            continue
        d = {"path": os.path.abspath(folder), "repeats": repeats}
        if caption is not None:
            d["default_caption"] = caption
        if is_reg:
            d["regularization"] = True
        errors = _field_errors(d)
        for key, msg in errors:
            problems.append(f"{folder}: {key} = {d.get(key)!r}: {msg}")
        if not errors:
            _caption_suffix_note(d, f"{folder}", notes)
            out.append(d)
    if not out and not any(p.startswith(f"{root}{os.sep}") for p in problems):
        hint = (f" (it holds {files} file(s) directly; for a plain folder of images use data.path)"
                if files else "")
        if _FOLDER.fullmatch(root.name):
            hint = f" ({root.name} looks like one of them: give the folder that holds it)"
        problems.append(f"{root}: no subfolder named <repeats>_<class tokens> (e.g. 10_sks dog: 10 repeats, "
                        f"caption 'sks dog' for images without a caption file) in this {what}{hint}")
    elif files:
        notes.append(f"{root}: {files} file(s) directly in the {what} are not read; kohya reads only its "
                     "<repeats>_<class tokens> subfolders")
    return out


def _printable(text: str) -> str:
    """`text` with the undecodable bytes of file names as \\xNN, so that logs can print it."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes of the file system name, escaped by Python
        return False
    return True


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _caption_suffix_note(d: dict, where: str, notes: list[str]) -> None:
    """kohya's default caption suffix is .caption, vramfit's .txt: say so where a dataset that does
    not set caption_extension holds .caption files."""
    if "caption_extension" in d or "metadata" in d:
        return
    try:
        with os.scandir(d["path"]) as it:
            found = any(e.name.endswith(".caption") for e in it)
    except OSError:
        return
    if found:
        notes.append(f"{where}: holds .caption files (kohya's default caption suffix) and sets no "
                     "caption_extension; vramfit reads data.caption_extension (.txt unless set): set "
                     "data.caption_extension = \".caption\" to train them")


# --------------------------------------------------------------------------- dataset config TOML


def _from_toml(path: Path, problems: list[str], notes: list[str], train: dict) -> list[dict]:
    """Every subset of a kohya dataset config, flattened into one vramfit dataset dict each."""
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a BOM (Windows editors) is no TOML error
        doc = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        problems.append(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8")
        return []
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{path}: not valid TOML: {exc}")
        return []
    except OSError as exc:
        problems.append(f"{path}: cannot read it: {exc.strerror or exc}")
        return []
    reader = _TomlReader(path, problems)
    return reader.read(doc, notes, train)


class _TomlReader:
    """Checks and flattens one kohya dataset config; problems go to the shared list."""

    def __init__(self, path: Path, problems: list[str]):
        self.path = path
        self.folder = Path(os.path.abspath(path.expanduser())).parent
        self.problems = problems
        self.bad: set[tuple[str, str]] = set()  # (place, key) already reported: not read again

    def problem(self, place: str, key: Optional[str], text: str) -> None:
        where = ".".join(p for p in (place, key) if p)
        self.problems.append(f"{self.path}: {where + ': ' if where else ''}{text}")

    def read(self, doc: dict, notes: list[str], train: dict) -> list[dict]:
        for key in doc:
            if key not in ("general", "datasets"):
                close = _did_you_mean(key, ("general", "datasets"))
                self.problem("", None, f"unknown table or key {key!r}{close}; a kohya dataset config has "
                             "[general] and [[datasets]]")
        general = doc.get("general", {})
        if not isinstance(general, dict):
            self.problem("general", None, "must be a table: write [general]")
            general = {}
        datasets = doc.get("datasets", [])
        if not isinstance(datasets, list) or not all(isinstance(d, dict) for d in datasets):
            self.problem("datasets", None, "must be tables: write [[datasets]] (two brackets) for each")
            return []
        self.check("general", general, "general", None)
        out, batch = [], {}  # batch: {place: batch_size} of the places a dataset takes it from
        for i, dataset in enumerate(datasets):
            place = f"datasets[{i}]"
            subsets = dataset.get("subsets", [])
            if isinstance(subsets, dict) or not isinstance(subsets, list) or not all(
                    isinstance(s, dict) for s in subsets):
                self.problem(place, "subsets", "must be tables: write [[datasets.subsets]] for each")
                continue
            kinds = [_kind(s) for s in subsets]
            self.check(place, dataset, "dataset", kinds)
            size = self.lookup("batch_size", ((place, dataset), ("general", general)))
            if size is not None and subsets:
                batch[size[0]] = size[1]
            if not subsets:
                notes.append(f"{self.path}: {place} has no [[datasets.subsets]]; nothing to train from it")
            seen: dict[str, str] = {}
            for j, (subset, kind) in enumerate(zip(subsets, kinds)):
                sub = f"{place}.subsets[{j}]"
                self.check(sub, subset, "subset", [kind])
                d = self.flatten(((sub, subset), (place, dataset), ("general", general)), kind)
                if d is None:
                    continue
                first = seen.setdefault(d["path"], sub)
                if first != sub:  # kohya keeps the first subset of a folder in a dataset
                    notes.append(f"{self.path}: {sub}: skipped, its image_dir is the folder of {first} "
                                 "(kohya uses only the first)")
                    continue
                _caption_suffix_note(d, f"{self.path}: {sub}", notes)
                out.append(d)
        if len(set(batch.values())) > 1:
            given = ", ".join(f"{p}.batch_size = {v}" for p, v in batch.items())
            self.problem("", None, f"the batch sizes differ ({given}); vramfit trains one batch size a run "
                         "(train.batch_size): give every dataset the same one")
        elif batch:
            train["batch_size"] = next(iter(batch.values()))
        if not out and datasets and not self.problems:
            self.problem("datasets", None, "no [[datasets.subsets]] in any [[datasets]]: nothing to train")
        elif not datasets:
            self.problem("", None, "no [[datasets]] table: nothing to train")
        return out

    def check(self, place: str, table: dict, level: str, kinds: Optional[list[str]]) -> None:
        """Report every key of one table that kohya does not read there, or vramfit cannot follow."""
        allowed = [k for k, (_, where, readers) in _KEYS.items() if level in _LEVELS[where]
                   and (kinds is None or level != "subset" or readers & set(kinds))]
        for key, value in table.items():
            if key == "subsets" and level == "dataset":
                continue
            spec = _KEYS.get(key)
            why = None
            if spec is None:
                why = _ELSEWHERE.get(key) or f"unknown key{_did_you_mean(key, allowed)}"
                if key == "subsets":
                    why += "; kohya reads [[datasets.subsets]] only inside [[datasets]]"
            elif level not in _LEVELS[spec[1]]:
                tables = " or ".join(_TABLES[t] for t in _LEVELS[spec[1]])
                why = f"kohya reads it only in {tables}; move it there"
            elif kinds and not spec[2] & set(kinds):
                why = f"kohya's {_KINDS[kinds[0]]} take no {key}; remove the key"
            elif not _type_ok(spec[0], value):
                why = f"{value!r} is not {_TYPE_NAMES[spec[0]]}"
            elif key == "enable_bucket" and value is False:
                why = "vramfit always buckets images by aspect ratio; remove the key or set it to true"
            elif key in _UNSUPPORTED and not _UNSUPPORTED[key][0](value):
                why = _bucket_limits(table) if key.endswith("_bucket_reso") else _UNSUPPORTED[key][1]
                why += "; remove the key"
            if why is not None:
                self.bad.add((place, key))
                self.problem(place, key, why)

    def lookup(self, key: str, chain) -> Optional[tuple[str, Any]]:
        """(place, value) of `key` in the first (place, table) of `chain` that sets it; a value
        already reported (a wrong type, a key kohya does not read there) is passed over."""
        for place, table in chain:
            if key in table and (place, key) not in self.bad:
                return place, table[key]
        return None

    def flatten(self, chain, kind: str) -> Optional[dict]:
        """One subset with all it inherits, as a vramfit dataset dict (None when it cannot be)."""
        sub = chain[0][0]
        d: dict = {}
        origin: dict[str, tuple[str, str, Any]] = {}  # vramfit key -> (place, kohya key, value)
        for key, (_, _, readers) in _KEYS.items():
            if kind not in readers:
                continue  # kohya's subsets of this kind do not read it (an inherited value)
            found = self.lookup(key, chain)
            if found is None:
                continue
            place, value = found
            if key in _PATHS:
                value = self.resolve(place, key, value)
                if value is None:
                    continue
                d[_PATHS[key]] = value
            elif key == "num_repeats" and value < 1:
                self.problem(place, key, f"{value} repeats train none of the images (kohya skips such a "
                             "subset); set 1 or more, or remove the subset")
                continue
            elif key == "class_tokens" and value == "":
                continue  # kohya's empty class tokens: no caption for uncaptioned images
            elif key == "resolution":
                value = self.square(place, value)
                if value is None:
                    continue
                d["resolution"] = value
            elif key in _SAME:
                d[_SAME[key]] = value
            else:
                continue  # enable_bucket, batch_size (train), unsupported keys at kohya's default
            origin[_PATHS.get(key) or _SAME.get(key) or key] = (place, key, value)
        if d.get("regularization") and "validation_share" in d:
            d["validation_share"] = 0.0  # kohya holds no regularization image out for validation
        if "path" not in d:
            if "image_dir" not in chain[0][1]:
                where = " (the folder the metadata's image keys are in)" if kind == "ft" else ""
                self.problem(sub, "image_dir", f"missing: vramfit needs the folder of the images{where}")
            return None
        errors = _field_errors(d)
        for vkey, msg in errors:
            place, key, value = origin.get(vkey, (sub, vkey, d.get(vkey)))
            self.problem(place, key, f"{value!r}: {msg}")
        return None if errors else d

    def resolve(self, place: str, key: str, value: str) -> Optional[str]:
        """An absolute path: a relative one is looked up beside the TOML, then (as kohya) in the
        current directory."""
        given = Path(value).expanduser()
        candidates = [given] if given.is_absolute() else [self.folder / given, Path.cwd() / given]
        for path in candidates:
            if os.path.exists(path):
                want_dir = key != "metadata_file"
                if os.path.isdir(path) != want_dir:
                    what = "not a folder" if want_dir else "a folder, not a file"
                    self.problem(place, key, f"{value!r} ({path}) is {what}")
                    return None
                return os.path.abspath(path)
        where = (f"looked in {candidates[0].parent} (the config's folder) and the current directory "
                 f"{Path.cwd()}" if not given.is_absolute() else "no such path")
        self.problem(place, key, f"{value!r} is not there ({where})")
        return None

    def square(self, place: str, value) -> Optional[int]:
        """kohya's resolution (N or [W, H]) as vramfit's square base bucket side."""
        if isinstance(value, int):
            return value
        w, h = value
        if w == h:
            return w
        side = max(64, round(math.sqrt(w * h) / 64) * 64)
        self.problem(place, "resolution", f"{value!r}: vramfit's base bucket is square (its other buckets "
                     f"keep about its area); use resolution = {side} (the square of about the same area)")
        return None


def _field_errors(d: dict) -> list[tuple[str, str]]:
    """(vramfit key, what is wrong) for each value of `d` DatasetConfig refuses. Checks across keys
    are left to the run's config, where [data]'s values fill what `d` leaves out."""
    try:
        DatasetConfig.model_validate(d)
    except ValidationError as exc:
        return [(str(e["loc"][0]), e["msg"][:1].lower() + e["msg"][1:]) for e in exc.errors() if e["loc"]]
    return []


def _kind(subset: dict) -> str:
    """A subset's kind, as kohya tells it: masks (conditioning_data_dir), metadata, else DreamBooth."""
    if "conditioning_data_dir" in subset:
        return "cn"
    return "ft" if "metadata_file" in subset else "db"


def _type_ok(kind: str, value) -> bool:
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return {"bool": lambda: isinstance(value, bool), "int": lambda: integer(value),
            "num": lambda: number(value), "str": lambda: isinstance(value, str),
            "table": lambda: isinstance(value, dict),
            "pair": lambda: isinstance(value, list) and len(value) == 2 and all(map(number, value)),
            "reso": lambda: integer(value) or (isinstance(value, list) and len(value) == 2
                                              and all(map(integer, value)))}[kind]()


def _bucket_limits(table: dict) -> str:
    """Why min/max_bucket_reso cannot be followed, with the max_aspect of about the same buckets."""
    text = ("vramfit bounds bucket shapes by max_aspect (longest side over shortest), not by side "
            "lengths")
    reso = table.get("resolution")
    if isinstance(reso, list) and len(reso) == 2 and reso[0] == reso[1]:
        reso = reso[0]
    low = table.get("min_bucket_reso", _KOHYA_MIN_BUCKET)
    high = table.get("max_bucket_reso", _KOHYA_MAX_BUCKET)
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (reso, low, high)):
        longest = min(high, reso * reso / low)  # a bucket keeps about reso^2 pixels
        aspect = min(8.0, max(1.0, round(longest * longest / (reso * reso), 2)))
        text += (f"; at resolution {reso} these limits allow up to {aspect:g}:1, so set "
                 f"data.max_aspect = {aspect:g} in the vramfit config")
    return text


def _did_you_mean(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _name_apart(datasets: list[dict]) -> None:
    """vramfit names a dataset by its folder; where two folders share a name (img/ of two
    characters, 1_dog in both the train and the reg folder) give each the shortest distinct tail of
    its path as its name."""
    labels = [Path(d["path"]).name for d in datasets]
    for label in {n for n in labels if labels.count(n) > 1}:
        group = [d for d, n in zip(datasets, labels) if n == label]
        parts = [Path(d["path"]).parts for d in group]
        for depth in range(2, max(map(len, parts)) + 1):
            names = [Path(*p[-depth:]).as_posix() for p in parts]
            if len(set(names)) == len(names):
                break
        for n, (d, name) in enumerate(zip(group, names)):
            d["name"] = name if names.count(name) == 1 else f"{name} ({n + 1})"
