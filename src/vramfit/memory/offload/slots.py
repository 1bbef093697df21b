"""The slot pool: device buffers (one per dtype) that streamed units are copied into, kept.

A slot is reused once no unit holds it and autograd keeps nothing of it (a checkpointed block's
recomputed weights, until its backward is done; a block split into several units holds all of
them then); the smallest free slot the unit fits in is taken, else one of the unit's size is
made, and slots are kept until `clear`. Kept rather than the allocator's memory: the same calls
come in the same order every step, so the copies go to the same places every step, which is what
lets a CUDA graph record a streamed step (train/graphs.py). Which units hold which slot is the
streamer's knowledge: it hands the held slots to `take`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from vramfit.memory.accounting import tensor_bytes


@dataclass(eq=False)  # one slot is itself, not any slot of equal contents
class Slot:
    """Device buffers (one per dtype) that units are copied into; kept for the pool's life."""

    buffers: dict[torch.dtype, torch.Tensor]
    released: int = -1  # when its last unit let go of it (the pool's count of releases)
    read_home: Optional[object] = None  # CUDA event: the copies home of new values out of it are done


def layout(tensors: list[torch.Tensor]) -> dict[torch.dtype, int]:
    """Elements of `tensors` by dtype."""
    found: dict[torch.dtype, int] = {}
    for t in tensors:
        found[t.dtype] = found.get(t.dtype, 0) + t.numel()
    return found


def use_count(t: torch.Tensor) -> int:
    """How many tensors share `t`'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class SlotPool:
    """The slots of one device: `take` one for a unit, `release` it when the unit lets go."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.capacity = capacity  # units held at once by the streamer
        self.slots: list[Slot] = []  # made as needed, kept
        self.releases = 0  # slots let go of so far (orders `Slot.released`)
        self._alone: Optional[int] = None  # the use count of a buffer that nothing else shares

    def take(self, need: dict[torch.dtype, int], held: Iterable[Slot]) -> Slot:
        """Device buffers of at least `need` elements per dtype that no unit holds (`held`: the
        slots units hold now) and nothing else reads (autograd keeps a checkpointed block's
        recomputed weights until its backward is done, all of the block's units when it spans
        several): the smallest such kept slot, else a new one of exactly `need`. Kept buffers rather
        than the allocator's: a CUDA graph recording a streamed step (train/graphs.py) bakes in where
        each copy goes, and memory freed during a recording after another stream used it is memory
        the allocator reuses only after the recording ends. Of the smallest free slots the one let go
        of longest ago is taken; where that is the one just let go of, whose stepped values are still
        being copied home, and no more than `capacity` slots exist, a new one is made instead, so
        that the copy in does not wait for that copy out (the backward of a streamed step on the
        device: copies both ways at once)."""
        held = {id(slot) for slot in held}  # fetched, or kept for gradients
        free = [slot for slot in self.slots
                if id(slot) not in held
                and all(d in slot.buffers and slot.buffers[d].numel() >= n for d, n in need.items())
                and all(use_count(b) == self._alone for b in slot.buffers.values())]
        if free:
            best = min(free, key=lambda slot: (sum(tensor_bytes(b) for b in slot.buffers.values()),
                                               slot.released))
            copying_home = best.read_home is not None and best.released == self.releases - 1
            if not (copying_home and len(self.slots) <= self.capacity):
                return best
        slot = Slot({dtype: torch.empty(n, dtype=dtype, device=self.device) for dtype, n in need.items()})
        self._alone = use_count(next(iter(slot.buffers.values())))  # what a buffer nothing else shares counts
        self.slots.append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """`slot` is no longer its unit's (`take` takes it once nothing else reads it)."""
        slot.released = self.releases
        self.releases += 1

    def forget_events(self) -> None:
        """Drop the slots' CUDA events (those made inside a graph's recording belong to it)."""
        for slot in self.slots:
            slot.read_home = None

    def clear(self) -> None:
        """Let every slot go (the next `take` makes new ones)."""
        self.slots.clear()

    def nbytes(self) -> int:
        """Bytes of the kept slots."""
        return sum(tensor_bytes(b) for slot in self.slots for b in slot.buffers.values())
