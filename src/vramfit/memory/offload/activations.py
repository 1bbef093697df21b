"""Activation offload (`offload_activations`): tensors saved for backward wait in pinned CPU memory.

Every tensor saved for backward in the denoiser's forward that is not a weight (under gradient
checkpointing that is the checkpointed blocks' inputs) is copied to pinned CPU memory and back
when backward needs it, both on the compute stream; a tensor saved by several ops is copied once.
The pinned buffers are kept from step to step (each save takes the smallest free one it fits), so
a step allocates no pinned memory after the first and a CUDA graph can record the copies
(`host_buffer`). The streamer's saved-tensor hooks hand this part what is not a weight.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from vramfit.memory import pinned
from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.offload.units import StreamStats


@dataclass(eq=False)
class Offloaded:
    host: torch.Tensor
    device: torch.device


@dataclass(eq=False)
class HostBuffer:
    """Pinned CPU memory that saved tensors are offloaded into, kept while training (`host_buffer`)."""

    data: torch.Tensor  # flat
    busy: bool = False  # a saved tensor that autograd still holds lives in it


def _set_free(buffer: HostBuffer) -> None:
    buffer.busy = False


class ActivationOffload:
    """Packs saved tensors of the compute device into kept pinned buffers and unpacks them back;
    counts the ones it keeps on the device (`enabled` off, or another device) in `stats`."""

    def __init__(self, device: torch.device, *, enabled: bool, stats: StreamStats):
        self.device, self.enabled, self.stats = device, enabled, stats
        self.cuda = device.type == "cuda"
        self.saved: dict[tuple, tuple] = {}  # a forward's saves: (weak ref to the tensor, its Offloaded)
        self.buffers: list[HostBuffer] = []  # where saved tensors are offloaded to, kept
        self.recording = False  # inside a CUDA graph's recording (train/graphs.py): no pinned memory made

    def pack(self, t: torch.Tensor, ptr: int,
             host_buffer: Optional[Callable[[torch.dtype, int], HostBuffer]] = None):
        """`t` (whose storage starts at `ptr`) as saved for backward: offloaded, or itself.
        `host_buffer` chooses the buffer (`self.host_buffer` unless the owner routes it)."""
        if not self.enabled or t.device != self.device:
            self.stats.kept_bytes += tensor_bytes(t)
            return t
        return self._offload(t, ptr, host_buffer or self.host_buffer)

    def _offload(self, t: torch.Tensor, ptr: int, host_buffer) -> Offloaded:
        key = (ptr, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype, t._version)
        hit = self.saved.get(key)
        if hit is not None and hit[0]() is not None:
            return hit[1]
        buffer = host_buffer(t.dtype, t.numel())
        host = buffer.data[:t.numel()].view(t.size())
        host.copy_(t, non_blocking=self.cuda)  # on the compute stream: ordered before any reuse of t
        packed = Offloaded(host, t.device)
        buffer.busy = True
        weakref.finalize(packed, _set_free, buffer)  # autograd let go of it: its backward is done
        self.saved[key] = (weakref.ref(t), packed)
        self.stats.offloaded_bytes += tensor_bytes(host)
        return packed

    def host_buffer(self, dtype: torch.dtype, numel: int) -> HostBuffer:
        """A kept pinned buffer of `dtype` with room for `numel` values that no saved tensor lives in:
        the smallest, the first made of those; else a new one. Kept rather than the pinned allocator's
        per tensor: the same saves come in the same order every step, so a step finds its buffers
        free and in the same places, which is what lets a CUDA graph record the copies (train/graphs.py:
        a replay copies to the addresses the recording saw). A buffer is written in forward and read
        in backward on the compute stream, so its next step's write is ordered after that read."""
        free = [b for b in self.buffers if not b.busy and b.data.dtype == dtype and b.data.numel() >= numel]
        if free:
            return min(free, key=lambda b: b.data.numel())  # min keeps the first of equals
        if self.recording:
            # pinned memory is not made while CUDA records; an eager call of this signature comes first
            # (train/graphs.py), so this is a save that call did not make
            raise RuntimeError(f"offloaded activations: a {dtype} tensor of {numel} values saved only "
                               "while recording has no pinned buffer")
        buffer = HostBuffer(pinned.empty(numel, dtype, pin=self.cuda, device=self.device))
        self.buffers.append(buffer)
        return buffer

    def unpack(self, packed):
        """What `pack` made, back on its device."""
        if isinstance(packed, Offloaded):
            return packed.host.to(packed.device, non_blocking=self.cuda)
        return packed

    def forward_done(self) -> None:
        """Forget the forward's saves (a tensor saved again in the next forward is copied again)."""
        self.saved.clear()

    def clear(self) -> None:
        """Let the pinned buffers go (the next save makes new ones)."""
        self.buffers.clear()

    def host_bytes(self) -> int:
        """Bytes of the pinned buffers that saved tensors are offloaded into."""
        return sum(tensor_bytes(b.data) for b in self.buffers)
