"""Pinned (page-locked) CPU memory of the exact size asked for, given back with its last tensor.

torch's pinned memory (`Tensor.pin_memory()`, `pin_memory=True`) comes from its caching host
allocator, which rounds every block up to the next power of two and keeps freed blocks for later
requests instead of returning them to the system. For the buffers a streamed run keeps all run
long (weights' homes, gradient sums and their staging) that costs up to twice the bytes asked for,
and what the fit probe's stand-in pinned stays held through the run beside the run's own. Here
ordinary CPU memory is page-locked in place instead (`cudaHostRegister`, through
`torch.cuda.cudart()`): the bytes asked for, unlocked and freed when the last tensor viewing it
goes. Copies from and to it run asynchronously as from any pinned memory. Off CUDA, or where the
driver refuses to lock more, the memory is plain (copies from it are then synchronous: slower,
still correct).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

PAGE = 4096


class _Locked:
    """Bytes this process holds locked through this module now (the memory report's figure)."""

    nbytes = 0


def locked_bytes() -> int:
    """Bytes of pinned memory made here that are still held."""
    return _Locked.nbytes


def _unlock(ptr: int, nbytes: int, keep: np.ndarray) -> None:
    """Unlock the range at `ptr` before `keep`'s memory is freed: no copy may still use it."""
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(ptr)
    _Locked.nbytes -= nbytes
    del keep


def _register(ptr: int, nbytes: int) -> bool:
    """Page-lock `nbytes` at `ptr`; False where the driver refuses (the error is cleared)."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(error, "value", error)) == 0:
        return True
    clear = getattr(cudart, "cudaGetLastError", None)  # not in every torch build's bindings
    if clear is not None:
        clear()
    return False


def empty(numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` values of `dtype`, page-locked where `pin` and CUDA is there."""
    if not (pin and torch.cuda.is_available()):
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE  # page-aligned: the driver locks whole pages
    region = raw[start:start + nbytes]
    ptr = region.ctypes.data
    if nbytes and _register(ptr, nbytes):
        # the memory outlives every tensor that views it (they hold `region`, `region` holds `raw`);
        # it is unlocked when `raw` goes, before numpy frees it
        _Locked.nbytes += nbytes
        done = weakref.finalize(region, _unlock, ptr, nbytes, raw)
        done.atexit = False
    return torch.from_numpy(region).view(dtype) if nbytes else torch.empty(0, dtype=dtype)


def zeros(numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
    """`empty`, zeroed."""
    return empty(numel, dtype, pin=pin).zero_()


def is_locked(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is page-locked (by this module or torch's allocator)."""
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A page-locked (on CUDA) contiguous copy of the CPU tensor `t`."""
    return empty(t.numel(), t.dtype).view(t.shape).copy_(t)
