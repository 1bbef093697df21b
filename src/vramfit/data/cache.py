"""Content-addressed disk cache of VAE latents and text-encoder outputs.

An entry's key is a digest of everything that determines its value: for latents the image
bytes, the bucket and crop, the VAE's weights fingerprint and dtypes, tiling and the cache
format version; for text the caption, the encoders' fingerprint and the dtype. So a changed
image, caption or setting invalidates exactly the entries it affects, and two runs (or two
datasets) that share inputs share entries. Entries are written atomically (two runs writing
the same entry each rename a complete file into place) and carry a SHA-256 of their tensors; an
entry that fails to load or to match it is deleted and rebuilt rather than trusted. Cost: one
hash of each entry's bytes when written and when read (small next to decoding an image).
"""
from __future__ import annotations

import errno
import hashlib
import logging
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from vramfit.data.fingerprint import digest
from vramfit.formats.safetensors_io import save_atomic

CACHE_VERSION = 1
log = logging.getLogger("vramfit.cache")


class CacheWriteError(OSError):
    """The cache could not be written (disk full, read-only, quota); entries written so far stay valid."""


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class DiskCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        """True when the entry exists and passes its checksum; a damaged one is deleted."""
        return self.get(kind, key) is not None

    def get(self, kind: str, key: str) -> Optional[dict[str, torch.Tensor]]:
        path = self.path(kind, key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            if meta.get("vramfit.sha256") != _checksum(tensors):
                raise ValueError("checksum mismatch")
            return tensors
        except Exception as exc:  # a damaged entry is rebuilt, never used
            log.warning("cache entry %s is damaged (%s); it will be rebuilt", path, exc)
            path.unlink(missing_ok=True)
            return None

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        meta = {"vramfit.cache_version": str(CACHE_VERSION), "vramfit.sha256": _checksum(tensors), **meta}
        try:
            save_atomic(tensors, self.path(kind, key), meta)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
                raise CacheWriteError(exc.errno, f"cannot write the cache in {self.root}: {exc.strerror}. "
                                      "Entries written so far are kept and will be reused; free space "
                                      "or set cache.dir to another disk, then run again") from None
            raise


def latent_key(image_digest: str, bucket: tuple[int, int], crop: tuple, vae_identity: str,
               vae_dtype: str, store_dtype: str, tiling: bool) -> str:
    return digest(CACHE_VERSION, "latent", image_digest, tuple(bucket), tuple(crop), vae_identity,
                  vae_dtype, store_dtype, tiling)


def text_key(caption: str, text_identity: str, store_dtype: str) -> str:
    return digest(CACHE_VERSION, "text", caption, text_identity, store_dtype)
