"""Reading and writing .safetensors files safely.

Reads check the header before any tensor is touched, so a truncated or foreign file fails with a
message naming the file instead of a bare parser error. Writes go to a temporary file in the
same folder, are fsynced, then renamed over the target: an interrupted save leaves the previous
file intact (rename is atomic on POSIX and NTFS).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class CheckpointError(ValueError):
    """A model file that cannot be read; the message names the file and what to do."""


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_header(path: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Return ({key: {"dtype", "shape", "data_offsets"}}, metadata) after checking the file."""
    path = Path(path)
    if path.suffix in (".ckpt", ".pt", ".pth", ".bin"):
        raise CheckpointError(
            f"{path}: pickle checkpoints are not loaded (they can run code); convert it to "
            ".safetensors, or set model.allow_pickle=true to read it with weights_only"
        )
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000 or 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file or truncated (bad header length)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: malformed safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes, the header describes {8 + n + end}); "
            "download or copy it again"
        )
    return header, metadata


def meta_tensors(header: dict[str, dict], prefix: str = "") -> dict[str, torch.Tensor]:
    """Shape-only stand-ins for the tensors under `prefix` (prefix stripped), for layout detection."""
    return {
        k[len(prefix):]: torch.empty(v["shape"], dtype=_DTYPES.get(v["dtype"], torch.float32), device="meta")
        for k, v in header.items()
        if k.startswith(prefix)
    }


def load_prefixed(path: Path, prefix: str, dtype: torch.dtype | None = None,
                  exclude: str | None = None) -> dict[str, torch.Tensor]:
    """Load the tensors whose key starts with `prefix` (and not with `exclude`), prefix stripped."""
    out = {}
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        for key in fh.keys():
            if key.startswith(prefix) and not (exclude and key.startswith(exclude)):
                t = fh.get_tensor(key)
                out[key[len(prefix):]] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def save_atomic(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file so that the target is either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def begin_folder(folder: Path) -> Path:
    """A fresh temporary sibling of `folder` to write a multi-file save into."""
    import shutil

    tmp = Path(folder).with_name(f".{Path(folder).name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_folder(tmp: Path, folder: Path) -> None:
    """Put a completed temporary folder in place of `folder`; the old one goes only after."""
    import shutil

    folder = Path(folder)
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        shutil.rmtree(old)


def save_model_folder(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """A diffusers model subfolder (config.json + weights) with the weights cast to `dtype`."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    save_atomic({k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()},
                folder / "diffusion_pytorch_model.safetensors")
