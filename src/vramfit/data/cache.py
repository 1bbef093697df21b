"""Content-addressed disk cache of VAE latents and text-encoder outputs.

An entry's key is a digest of everything that determines its value: for latents the image
bytes, the bucket and crop, the VAE's weights fingerprint and dtypes, tiling and the cache
format version; for text the caption, the encoders' fingerprint and the dtype. So a changed
image, caption or setting invalidates exactly the entries it affects, and two runs (or two
datasets) that share inputs share entries. Entries are written atomically (two runs writing
the same entry each rename a complete file into place) and carry a SHA-256 of their tensors and
the key they were written for; an entry that fails to load, to match its checksum or to name its
own key (two files swapped) is deleted and rebuilt rather than trusted, and anything that is not a
file under an entry's name (a folder, say) is named and cleared. Entries written before they
carried their key are taken on their checksum and rewritten with it. Cost: one hash of each
entry's bytes when written and when read (small next to decoding an image).

Temporaries left by killed writers are removed at the next run, in the folders it caches into,
once their writer is gone and they are STALE_AGE old (a writer on another machine sharing the
cache is not visible here; a write takes well under a second).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open

from vramfit.data.fingerprint import digest
from vramfit.formats.safetensors_io import DISK_ERRNOS, clean_stale_temps, save_atomic

CACHE_VERSION = 1
STALE_AGE = 600.0  # seconds
log = logging.getLogger("vramfit.cache")


class CacheWriteError(OSError):
    """The cache could not be written (disk full, read-only, quota); entries written so far stay valid."""

    def __str__(self) -> str:
        return self.strerror


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
        if not _entry_file(path):
            return None
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            if meta.get("vramfit.sha256") != _checksum(tensors):
                raise ValueError("checksum mismatch")
            written_for = meta.get("vramfit.key")
            if written_for is not None and written_for != key:
                raise ValueError(f"it holds the entry written for key {written_for[:16]}..., not this one")
        except Exception as exc:  # a damaged entry is rebuilt, never used
            log.warning("cache entry %s is damaged (%s); it will be rebuilt", path, exc)
            path.unlink(missing_ok=True)
            return None
        if written_for is None:  # written before entries carried their key: add it
            self.put(kind, key, tensors, {k: v for k, v in meta.items() if k not in _OWN_META})
        return tensors

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        meta = {"vramfit.cache_version": str(CACHE_VERSION), "vramfit.sha256": _checksum(tensors),
                "vramfit.key": key, **meta}
        try:
            save_atomic(tensors, self.path(kind, key), meta)
        except OSError as exc:
            if exc.errno in DISK_ERRNOS:
                raise CacheWriteError(exc.errno, f"cannot write the cache in {self.root}: {exc.strerror}. "
                                      "Entries written so far are kept and will be reused; free space "
                                      "or set cache.dir to another disk, then run again") from None
            raise

    def clean_stale(self, kind: str, keys: Iterable[str]) -> list[str]:
        """Remove stale temporaries in the folders that entries of `keys` go to (not the whole cache)."""
        return clean_stale_temps(sorted({self.path(kind, k).parent for k in keys}), min_age=STALE_AGE)


_OWN_META = ("vramfit.cache_version", "vramfit.sha256", "vramfit.key")


def _entry_file(path: Path) -> bool:
    """Whether an entry's file is there to read. Anything else under its name (a folder, a link
    to nowhere, a pipe) is named in a warning and cleared, so the entry is rebuilt."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if not path.is_symlink():
            return False
        mode = None
    except OSError as exc:  # a loop of links, say
        log.warning("cache entry %s cannot be read (%s); it will be rebuilt", path, exc.strerror)
        try:
            path.unlink()
        except OSError:
            pass
        return False
    if mode is not None and stat.S_ISREG(mode):
        return True
    if mode is None:
        what, done = "a link to nowhere", "removed the link"
        path.unlink()
    elif stat.S_ISDIR(mode) and not path.is_symlink():
        what = "a folder"
        try:
            path.rmdir()
            done = "removed it (it was empty)"
        except OSError:
            aside = path.with_name(path.name + ".not-a-cache-entry")
            if os.path.lexists(aside):
                aside = path.with_name(f"{aside.name}-{os.getpid()}")
            path.rename(aside)
            done = f"moved it to {aside.name} (delete it when you no longer need it)"
    else:
        what, done = "not a regular file", "removed it"
        path.unlink()
    log.warning("cache entry %s is %s; %s and the entry will be rebuilt", path, what, done)
    return False


def latent_key(image_digest: str, bucket: tuple[int, int], crop: tuple, vae_identity: str,
               vae_dtype: str, store_dtype: str, tiling: bool) -> str:
    return digest(CACHE_VERSION, "latent", image_digest, tuple(bucket), tuple(crop), vae_identity,
                  vae_dtype, store_dtype, tiling)


def text_key(caption: str, text_identity: str, store_dtype: str) -> str:
    return digest(CACHE_VERSION, "text", caption, text_identity, store_dtype)
