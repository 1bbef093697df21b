"""Resolve what the user wrote in model.path to a local Source.

Accepted: a single-file .safetensors (SGM/LDM layout, as ComfyUI and A1111 use), a diffusers
folder (with model_index.json), a Hugging Face repo id (fetched with the user's usual login
when online, taken from the local Hugging Face cache when offline), or tiny:<name>.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from vramfit.config.load import default_cache_root
from vramfit.config.schema import ModelConfig
from vramfit.data.fingerprint import file_digest
from vramfit.formats.safetensors_io import commit_folder, save_atomic, temp_path
from vramfit.models.adapter import Source
from vramfit.models.registry import materialize_tiny, unknown_tiny

# Files of a diffusers SDXL repo that training needs; weights in safetensors only.
_REPO_PATTERNS = ["model_index.json", "*/config.json", "*/*.safetensors", "*.safetensors",
                  "tokenizer*/*", "scheduler/*"]
# what a repo id needs without its weights (`vramfit data`: the tokenizers and the folder's layout)
_LIGHT_PATTERNS = [p for p in _REPO_PATTERNS if not p.endswith(".safetensors")]
SDXL_TOKENIZER_REPO = "stabilityai/stable-diffusion-xl-base-1.0"


PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


class SourceError(ValueError):
    """A model.path that cannot be turned into a model; the message says what to provide."""


def resolve_source(cfg: ModelConfig, cache_root: Optional[Path] = None, weights: bool = True) -> Source:
    """Where the model of `cfg` is, local paths resolved. `weights=False`: a Hugging Face repo id is
    fetched without its weights (configs and tokenizers only), for what needs no weights."""
    source = _resolve(cfg, cache_root, weights)
    files = tuple((part, Path(getattr(cfg, part)).expanduser()) for part in ENCODER_PARTS
                  if getattr(cfg, part, None))
    return dataclasses.replace(source, encoder_files=files) if files else source


ENCODER_PARTS = ("vae", "clip_l", "clip_g", "t5")  # parts given as files of their own


def _resolve(cfg: ModelConfig, cache_root: Optional[Path] = None, weights: bool = True) -> Source:
    text = cfg.path
    cache_root = cache_root or default_cache_root()
    tokenizers = Path(cfg.tokenizers).expanduser() if cfg.tokenizers else None
    if text.startswith("tiny:"):
        if unknown_tiny(text):
            raise SourceError(f"model.path: {unknown_tiny(text)}")
        path = materialize_tiny(text, cache_root / "tiny")
        return Source("single_file", path, tokenizers or path.parent, label=text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
        converted = convert_pickle(path, cache_root / "converted", cfg.allow_pickle)
        return Source("single_file", converted, tokenizers or find_tokenizers(path), label=text)
    if path.is_file():
        return Source("single_file", path, tokenizers or find_tokenizers(path), label=text)
    if path.is_dir():
        return _from_folder(path, tokenizers, text)
    if path.exists() or text.count("/") != 1:
        raise SourceError(f"model.path: {text} is not a file, a folder or a repo id (org/name)")
    return _from_hub(text, cfg.revision, tokenizers, _REPO_PATTERNS if weights else _LIGHT_PATTERNS)


def _from_folder(path: Path, tokenizers: Optional[Path], label: str) -> Source:
    if (path / "model_index.json").is_file():
        return Source("diffusers", path, tokenizers or path, label=label)
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        return Source("single_file", files[0], tokenizers or find_tokenizers(files[0]), label=label)
    raise SourceError(
        f"model.path: {path} is a folder without model_index.json "
        f"({len(files)} .safetensors files in it); give a diffusers folder or one .safetensors file"
    )


def _from_hub(repo_id: str, revision: Optional[str], tokenizers: Optional[Path],
              patterns: list[str] = _REPO_PATTERNS) -> Source:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                        local_files_only=offline))
    except LocalEntryNotFoundError:
        if offline:
            raise SourceError(
                f"model.path: {repo_id} is not in the local Hugging Face cache and the hub is "
                "offline (HF_HUB_OFFLINE=1); download it where there is network "
                f"(`hf download {repo_id}`) or set model.path to a local file or folder"
            ) from None
        folder = _cached_or_fail(repo_id, revision, patterns)
    except Exception as exc:  # network errors come in many classes; fall back to the cache
        if type(exc).__name__ in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            raise SourceError(f"model.path: {repo_id}: {exc}") from None
        folder = _cached_or_fail(repo_id, revision, patterns)
    if (folder / "model_index.json").is_file():
        return Source("diffusers", folder, tokenizers or folder, label=repo_id)
    return _from_folder(folder, tokenizers, repo_id)


def _cached_or_fail(repo_id: str, revision: Optional[str], patterns: list[str] = _REPO_PATTERNS) -> Path:
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        raise SourceError(
            f"model.path: {repo_id} could not be fetched (no network?) and is not in the local "
            "Hugging Face cache; set model.path to a local file or folder"
        ) from None


def find_tokenizers(checkpoint: Path) -> Optional[Path]:
    """A folder holding tokenizer/ and tokenizer_2/ for a single file, or None.

    Looked for in <folder>/<file stem>/, then beside the file, then in the local Hugging Face
    cache of the SDXL base repo (tokenizers are the same for every SDXL-family checkpoint).
    Never downloads.
    """
    for folder in (checkpoint.parent / checkpoint.stem, checkpoint.parent):  # the file's own first
        if (folder / "tokenizer").is_dir() and (folder / "tokenizer_2").is_dir():
            return folder
    try:
        cached = Path(snapshot_download(SDXL_TOKENIZER_REPO, allow_patterns=["tokenizer*/*"],
                                        local_files_only=True))
        if (cached / "tokenizer").is_dir() and (cached / "tokenizer_2").is_dir():
            return cached
    except Exception:  # not cached: the loader reports what to provide
        pass
    return None


TOKENIZER_FOLDERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


def write_tokenizers(source: Source, tokenizers: Sequence, checkpoint: Path) -> Path:
    """Put the model's tokenizers where find_tokenizers looks for those of the single file
    `checkpoint`, so that vramfit's commands load the file with no tokenizer setting.

    Copies of the source's tokenizer/, tokenizer_2/ and tokenizer_3/ (the loaded `tokenizers`
    saved, where the source has no such folder) go beside the file, where one copy serves every
    checkpoint of the folder. Where the folder holds different ones (another model's), or the
    file has its own <stem>/ folder already, they go into <folder>/<stem>/, which is read first.
    Returns the folder that holds them.
    """
    folder = Path(checkpoint).parent
    own = folder / Path(checkpoint).stem
    staged: dict[str, Path] = {}  # sub-folder -> its copy, written as `.NAME.tmp-PID` beside the file
    try:
        for i, sub in enumerate(TOKENIZER_FOLDERS):
            copy = source.tokenizers / sub if source.tokenizers is not None else None
            if (copy is None or not copy.is_dir()) and i >= len(tokenizers):
                continue
            staged[sub] = tmp = temp_path(folder / sub)
            shutil.rmtree(tmp, ignore_errors=True)
            if copy is not None and copy.is_dir():
                shutil.copytree(copy, tmp)  # follows the links of a Hugging Face cache
            else:
                tokenizers[i].save_pretrained(tmp)
        shared_fits = all(not (folder / s).exists() or _same_files(t, folder / s) for s, t in staged.items())
        target = own if (own / "tokenizer").is_dir() or not shared_fits else folder
        target.mkdir(parents=True, exist_ok=True)
        for sub, tmp in staged.items():
            if not _same_files(tmp, target / sub):
                commit_folder(tmp, target / sub)
    finally:
        for tmp in staged.values():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _same_files(a: Path, b: Path) -> bool:
    """Whether folders `a` and `b` hold the same files with the same bytes."""
    if not b.is_dir():
        return False
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    other = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    return files == other and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def convert_pickle(path: Path, folder: Path, allowed: bool) -> Path:
    """A pickle checkpoint, read with torch.load(weights_only=True), as a cached .safetensors.

    Refused unless model.allow_pickle is set: weights_only blocks code execution in current
    torch, but the file stays a pickle that other tools may load unsafely, so it is opt-in.
    """
    if not allowed:
        raise SourceError(
            f"model.path: {path} is a pickle checkpoint; pickle files can run code when loaded. "
            "Convert it to .safetensors, or set model.allow_pickle=true to read it with "
            "torch.load(weights_only=True)")

    target = folder / f"{path.stem}-{file_digest(path)[:16]}.safetensors"
    if target.is_file():
        return target
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SourceError(f"model.path: {path} could not be read as a weights-only pickle ({exc})") from None
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SourceError(f"model.path: {path} holds no tensor state dict")
    save_atomic({k: v.contiguous() for k, v in state.items()}, target, {"vramfit.converted_from": path.name})
    return target
