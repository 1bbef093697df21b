"""Reading and writing .safetensors files safely.

Reads check the header's structure and sizes before any tensor is touched, so a truncated or
foreign file fails with a message naming the file and the bad key instead of a bare parser error.
Writes go to a temporary file in the same folder (`.NAME.tmp-PID`), are fsynced, then renamed over
the target: an interrupted save leaves the previous file intact (rename is atomic on POSIX and
NTFS). Removals rename away first (`.NAME.deleting-PID`), so a kill mid-delete never leaves half a
folder under its final name. Temporaries whose writer is gone are cleaned at the next start
(`clean_stale_temps`). A full disk met by safetensors (its own SafetensorError) is raised as the
OSError it carries, so every caller handles it like any other write error.

A checkpoint is written tensor by tensor (`save_atomic_lazy`): safetensors' own save_file takes
every tensor at once, so a model's whole file (a full fine-tune's denoiser cast to save.dtype, the
text encoders and VAE read from the source) would sit in memory beside the model being saved. The
lazy writer takes each tensor's name, dtype and shape ahead, writes the header the library would
(same order, same JSON, same padding), then asks for each tensor only when its bytes are written.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import struct
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger("vramfit")
# Write errors that mean "no room here" rather than a bug: disk full, quota, file size limit, read-only.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
# `.NAME.tmp-PID`, `.NAME.old-PID`, `.NAME.deleting-PID`: what this module leaves while it works.
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|deleting)-(?P<pid>\d+)$")


class CheckpointError(ValueError):
    """A model file that cannot be read; the message names the file and what to do."""


class OutputWriteError(OSError):
    """An output (checkpoint, training state) could not be written: disk full, quota, read-only.
    The message names what and where, what is kept and what to do."""

    def __str__(self) -> str:
        return self.strerror


# Bits per element of every dtype safetensors knows (sub-byte ones pack several into a byte).
_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64,
         "U32": 32, "U16": 16, "U8": 8, "BOOL": 8, "C64": 64, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8,
         "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# What the lazy writer writes: safetensors' dtype names in the order of its dtype enumeration, which
# orders a file's data (largest first, then by name), and the torch dtypes written under each name.
_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16",
          "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
_WRITE_NAMES = {getattr(torch, t): n for t, n in (
    ("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e8m0fnu", "F8_E8M0"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("int16", "I16"), ("uint16", "U16"), ("float16", "F16"), ("bfloat16", "BF16"), ("int32", "I32"),
    ("uint32", "U32"), ("float32", "F32"), ("complex64", "C64"), ("float64", "F64"), ("int64", "I64"),
    ("uint64", "U64")) if hasattr(torch, t)}


class Lazy(NamedTuple):
    """A tensor to write, known by dtype and shape ahead; `produce()` makes it when its bytes are
    written (and it is let go after)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


def eager(t: torch.Tensor) -> Lazy:
    """A tensor already in memory as a `Lazy` entry."""
    return Lazy(t.dtype, tuple(t.shape), lambda: t)


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
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: malformed safetensors header: __metadata__ is not an object of "
                              "strings; the file is damaged or was not written by a safetensors writer")
    end = _check_tensors(path, header)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes, the header describes {8 + n + end}); "
            "download or copy it again"
        )
    if 8 + n + end < size:
        raise CheckpointError(f"{path}: {size - 8 - n - end} bytes follow the last tensor the header "
                              "describes; the file is damaged: download or copy it again")
    return header, metadata


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tensors(path: Path, header: dict) -> int:
    """Check every tensor entry's structure and that the entries tile the data; returns its length."""
    spans = []
    for key, entry in header.items():
        bad = f"{path}: malformed safetensors header: tensor {key!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{bad} is {json.dumps(entry)[:60]}, not an object with dtype, shape "
                                  "and data_offsets")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise CheckpointError(f"{bad} has no {field}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _BITS:
            raise CheckpointError(f"{bad} has the unknown dtype {json.dumps(dtype)[:40]}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{bad}: shape {json.dumps(shape)[:60]} is not a list of non-negative "
                                  "integers")
        pair = isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)
        if not pair or offsets[0] > offsets[1]:
            raise CheckpointError(f"{bad}: data_offsets {json.dumps(offsets)[:60]} is not two integers "
                                  "[begin, end] with begin <= end")
        need = (math.prod(shape) * _BITS[dtype] + 7) // 8
        if offsets[1] - offsets[0] != need:
            raise CheckpointError(f"{bad}: shape {shape} of {dtype} takes {need} bytes but data_offsets "
                                  f"{offsets} hold {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{path}: malformed safetensors header: tensor {key!r} starts at byte "
                                  f"{begin} of the data, where the previous tensor ends at {end} (tensors "
                                  "must follow each other without gaps or overlaps)")
        end = stop
    return end


def meta_tensors(header: dict[str, dict], prefix: str = "") -> dict[str, torch.Tensor]:
    """Shape-only stand-ins for the tensors under `prefix` (prefix stripped), for layout detection."""
    return {
        k[len(prefix):]: torch.empty(v["shape"], dtype=_DTYPES.get(v["dtype"], torch.float32), device="meta")
        for k, v in header.items()
        if k.startswith(prefix)
    }


def load_prefixed(path: Path, prefix: str, dtype: torch.dtype | None = None,
                  exclude: str | None = None) -> dict[str, torch.Tensor]:
    """Load the tensors whose key starts with `prefix` (and not with `exclude`), prefix stripped.
    Each tensor is read into memory of its own and converted to `dtype` before the next is read,
    with plain reads rather than a memory map: a mapped file's pages count in the process's
    resident memory until it is closed, a second copy of everything read beside the tensors
    (`read_tensors`)."""
    out = {}
    def wanted(key: str) -> bool:
        return key.startswith(prefix) and not (exclude and key.startswith(exclude))

    for key, t in read_tensors(path, wanted):
        out[key[len(prefix):]] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def read_tensors(path: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of each tensor of the file whose key `wanted` takes, in file order, each read
    with plain reads into a tensor of its own (no memory map: host memory holds what the caller
    keeps and one tensor being read). The header is checked first (`read_header`). Dtypes torch
    has no plain type for, and big-endian machines, are read through safetensors' own reader."""
    path = Path(path)
    header, _ = read_header(path)
    keys = sorted((k for k in header if wanted(k)), key=lambda k: header[k]["data_offsets"][0])
    if sys.byteorder != "little" or any(header[k]["dtype"] not in _DTYPES for k in keys):
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for key in keys:
                yield key, fh.get_tensor(key)
        return
    with open(path, "rb") as fh:
        start = 8 + struct.unpack("<Q", fh.read(8))[0]
        for key in keys:
            yield key, _read_one(fh, start, path, key, header[key])


def _read_one(fh: IO[bytes], start: int, path: Path, key: str, entry: dict) -> torch.Tensor:
    """The tensor `entry` of a checked header describes, read from `fh` (data from byte `start`)."""
    begin, end = entry["data_offsets"]
    raw = torch.empty(end - begin, dtype=torch.uint8)
    fh.seek(start + begin)
    view, done = memoryview(raw.numpy()), 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            raise CheckpointError(f"{path}: truncated while reading tensor {key!r}; download or copy it again")
        done += got
    return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def file_tensors(path: Path, wanted: Callable[[str], bool]) -> dict[str, Lazy]:
    """{key: Lazy} of the tensors of a file whose key `wanted` takes, each read from the file (plain
    reads, as `read_tensors`) only when it is written: a file's parts carried over into a saved
    one without holding them all. The header is checked now; the file must stay until the write."""
    path = Path(path)
    header, _ = read_header(path)

    def reader(key: str) -> Callable[[], torch.Tensor]:
        entry = header[key]
        if sys.byteorder != "little" or entry["dtype"] not in _DTYPES:
            return lambda: dict(read_tensors(path, lambda k: k == key))[key]

        def read() -> torch.Tensor:
            with open(path, "rb") as fh:
                return _read_one(fh, 8 + struct.unpack("<Q", fh.read(8))[0], path, key, entry)
        return read

    out = {}
    for key, entry in header.items():
        if wanted(key):
            if entry["dtype"] not in _DTYPES and entry["dtype"] not in _WRITE_NAMES.values():
                raise CheckpointError(f"{path}: tensor {key!r} is stored as {entry['dtype']}, which cannot be "
                                      "carried into a saved file; convert the file to a supported dtype")
            dtype = _DTYPES.get(entry["dtype"]) or next(t for t, n in _WRITE_NAMES.items() if n == entry["dtype"])
            out[key] = Lazy(dtype, tuple(entry["shape"]), reader(key))
    return out


def os_error_of(exc: BaseException, path: Optional[Path] = None) -> Optional[OSError]:
    """The OSError a safetensors error reports ("... No space left on device (os error 28)"), or None."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), *([str(path)] if path is not None else []))


@contextmanager
def os_errors(path: Optional[Path] = None) -> Iterator[None]:
    """Raise a SafetensorError that carries an OS error (disk full, say) as that OSError."""
    try:
        yield
    except SafetensorError as exc:
        err = os_error_of(exc, path)
        if err is None:
            raise
        raise err from None


def temp_path(path: Path) -> Path:
    """The temporary sibling a write of `path` goes to before it is renamed into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def save_atomic(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file so that the target is either the old file or the complete new one."""
    path = Path(path)
    with _replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """The temporary path a write of `path` fills inside the block (a full disk named for `path`);
    after it, made the file atomically (mode, rename, the folder synced); removed on any error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with _no_room_names(path):
            yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_atomic_lazy(entries: Mapping[str, Lazy], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file tensor by tensor, atomically as `save_atomic`: the bytes are those
    safetensors' save_file writes for the produced tensors (metadata keys sorted, where the library
    leaves them in hash order), while memory holds one produced tensor at a time."""
    path = Path(path)
    if sys.byteorder != "little":  # the library swaps bytes on the way out: let it, with everything at once
        save_atomic({k: e.produce() for k, e in entries.items()}, path, metadata)
        return
    names = {}
    for key, entry in entries.items():
        if entry.dtype not in _WRITE_NAMES:
            raise ValueError(f"tensor {key!r}: safetensors has no dtype for {entry.dtype}")
        names[key] = _WRITE_NAMES[entry.dtype]
    rank = {n: i for i, n in enumerate(_ORDER)}
    order = sorted(entries, key=lambda k: (-rank[names[k]], k))
    header: dict = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for key in order:
        shape = [int(d) for d in entries[key].shape]
        size = math.prod(shape) * entries[key].dtype.itemsize
        header[key] = {"dtype": names[key], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with _replacing(path) as tmp, open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for key in order:
            _write_tensor(fh, key, entries[key])
        fh.flush()
        os.fsync(fh.fileno())


def _write_tensor(fh: IO[bytes], key: str, entry: Lazy) -> None:
    """Produce one tensor, check it is what the header said, write its bytes; nothing is kept."""
    t = entry.produce().detach()
    if t.dtype != entry.dtype or tuple(t.shape) != tuple(entry.shape):
        raise ValueError(f"tensor {key!r} was announced as {entry.dtype} {tuple(entry.shape)} but produced as "
                         f"{t.dtype} {tuple(t.shape)}")
    if t.numel():
        fh.write(memoryview(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))


@contextmanager
def _no_room_names(path: Path) -> Iterator[None]:
    """A write that finds no room (disk full, quota, read-only) raises an OSError naming `path`,
    the file being written, rather than its temporary or nothing."""
    try:
        with os_errors():
            yield
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS or type(exc) is not OSError:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: Path, mode: str = "wb", **open_args) -> Iterator[IO]:
    """A file to write `path` through: its temporary sibling, fsynced and renamed over `path` when
    the block ends without error, removed otherwise, so the target is the old file or the whole new
    one. A full or read-only disk is an OSError naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with _no_room_names(path), open(tmp, mode, **open_args) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file so that the target is either the old file or the complete new one."""
    with atomic_file(path, "w", encoding="utf-8") as fh:
        fh.write(text)


@contextmanager
def writing(what: str, folder: Path, kept: Callable[[], str]) -> Iterator[None]:
    """Writes of `what` into `folder`: a full or read-only disk becomes an OutputWriteError saying
    where and (`kept()`) what is kept and what to do; this process's temporaries there are removed."""
    try:
        with os_errors():
            yield
    except OutputWriteError:
        raise
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        clean_temps(folder, own=True)
        message = f"cannot write {what} in {folder}: {exc.strerror}. {kept()}"
        raise OutputWriteError(exc.errno, message) from None


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
    tmp = temp_path(folder)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_folder(tmp: Path, folder: Path) -> None:
    """Put a completed temporary folder in place of `folder`; the old one goes only after (a kill in
    between leaves `.NAME.old-PID`, which the next start's `clean_stale_temps` puts back)."""
    folder = Path(folder)
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        _remove(old)
        folder.rename(old)
    tmp.rename(folder)
    _fsync_dir(folder.parent)
    _remove(old)


def save_model_folder(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """A diffusers model subfolder (config.json + weights) with the weights cast to `dtype`, written
    a tensor at a time (`save_atomic_lazy`: each cast on the CPU as it is written, from the weight
    where it lives), so no copy of the whole model is made."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)

    def cast(t: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: t.detach().to("cpu", dtype)

    save_atomic_lazy({k: Lazy(dtype, tuple(v.shape), cast(v)) for k, v in model.state_dict().items()},
                     folder / "diffusion_pytorch_model.safetensors")


def discard(path: Path) -> None:
    """Delete a file or folder so that no part of it stays under its name: rename it away to
    `.NAME.deleting-PID` first (atomic), then delete that (a kill mid-delete leaves only the
    hidden name, which `clean_stale_temps` removes)."""
    path = Path(path)
    away = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    _remove(away)
    path.rename(away)
    _remove(away)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _alive(pid: int) -> bool:
    """Whether a process with this id runs (one we may not signal runs too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError, OSError):
        return False
    return True


def clean_temps(folder: Path, own: bool = False, min_age: float = 0.0) -> list[str]:
    """Remove the temporaries in `folder` (not below it) whose writer is gone, or with `own` this
    process's. A `.NAME.old-PID` whose NAME is missing is the only copy (a kill during a folder
    swap) and is renamed back instead. `min_age` (seconds since the last change) spares a writer
    on another machine sharing the folder. Returns what was done, one phrase per entry."""
    folder = Path(folder)
    done: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:  # no folder (yet), or unreadable: nothing to clean
        return done
    now = time.time()
    for entry in entries:
        found = _TEMP.match(entry.name)
        if found is None:
            continue
        pid = int(found.group("pid"))
        if (pid == os.getpid()) != own or (not own and _alive(pid)):
            continue
        path = Path(entry.path)
        try:
            if min_age and now - entry.stat(follow_symlinks=False).st_mtime < min_age:
                continue
            final = folder / found.group("name")
            if found.group("kind") == "old" and not os.path.lexists(final):
                path.rename(final)
                done.append(f"{entry.name} (put back as {final.name})")
            else:
                _remove(path)
                done.append(entry.name)
        except FileNotFoundError:  # another process cleaned it first
            continue
    return done


def clean_stale_temps(folders: Iterable[Path], min_age: float = 0.0) -> list[str]:
    """`clean_temps` over `folders`, with one log line per folder that had any."""
    removed = []
    for folder in folders:
        done = clean_temps(folder, min_age=min_age)
        if done:
            shown = ", ".join(done[:8]) + (f" and {len(done) - 8} more" if len(done) > 8 else "")
            log.info("cleaned up %d temporary file(s) left in %s by stopped runs: %s", len(done), folder,
                     shown)
        removed += done
    return removed
