"""Build a RunConfig from a TOML file and `--set key=value` overrides, checked once.

Every problem (type errors, unknown keys, missing files, impossible combinations) is collected
and raised together as one ConfigError before any weights are loaded, each line naming its key
path and, for unknown keys, the closest valid key.
"""
from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ValidationError

from vramfit.config.schema import RunConfig

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
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return list(model.model_fields)


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        known = _known_keys(RunConfig, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""
        return f"{path}: unknown key{hint} (valid here: {', '.join(known)})"
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"{path}: {err['msg']}{shown}"


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or path.endswith((".safetensors", ".ckpt")) or "\\" in path


def _merged(data: dict) -> dict:
    """The defaults with the user's values laid over them, for checks that run even when the
    schema rejected something else (so path problems are listed together with type problems)."""
    merged = RunConfig().model_dump()
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
    return merged


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def check_paths(data: dict, *, need_data: bool) -> list[str]:
    """Problems that pydantic cannot see: files that do not exist, missing optional packages."""
    v = _merged(data)
    model, dat, log, train = v["model"], v["data"], v["logging"], v["train"]
    problems = []
    mp = _text(model.get("path"))
    if mp and not mp.startswith("tiny:"):
        p = Path(mp).expanduser()
        if _looks_local(mp) or p.exists():
            if not p.exists():
                problems.append(f"model.path: {mp} does not exist")
        elif mp.count("/") != 1:
            problems.append(
                f"model.path: {mp!r} is neither an existing file or folder nor a repo id "
                "like org/name (or tiny:sdxl, tiny:ssd1b, tiny:sd3)"
            )
    for part in ("clip_l", "clip_g", "t5"):
        enc = _text(model.get(part))
        if enc and not Path(enc).expanduser().is_file():
            problems.append(f"model.{part}: {enc} is not a file")
    tok = _text(model.get("tokenizers"))
    if tok and not Path(tok).expanduser().is_dir():
        problems.append(f"model.tokenizers: {tok} is not a folder")
    path = _text(dat.get("path"))
    if need_data and dat.get("path") is None:
        problems.append("data.path: required (a folder of images), e.g. --set data.path=my-images")
    elif need_data and path and not Path(path).expanduser().is_dir():
        problems.append(f"data.path: {path} is not a folder")
    meta = _text(dat.get("metadata"))
    if meta and not Path(meta).expanduser().is_file() and not (path and (Path(path) / meta).is_file()):
        problems.append(f"data.metadata: {meta} does not exist")
    if log.get("wandb") is True and importlib.util.find_spec("wandb") is None:
        problems.append("logging.wandb: wandb is not installed (pip install wandb) or set it to false")
    device = train.get("device")
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            problems.append(f"train.device: {device} asked for but no CUDA GPU is visible")
    return problems


def load_config(
    path: Path | None, overrides: Iterable[str] = (), *, need_data: bool = True
) -> RunConfig:
    """Read, override, validate and check a run config; raise ConfigError listing every problem."""
    source = str(path) if path else "config"
    data: dict = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError([f"config file {path} does not exist"], source) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError([f"not valid TOML: {exc}"], source) from None
    problems = apply_overrides(data, overrides)
    cfg = None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        problems += [_describe(e) for e in exc.errors()]
    problems += check_paths(data, need_data=need_data)
    if problems or cfg is None:
        raise ConfigError(problems, source)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as TOML, written into every output folder. train.cuda_graphs left to
    its default is written as "auto" with what it resolved to beside it, so the file, given
    again (another machine, --gpus N), decides afresh."""
    data = cfg.model_dump(mode="json")
    notes = {}
    if "cuda_graphs" not in cfg.train.model_fields_set:
        notes[("train", "cuda_graphs")] = f"resolved for this run: {'on' if cfg.train.cuda_graphs else 'off'}"
        data["train"]["cuda_graphs"] = "auto"
    return _to_toml(data, notes)


def _to_toml(data: dict, notes: Optional[dict] = None) -> str:
    import json

    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is not None:
                note = (notes or {}).get((section, key))
                lines.append(f"{key} = {json.dumps(value)}" + (f"  # {note}" if note else ""))
        lines.append("")
    return "\n".join(lines)
