"""The model families vramfit knows (each one folder, models/<family>/), their tiny models, and
detection of which family a source holds."""
from __future__ import annotations

import difflib
import json
from pathlib import Path

from vramfit.formats.lora import describe_lora
from vramfit.formats.safetensors_io import CheckpointError, read_header
from vramfit.models.adapter import Family, Source, resolution_problems
from vramfit.models.flux import FluxFamily
from vramfit.models.sd3 import SD3Family
from vramfit.models.sdxl import SDXLFamily

FAMILIES: dict[str, Family] = {family.name: family for family in (SDXLFamily(), SD3Family(), FluxFamily())}

# Every tiny model (model.path tiny:<name>) and its family's name: the one list that messages and
# the config check read.
TINY_MODELS = {tiny: name for name, family in FAMILIES.items() for tiny in family.tiny_models}


def tiny_choices() -> str:
    """Every tiny model as model.path spells it, for messages: "tiny:sdxl, tiny:ssd1b, tiny:sd3"."""
    return ", ".join(f"tiny:{name}" for name in TINY_MODELS)


def unknown_tiny(path: str) -> str | None:
    """Why model.path `path` (tiny:<name>) names no tiny model, with the closest one; None if it does."""
    name = path.split(":", 1)[1]
    if name in TINY_MODELS:
        return None
    close = difflib.get_close_matches(name, list(TINY_MODELS), n=1, cutoff=0.6)
    hint = f"; did you mean tiny:{close[0]}?" if close else ""
    return f"{path} is not a tiny model{hint} (tiny models: {tiny_choices()})"


def materialize_tiny(path: str, root: Path) -> Path:
    """The single file of any tiny model (`path`: tiny:<name>) under `root`, written by its family
    if needed."""
    problem = unknown_tiny(path)
    if problem:
        raise ValueError(f"model.path: {problem}")
    name = path.split(":", 1)[1]
    return FAMILIES[TINY_MODELS[name]].materialize_tiny(name, root)

# Keys that identify checkpoints of families vramfit does not train yet, for a clear refusal.
_KNOWN_OTHERS = {
    "joint_blocks.0.x_block.attn.qkv.weight": "Stable Diffusion 3 transformer without its VAE "
    "(the model.diffusion_model. prefix is missing)",
    "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": "Stable Diffusion 1.x",
    "cond_stage_model.model.token_embedding.weight": "Stable Diffusion 2.x",
}


def detect_family(source: Source, requested: str = "auto") -> Family:
    """The family of `source` (`requested` where the config names one); a LoRA file, or a
    checkpoint of a family vramfit does not train, is a CheckpointError saying what it is."""
    if source.kind == "single_file":
        keys = set(read_header(source.path)[0])
        if requested == "auto":
            for family in FAMILIES.values():
                if family.detect_single_file(keys):
                    return family
            for key, name in _KNOWN_OTHERS.items():
                if key in keys:
                    raise CheckpointError(f"{source.path}: this is a {name} checkpoint, which this version "
                                          f"of vramfit cannot train (families: {', '.join(FAMILIES)})")
        lora = describe_lora(source.path, FAMILIES.values())  # None: not a LoRA file
        if lora is not None:
            target = lora["for"].split(";")[0].split(", module names")[0]  # "SDXL-family UNet", ...
            raise CheckpointError(f"{source.path}: this is a LoRA file ({lora['format']} format, for "
                                  f"{target}), not a model: give it to `vramfit generate --lora` beside its "
                                  "base model, and train on the base model itself")
        if requested == "auto":
            raise CheckpointError(f"{source.path}: no known model family found in its keys "
                                  f"(first keys: {sorted(keys)[:3]})")
    if requested != "auto":
        return FAMILIES[requested]
    index = json.loads((source.path / "model_index.json").read_text())
    for family in FAMILIES.values():
        if family.detect_diffusers(index):
            return family
    raise CheckpointError(f"{source.path}: pipeline {index.get('_class_name')} is not a family "
                          f"vramfit can train (families: {', '.join(FAMILIES)})")


def named_model_problems(cfg) -> list[str]:
    """Problems with the models a valid RunConfig names, seen before any model file is read: an
    unknown tiny model; image sides the family cannot take where the config names the family (an
    explicit model.family, or a tiny model). The family's other checks run once its file is read
    (Family.config_problems, before any weight loads)."""
    path = cfg.model.path
    if path.startswith("tiny:") and unknown_tiny(path):
        return [f"model.path: {unknown_tiny(path)}"]
    name = cfg.model.family
    if name == "auto" and path.startswith("tiny:"):
        name = TINY_MODELS[path.split(":", 1)[1]]
    if name == "auto":
        return []
    return resolution_problems(FAMILIES[name], cfg)
