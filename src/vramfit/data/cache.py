"""Content-addressed disk cache of VAE latents and text-encoder outputs.

An entry's key is a digest of everything that determines its value: for latents the image
bytes, the bucket and crop, the VAE's weights fingerprint and dtypes, tiling and the cache
format version; for text the caption, the encoders' fingerprint and the dtype. So a changed
image, caption or setting invalidates exactly the entries it affects, and two runs (or two
datasets) that share inputs share entries. Entries are written atomically; an entry that fails
to load is deleted and rebuilt rather than trusted.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from vramfit.data.fingerprint import digest
from vramfit.formats.safetensors_io import CheckpointError, read_header, save_atomic

CACHE_VERSION = 1
log = logging.getLogger("vramfit.cache")


class DiskCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        """True when the entry exists and its file is whole; a damaged one is deleted."""
        path = self.path(kind, key)
        if not path.is_file():
            return False
        try:
            read_header(path)
        except (CheckpointError, OSError, KeyError, TypeError) as exc:
            log.warning("cache entry %s is damaged (%s); it will be rebuilt", path, exc)
            path.unlink(missing_ok=True)
            return False
        return True

    def get(self, kind: str, key: str) -> Optional[dict[str, torch.Tensor]]:
        path = self.path(kind, key)
        if not path.is_file():
            return None
        try:
            return load_file(str(path))
        except Exception as exc:  # a damaged entry is rebuilt, never used
            log.warning("cache entry %s is unreadable (%s); it will be rebuilt", path, exc)
            path.unlink(missing_ok=True)
            return None

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        save_atomic({k: v.contiguous() for k, v in tensors.items()}, self.path(kind, key),
                    {"vramfit.cache_version": str(CACHE_VERSION), **meta})


def latent_key(image_digest: str, bucket: tuple[int, int], crop: tuple, vae_identity: str,
               vae_dtype: str, store_dtype: str, tiling: bool) -> str:
    return digest(CACHE_VERSION, "latent", image_digest, tuple(bucket), tuple(crop), vae_identity,
                  vae_dtype, store_dtype, tiling)


def text_key(caption: str, text_identity: str, store_dtype: str) -> str:
    return digest(CACHE_VERSION, "text", caption, text_identity, store_dtype)
