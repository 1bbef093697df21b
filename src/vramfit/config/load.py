"""Build a RunConfig from a TOML file and `--set key=value` overrides, checked once.

Every problem (type errors, unknown keys, missing files, folders that cannot be written,
impossible combinations) is collected and raised together as one ConfigError before any weights
are loaded, each line naming its key path and, for unknown keys, the closest valid key.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from pydantic import BaseModel, ValidationError

from vramfit.config.schema import DEVICE_PATTERN, KeyProblems, RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A config that cannot run; `problems` holds one line per problem."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


def _parse_value(text: str) -> Any:
    """Read an override value as a TOML literal (numbers, bools, lists), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: Iterable[str]) -> list[str]:
    """Apply `a.b=value` overrides in place; return problems for malformed ones."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"--set {item!r}: expected key=value, e.g. train.lr=1e-5")
            continue
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"--set {key}: {part} is a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = _parse_value(value.strip())
    return problems


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Valid field names at a location of the schema (for "did you mean")."""
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None) if field else None
        if typing.get_origin(ann) is list:
            ann = typing.get_args(ann)[0]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return list(model.model_fields)


_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _key_path(loc: tuple) -> tuple:
    """The config key of an error location: section and key names and list positions, without
    the names pydantic gives the members of a union (train.gradient_checkpointing.bool)."""
    model: Any = RunConfig
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
        elif model is not None and part in model.model_fields:
            path.append(part)
            ann = model.model_fields[part].annotation
            if typing.get_origin(ann) is list:  # a list of tables (data.datasets): its members' keys
                ann = typing.get_args(ann)[0]
            model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        elif model is not None:  # an unknown key: reported as such
            path.append(part)
    return tuple(path)


def _dotted(loc) -> str:
    """A key path as a user writes it: data.datasets[0].repeats."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _named_datasets(problems: list[str], data: dict) -> list[str]:
    """Problems of data.datasets[i] naming the dataset too: data.datasets[0] ('dogs')."""
    entries = (data.get("data") or {}).get("datasets") if isinstance(data.get("data"), dict) else None
    if not isinstance(entries, list):
        return problems
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and isinstance(entry.get("name") or entry.get("path"), str):
            label = entry.get("name") or Path(entry["path"]).name or entry["path"]
            key = f"data.datasets[{i}]"
            problems = [p.replace(key, f"{key} ({label!r})", 1) if p.startswith(key) else p for p in problems]
    return problems


def _describe_all(errors: list[dict]) -> list[str]:
    """The lines of a ValidationError; the members of a union that all failed share one line."""
    lines: dict[str, tuple[list[str], str]] = {}
    for err in errors:
        for path, text, shown in _describe(err):
            lines.setdefault(path, ([], shown))[0].append(text)
    return [f"{path}: {'; or '.join(texts)}{shown}" for path, (texts, shown) in lines.items()]


def _describe(err: dict) -> list[tuple[str, str, str]]:
    """(key path, what is wrong, the value given) of each problem of a pydantic error."""
    loc = tuple(_key_path(tuple(err["loc"])))
    error = (err.get("ctx") or {}).get("error")
    if isinstance(error, KeyProblems):  # a check across keys names its keys, relative to its section
        return [(_dotted([*loc, key]), text, "") for key, text in error.problems]
    path = _dotted(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        known = _known_keys(RunConfig, tuple(p for p in loc[:-1] if not isinstance(p, int)))
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
        hint = f"; did you mean {_dotted([*loc[:-1], close[0]])}?" if close else ""
        return [(path, f"unknown key{hint} (valid here: {', '.join(known)})", "")]
    msg = err["msg"]
    for prefix in _PYDANTIC_PREFIXES:
        msg = msg.removeprefix(prefix)
    given = err.get("input")
    shown = "" if isinstance(given, dict) or repr(given) in msg else f" (got {given!r})"
    return [(path, msg, shown)]


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or path.endswith((".safetensors", ".ckpt")) or "\\" in path


def _merged(data: dict) -> dict:
    """The defaults with the user's values laid over them, for checks that run even when the
    schema rejected something else (so path problems are listed together with type problems)."""
    merged = RunConfig.model_construct().model_dump()  # the defaults, not resolved (no torch)
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
    return merged


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def folder_problem(key: str, text: str) -> Optional[str]:
    """Why folder `text` (config key `key`) cannot be created and written to, or None. Tried for
    real: a file is made and removed in the folder, or in its nearest existing ancestor."""
    path = Path(text).expanduser().absolute()
    probe = path
    try:
        while not probe.exists() and not probe.is_symlink():
            probe = probe.parent
        if probe.is_symlink() and not probe.exists():
            return f"{key}: {probe} is a link to nothing; remove it or choose another folder"
        if not probe.is_dir():
            where = f"{text} is" if probe == path else f"{text} lies under {probe}, which is"
            return f"{key}: {where} a file, not a folder; choose another folder"
        handle, name = tempfile.mkstemp(dir=probe, prefix=".vramfit-write-check-")
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        where = text if probe == path else f"{probe} (where {text} would be made)"
        return f"{key}: cannot write in {where}: {exc.strerror or exc}; choose a folder you can write to"
    return None


def default_cache_root() -> Path:
    """Where the latent and text cache and the tiny models live unless cache.dir says otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vramfit"


def cuda_problem(device: str) -> Optional[str]:
    """Why this machine cannot run on `device` (cuda or cuda:N), or None."""
    import torch  # here: a config without a GPU device is checked without importing torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return "no CUDA GPU is visible on this machine"
    index = device.partition(":")[2]
    if index and int(index) >= count:
        return f"this machine shows {count} GPU(s), cuda:0 to cuda:{count - 1}"
    return None


def check_paths(data: dict, *, need_data: bool, need_model: bool = True) -> list[str]:
    """Problems that pydantic cannot see: files that do not exist, folders that cannot be written,
    missing optional packages, GPUs that are not there.
    `need_model=False` (planning a named architecture) leaves the model's files unchecked."""
    v = _merged(data)
    model, dat, log, train = v["model"], v["data"], v["logging"], v["train"]
    problems = []
    if not need_model:
        model = {}  # a named architecture stands in for every model file
    mp = _text(model.get("path"))
    if mp and not mp.startswith("tiny:"):
        p = Path(mp).expanduser()
        if _looks_local(mp) or p.exists():
            if not p.exists():
                problems.append(f"model.path: {mp} does not exist")
        elif mp.count("/") != 1:
            problems.append(
                f"model.path: {mp!r} is neither an existing file or folder nor a repo id "
                f"like org/name (or a tiny model, tiny:<name>)"
            )
    for part in ("vae", "clip_l", "clip_g", "t5"):
        enc = _text(model.get(part))
        if enc and not Path(enc).expanduser().is_file():
            problems.append(f"model.{part}: {enc} is not a file")
    tok = _text(model.get("tokenizers"))
    if tok and not Path(tok).expanduser().is_dir():
        problems.append(f"model.tokenizers: {tok} is not a folder")
    path = _text(dat.get("path"))
    several = bool(dat.get("datasets") or dat.get("kohya"))  # their folders: data/datasets.py checks them
    if need_data and dat.get("path") is None and not several:
        problems.append("data.path: required (a folder of images), e.g. --set data.path=my-images; or "
                        "[[data.datasets]] tables, or data.kohya")
    elif need_data and path and not Path(path).expanduser().is_dir():
        problems.append(f"data.path: {path} is not a folder")
    meta = _text(dat.get("metadata"))
    if meta and not Path(meta).expanduser().is_file() and not (path and (Path(path) / meta).is_file()):
        problems.append(f"data.metadata: {meta} does not exist")
    if log.get("wandb") is True and importlib.util.find_spec("wandb") is None:
        problems.append("logging.wandb: wandb is not installed (pip install wandb) or set it to false")
    device = train.get("device")
    if isinstance(device, str) and re.fullmatch(DEVICE_PATTERN, device) and device.startswith("cuda"):
        problem = cuda_problem(device)
        if problem:
            problems.append(f"train.device: {device} asked for but {problem}")
    given_cache = _text(v["cache"].get("dir"))
    folders = [("cache.dir" if given_cache else "cache.dir (not set: the default folder)",
                given_cache or str(default_cache_root()))]
    if need_data:  # the commands that train write the output folder (class images go there by default)
        folders += [("output.dir", _text(v["output"].get("dir"))),
                    ("prior.class_dir", _text(v["prior"].get("class_dir")))]
    for key, text in folders:
        problem = folder_problem(key, text) if text else None
        if problem:
            problems.append(problem)
    return problems


def load_config(
    path: Path | None, overrides: Iterable[str] = (), *, need_data: bool = True, need_model: bool = True,
    model_checks: Optional[Callable[[RunConfig], list[str]]] = None,
) -> RunConfig:
    """Read, override, validate and check a run config; raise ConfigError listing every problem.
    `need_model=False`: the model's files need not exist (`vramfit plan --model NAME`).
    `model_checks(cfg)`: the problems the models layer sees in a valid config (the caller's, as this
    layer knows no model: models/registry.py named_model_problems), listed with the rest."""
    source = str(path) if path else "config"
    data = _read(Path(path), source) if path is not None else {}
    problems = apply_overrides(data, overrides)
    cfg = None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        problems += _describe_all(exc.errors())
    problems += check_paths(data, need_data=need_data, need_model=need_model)
    if cfg is not None and model_checks is not None:
        problems += model_checks(cfg)
    if problems or cfg is None:
        raise ConfigError(_named_datasets(problems, data), source)
    for note in cfg.start_warnings():
        logging.getLogger("vramfit").warning("%s", note)
    return cfg


def _read(path: Path, source: str) -> dict:
    """The TOML file's contents; a path that is no readable UTF-8 TOML file is a ConfigError."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problem = f"config file {path} does not exist"
    except IsADirectoryError:
        inside = sorted(p.name for p in path.glob("*.toml"))
        problem = (f"config file {path} is a folder; give the .toml file itself"
                   + (f" (here: {', '.join(inside[:5])})" if inside else ""))
    except UnicodeDecodeError as exc:
        problem = (f"config file {path} is not UTF-8 text (byte {exc.start} is "
                   f"{exc.object[exc.start]:#04x}); save it as UTF-8")
    except OSError as exc:
        problem = f"config file {path} cannot be read: {exc.strerror or exc}"
    except tomllib.TOMLDecodeError as exc:
        problem = f"not valid TOML: {exc}"
    raise ConfigError([problem], source)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as TOML, written into every output folder. train.cuda_graphs left to
    its default is written as "auto" with what it resolved to beside it, and an unset
    memory.streamed_grad_sums as a comment saying what it resolved to, so the file, given again
    (another machine, --gpus N), decides afresh; train.steps is left out where train.epochs
    derives it."""
    data = cfg.model_dump(mode="json")
    notes = {}
    if "cuda_graphs" not in cfg.train.model_fields_set:
        notes[("train", "cuda_graphs")] = f"resolved for this run: {'on' if cfg.train.cuda_graphs else 'off'}"
        data["train"]["cuda_graphs"] = "auto"
    sums = cfg.memory.streamed_grad_sums
    if "streamed_grad_sums" not in cfg.memory.model_fields_set and sums is not None:
        # left unset, as cuda_graphs: decided afresh where the file is given again (fit/resolve.py)
        notes[("memory", "streamed_grad_sums")] = f"unset, resolved for this run: {sums}"
        data["memory"]["streamed_grad_sums"] = None
    if cfg.train.epochs is not None:
        del data["train"]["steps"]
    data["data"]["datasets"] = [{k: v for k, v in d.model_dump(mode="json").items() if k in d.model_fields_set}
                                for d in cfg.data.datasets]  # only what each sets: the rest is [data]'s
    return _to_toml(data, notes)


def _to_toml(data: dict, notes: Optional[dict] = None) -> str:
    """Sections of keys, and lists of tables (data.datasets) as [[section.key]] tables."""
    lines, tables = [], []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                tables += [(f"{section}.{key}", v) for v in value]
            elif value is not None and value != []:
                note = (notes or {}).get((section, key))
                lines.append(f"{key} = {json.dumps(value)}" + (f"  # {note}" if note else ""))
            elif (section, key) in (notes or {}):  # an unset key's note
                lines.append(f"# {key}: {notes[(section, key)]}")
        lines.append("")
    for name, table in tables:
        lines.append(f"[[{name}]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items() if value is not None]
        lines.append("")
    return "\n".join(lines)
