"""docs/config.md, rendered from the schema: every section and key of RunConfig with its type,
default and description, so that the reference cannot drift from the code.

    python -m vramfit.config.reference > docs/config.md     (or --write, from the repository root)
"""
from __future__ import annotations

import json
import sys
import textwrap
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from vramfit.config.schema import DATASET_DEFAULTS, RunConfig

DOC = Path("docs") / "config.md"
REGENERATE = "python -m vramfit.config.reference --write"

INTRO = ("Every key of a vramfit config file: write it under its `[section]` in the TOML file, or give it "
         "as `--set section.key=value`. Generated from the schema (`{command}`); back to the "
         "[README](../README.md).")

# One sentence a section, above its table.
SECTIONS = {
    "model": "The base model to fine-tune and how its text encoders are loaded.",
    "data": "The training images, their captions, and the aspect-ratio buckets they are trained in.",
    "cache": "The disk cache of VAE latents and text-encoder outputs.",
    "train": "The training run: what trains, the optimizer, the precision and the speed settings.",
    "lora": "The LoRA adapter of `train.mode = \"lora\"`.",
    "prior": "DreamBooth prior preservation: class images trained beside the instance images.",
    "sample": "Sample grids during training: fixed prompts times fixed seeds, every N steps.",
    "validation": "The validation loss of held-out images, at fixed timesteps and fixed noise.",
    "save": "What is saved, in which formats and precision, and how often.",
    "output": "Where the run writes.",
    "logging": "Progress bars and training logs.",
    "memory": "Where the denoiser's weights, activations and the text encoders live, and the fit checks.",
    "ema": "An exponential moving average of the trained weights, saved beside them.",
}

_BOUNDS = (("ge", "at least"), ("gt", "above"), ("le", "at most"), ("lt", "below"))
_SCALARS = {bool: "boolean", int: "integer", float: "float", str: "string"}


def _number(value: Any) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    return str(value)


def _bounds(metadata: list) -> str:
    """The numeric limits and lengths of `metadata` (pydantic's constraint objects) as text."""
    found = {}
    # a Field(...) inside Annotated (Seed, the elements of train.betas) holds its constraints in .metadata
    items = [m for entry in metadata for m in (entry.metadata if isinstance(entry, FieldInfo) else [entry])]
    for item in items:
        for name, _ in _BOUNDS:
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
        if getattr(item, "min_length", None):
            found["min_length"] = item.min_length
    if "ge" in found and "le" in found:
        text = [f"{_number(found['ge'])} to {_number(found['le'])}"]
    else:
        text = [f"{words} {_number(found[name])}" for name, words in _BOUNDS if name in found]
    if found.get("min_length") == 1:
        text.append("not empty")
    elif "min_length" in found:
        text.append(f"at least {found['min_length']} long")
    return ", ".join(text)


def type_text(annotation: Any, metadata: list = ()) -> str:
    """A key's type as a user writes it in TOML, with its limits."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0], [*args[1:], *metadata])
    limits = _bounds(list(metadata))
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        text = " or ".join(type_text(a) for a in kinds)
        text = f"{text} ({limits})" if limits else text
        return text + (", or unset" if len(kinds) < len(args) else "")
    if origin is Literal:
        text = " or ".join(f'`{json.dumps(a)}`' for a in args)
    elif origin is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        text = "list of tables (the table below)"
    elif origin is list:
        text = f"list, each {type_text(args[0])}"
    elif origin is tuple:
        text = f"list of {len(args)}: " + ", ".join(type_text(a) for a in args)
    else:
        text = _SCALARS.get(annotation) or getattr(annotation, "__name__", str(annotation))
    return f"{text} ({limits})" if limits else text


def default_text(field: FieldInfo) -> str:
    """The default as the TOML value a resolved config.toml writes (unset: the key is left out)."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped everywhere, and "<" outside code spans (else it
    would open an HTML tag: <name>)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "\\<") for i, p in enumerate(parts))


def render() -> str:
    """docs/config.md: a table a section, a row a key."""
    lines = ["# Configuration reference", "", textwrap.fill(INTRO.format(command=REGENERATE), 100), ""]
    for section, info in RunConfig.model_fields.items():
        lines += [f"## [{section}]", "", SECTIONS[section], "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        tables = []
        for key, field in info.annotation.model_fields.items():
            cells = [f"`{section}.{key}`", type_text(field.annotation, field.metadata), default_text(field),
                     field.description or ""]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
            if get_origin(field.annotation) is list and isinstance(get_args(field.annotation)[0], type) \
                    and issubclass(get_args(field.annotation)[0], BaseModel):
                tables.append((f"{section}.{key}", get_args(field.annotation)[0], info.annotation))
        lines.append("")
        for name, model, _ in tables:  # [[data.datasets]]: the keys of its own; the rest are [data]'s
            own = [k for k in model.model_fields if k not in DATASET_DEFAULTS]
            lines += [f"### [[{name}]]", "", textwrap.fill(
                f"Each table also takes every [{section}] key that describes a dataset "
                f"({', '.join(f'`{k}`' for k in DATASET_DEFAULTS)}); one it leaves out is [{section}]'s. "
                "Its own keys:", 100), "", "| key | type | default | description |", "|---|---|---|---|"]
            for key in own:
                field = model.model_fields[key]
                cells = [f"`{key}`", type_text(field.annotation, field.metadata),
                         default_text(field) if not field.is_required() else "required", field.description or ""]
                lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"]):
        print(f"usage: python -m vramfit.config.reference [--write]   (--write: {DOC}, from the "
              "repository root; without it the text goes to stdout)", file=sys.stderr)
        return 2
    text = render()
    if not argv:
        sys.stdout.write(text)
        return 0
    if not DOC.parent.is_dir():
        print(f"no {DOC.parent}/ folder in {Path.cwd()}; run this from the repository root", file=sys.stderr)
        return 2
    try:
        DOC.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"could not write {DOC.resolve()}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
