"""Pinned (page-locked) CPU memory of the exact size asked for, given back with its last tensor.

torch's pinned memory (`Tensor.pin_memory()`, `pin_memory=True`) comes from its caching host
allocator, which rounds every block up to the next power of two and keeps freed blocks for later
requests instead of returning them to the system. For the buffers a streamed run keeps all run
long (weights' homes, gradient sums and their staging) that costs up to twice the bytes asked for,
and what the fit probe's stand-in pinned stays held through the run beside the run's own. Here
ordinary CPU memory is page-locked in place instead (`cudaHostRegister`, through
`torch.cuda.cudart()`, on the run's device): the bytes asked for, unlocked and freed once the
last tensor viewing it is gone and the device has finished with it. Copies from and to it run
asynchronously as from any pinned memory.

Where the driver refuses to lock more, the block comes from torch's allocator instead (a warning
says so; torch binds no `cudaGetLastError`, so the refusal's pending error is consumed by a
checked launch, or the next kernel would report it). Off CUDA the memory is plain.

A block is unlocked where it is safe: on the main thread outside a CUDA graph's capture, after
its device's work is done; a block let go elsewhere (a garbage collection on another thread, or
during a capture) waits in a list that the next allocation here, or `release_deferred`, empties.
"""
from __future__ import annotations

import logging
import mmap
import sys
import threading
import weakref
from typing import Optional

import numpy as np
import torch

log = logging.getLogger("vramfit")

PAGE = mmap.PAGESIZE
PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, as torch's own blocks are


class _Locked:
    """Bytes held locked through this module now, and the blocks waiting to be unlocked."""

    lock = threading.Lock()
    nbytes = 0
    deferred: list[tuple[int, int, int, np.ndarray]] = []  # (pointer, bytes, device, memory)
    warned = False


def locked_bytes() -> int:
    """Bytes of pinned memory made here that are still held."""
    return _Locked.nbytes


def _safe_here() -> bool:
    return threading.current_thread() is threading.main_thread() and not torch.cuda.is_current_stream_capturing()


def _unlock_now(ptr: int, nbytes: int, device: int, keep: np.ndarray) -> None:
    """Wait for `device` (no copy may still use the block), unlock it; `keep` then goes."""
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda.cudart().cudaHostUnregister(ptr)
    with _Locked.lock:
        _Locked.nbytes -= nbytes
    del keep


def _unlock(ptr: int, nbytes: int, device: int, keep: np.ndarray) -> None:
    """The finalizer of a block's last view: unlocked now where that is safe, else deferred (at the
    interpreter's exit nothing: the process gives its memory back, and CUDA may be gone already)."""
    if sys.is_finalizing():
        return
    if _safe_here():
        _unlock_now(ptr, nbytes, device, keep)
    else:
        with _Locked.lock:
            _Locked.deferred.append((ptr, nbytes, device, keep))


def release_deferred() -> None:
    """Unlock and free the blocks let go of where that was not safe (no-op where it still is not)."""
    if not _Locked.deferred or not _safe_here():
        return
    with _Locked.lock:
        waiting, _Locked.deferred = _Locked.deferred, []
    for block in waiting:
        _unlock_now(*block)


def _drain_error(device: int) -> None:
    """Consume the runtime's pending error left by a refused registration: a checked launch reads
    it (cudaGetLastError) and raises it, swallowed here."""
    try:
        torch.empty(1, device=torch.device("cuda", device)).zero_()
    except RuntimeError:
        pass


def _register(ptr: int, nbytes: int, device: int) -> bool:
    """Page-lock `nbytes` at `ptr` in `device`'s context; False where the driver refuses."""
    with torch.cuda.device(device):
        error = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, PORTABLE)
    if int(getattr(error, "value", error)) == 0:
        return True
    _drain_error(device)
    return False


def _device_index(device: Optional[torch.device]) -> int:
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def empty(numel: int, dtype: torch.dtype, *, pin: bool = True, device: Optional[torch.device] = None) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` values of `dtype`; page-locked where `pin` and CUDA is there,
    for copies to and from `device` (a CUDA device; None: the current one)."""
    if not (pin and torch.cuda.is_available()):
        return torch.empty(numel, dtype=dtype)
    release_deferred()
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    index = _device_index(device)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE  # page-aligned: the driver locks whole pages, none shared
    region = raw[start:start + nbytes]
    ptr = region.ctypes.data
    if not _register(ptr, nbytes, index):
        if not _Locked.warned:
            _Locked.warned = True
            log.warning("the CUDA driver refused to lock %.1f MiB of host memory in place; pinned buffers "
                        "come from torch's allocator from here on (rounded up to powers of two)", nbytes / 2**20)
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    with _Locked.lock:
        _Locked.nbytes += nbytes
    # the memory outlives every tensor viewing it (they hold `region`, `region` holds `raw`); it is
    # unlocked once `region` goes, before numpy frees `raw`
    done = weakref.finalize(region, _unlock, ptr, nbytes, index, raw)
    done.atexit = False
    return torch.from_numpy(region).view(dtype)


def zeros(numel: int, dtype: torch.dtype, *, pin: bool = True, device: Optional[torch.device] = None) -> torch.Tensor:
    """`empty`, zeroed."""
    return empty(numel, dtype, pin=pin, device=device).zero_()


def copy_of(t: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """A page-locked (on CUDA) contiguous copy of the CPU tensor `t`, for copies to `device`."""
    return empty(t.numel(), t.dtype, device=device).view(t.shape).copy_(t)
