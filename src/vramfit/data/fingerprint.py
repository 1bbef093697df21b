"""Content fingerprints for cache keys: of files, of captions, of encoder weights."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def module_fingerprint(module: torch.nn.Module, sample: int = 4096) -> str:
    """A digest of a module's parameter names, shapes, dtypes and a strided sample of values.

    Reading every weight of bigG (700 M values) for a cache key would cost seconds; a strided
    sample of each tensor changes with any real fine-tune or conversion while staying cheap.
    """
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        h.update(flat[::step][:sample].to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()[:32]


def digest(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return h.hexdigest()
