"""What is streamed: the denoiser's blocks cut into units, a unit's state, and the counters.

The blocks of the denoiser (the modules in the attributes its family names as `block_containers`:
SDXL family `down_blocks`, `mid_block`, `up_blocks`; SD3 each of `transformer_blocks`), split into
their sub-modules where a block holds more than `max_unit_bytes`, are the units: the *stream
blocks*. With memory.resident_blocks some of those stay on the device instead, spread through the
forward order (`resident_blocks`), so a family of few large blocks (the SDXL family's 7) still has
a choice between all streamed and none at the units' grain. `stream_blocks` makes them and picks
the resident ones for both the streamer (weights.py) and the planner (fit/planner.py), which
predicts the slots' sizes from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from vramfit.memory.accounting import CopyCounters, tensor_bytes
from vramfit.memory.offload.slots import Slot, SlotPool


@dataclass
class StreamStats(CopyCounters):
    """Counters of the compute-side copies (bytes in device buffers held by the streamer)."""

    grads_moved: int = 0
    grads_summed: int = 0  # gradients of earlier micro-batches added into sums on the device
    stepped_on_device: int = 0  # streamed weights stepped in backward on their compute copy
    offloaded_bytes: int = 0  # saved-for-backward tensors copied to the host
    kept_bytes: int = 0  # saved-for-backward tensors left on the compute device (weights excluded)
    blocks: int = 0  # the stream blocks (`stream_blocks`: the denoiser's blocks, the large ones cut)
    resident_blocks: int = 0  # of those, the ones whose weights stay on the device (memory.resident_blocks)
    streamed_blocks: int = 0  # of those, the ones streamed: the units


@dataclass
class Unit:
    index: int
    name: str
    params: list[nn.Parameter]
    homes: list[torch.Tensor]
    nbytes: int
    buffers: Optional[dict[torch.dtype, torch.Tensor]] = None
    views: Optional[list[torch.Tensor]] = None
    ready: Optional[object] = None  # CUDA event of the copy
    streams: set = field(default_factory=set)  # streams the buffers were recorded on
    bound: bool = False
    # step on the device (grads.py): (parameter, gradient) waiting to step; the buffers' use counts
    # when only the streamer held them; an evicted unit's copies autograd still holds
    to_step: list = field(default_factory=list)
    own_refs: dict = field(default_factory=dict)
    linger: Optional[tuple] = None  # (buffers, views)
    homed: Optional[object] = None  # CUDA event: the stepped values' copy back home is done
    owner: Optional["Unit"] = None  # of a one-weight unit fetched again alone (grads.py `_fetch_alone`)
    slot: Optional[Slot] = None  # where its copy (fetched, or kept for its gradients) is
    # the buffers (one per dtype) its homes are views of, in order (weights.py `_homes_of`); None: apart
    packed: Optional[dict] = None

    def position(self, p: nn.Parameter) -> int:
        return next(i for i, q in enumerate(self.params) if q is p)

    def await_copy(self, device: torch.device) -> None:
        """The current stream waits for the unit's copy to the device; the allocator keeps the
        buffers until the work queued on this stream that uses them is done."""
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            if stream not in self.streams:
                stream.wait_event(self.ready)
                self.streams.add(stream)

    def release_slot(self, pool: SlotPool) -> None:
        """The unit's slot is no longer its own (the pool takes it once nothing else reads it)."""
        if self.slot is not None:
            pool.release(self.slot)
            self.slot = None


def block_modules(denoiser: nn.Module, containers: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The denoiser's blocks: the modules of its attributes `containers` (a ModuleList's each, in
    order, or the module itself), as the family names them."""
    found = []
    for attr in containers:
        module = getattr(denoiser, attr, None)
        if isinstance(module, nn.ModuleList):
            found += [(f"{attr}.{i}", block) for i, block in enumerate(module)]
        elif isinstance(module, nn.Module):
            found.append((attr, module))
    return found


def resident_blocks(blocks: int, resident: int, sizes: Optional[Sequence[int]] = None) -> list[bool]:
    """Which of `blocks` blocks (in forward order) stay resident when `resident` of them do. Each
    one more is the largest block of the largest run of streamed blocks (runs and blocks measured
    by `sizes`, each block's; None: 1 each), of equal blocks the nearest the run's middle, of equal
    runs the later: spread through the forward order, and the blocks of a count are among those of
    the next one, so memory grows with the count (the planner's search relies on it). Spread, not
    bunched: a streamed unit's copy starts when the streamed unit before it is used, so it overlaps
    the compute of that unit and of every resident block between the two; resident blocks side by
    side would leave the streamed ones back to back, each copy hidden by one unit's compute only.
    The largest first: with it go the largest copy and the largest slot (the slots are as large
    as the largest units streamed), so the first ones kept cost the least memory for what they
    save. With sizes all equal, each one more is the middle block of the longest run."""
    if not 0 <= resident <= blocks:
        raise ValueError(f"between 0 and {blocks} resident blocks, not {resident}")
    sizes = [1] * blocks if sizes is None else list(sizes)
    kept = [False] * blocks
    for _ in range(resident):
        runs, start = [], None
        for i, k in enumerate([*kept, True]):
            if not k and start is None:
                start = i
            elif k and start is not None:
                runs.append((start, i))
                start = None
        first, end = max(reversed(runs), key=lambda r: sum(sizes[r[0]:r[1]]))  # the later of equal runs
        middle = first + (end - first) // 2
        kept[max(range(first, end), key=lambda i: (sizes[i], -abs(i - middle)))] = True
    return kept


def recomputed_whole(denoiser: nn.Module) -> frozenset[int]:
    """The ids of the modules gradient checkpointing recomputes whole: in diffusers' models, the
    items of a ModuleList held by a module that checkpoints (has `gradient_checkpointing`) and does
    not checkpoint inside itself (Flux's and SD3's transformer blocks, the UNet's resnets and
    BasicTransformerBlocks; not a Transformer2DModel, which checkpoints its own blocks).

    Why a streamed unit must not be a part of one when its weights are frozen: torch's checkpoint
    keeps what the recomputation saves as the tensors themselves, and a frozen weight is saved as
    its Parameter, whose `.data` goes back home (CPU) when its unit gives way to the next; the
    backward of the region would then read it there. A region that is one unit stays bound from
    its recomputation through its backward."""
    found = set()
    for module in denoiser.modules():
        if hasattr(module, "gradient_checkpointing"):
            for child in module.children():
                if isinstance(child, nn.ModuleList):
                    found.update(id(m) for m in child if not hasattr(m, "gradient_checkpointing"))
    return frozenset(found)


def split_units(name: str, module: nn.Module, limit: int, streamed,
                whole: frozenset[int] = frozenset()) -> list[tuple[str, nn.Module]]:
    """`module` as one unit, or its children's units when it streams more than `limit` bytes and
    is not one of `whole` (ids: `recomputed_whole`). Parameters held directly by a split module
    stay resident."""
    size = sum(tensor_bytes(p) for p in module.parameters() if streamed(p))
    if size == 0:
        return []
    children = list(module.named_children())
    if size <= limit or not children or id(module) in whole:
        return [(name, module)]
    units = []
    for child_name, child in children:
        units += split_units(f"{name}.{child_name}", child, limit, streamed, whole)
    return units


def stream_blocks(denoiser: nn.Module, containers: Sequence[str], limit: int, streamed,
                  resident: int = 0, keep_recomputed_whole: bool = False) -> list[tuple[str, nn.Module, bool]]:
    """The stream blocks in forward order, each (name, module, kept on the device): every block of
    `containers` cut by `split_units` as when all of them stream (so with `resident` 0 the units
    are those of a fully streamed run), `resident` of them kept, spread by `resident_blocks`.
    `keep_recomputed_whole`: no unit is a part of a module checkpointing recomputes whole (frozen
    weights streamed under gradient checkpointing: `recomputed_whole` says why).
    Raises ValueError where `resident` is more than there are (`too_many_resident` words it)."""
    whole = recomputed_whole(denoiser) if keep_recomputed_whole else frozenset()
    cut = [unit for name, block in block_modules(denoiser, containers)
           for unit in split_units(name, block, limit, streamed, whole)]
    # by element count, which the planner's meta copy and the placed model agree on whatever the dtypes
    sizes = [sum(p.numel() for p in module.parameters() if streamed(p)) for _, module in cut]
    kept = resident_blocks(len(cut), resident, sizes)
    return [(name, module, keep) for (name, module), keep in zip(cut, kept)]


def too_many_resident(resident: int, count: int, containers: Sequence[str], unit_mib: float) -> Optional[str]:
    """The problem with memory.resident_blocks = `resident` where the denoiser has `count` stream
    blocks (in its attributes `containers`, cut at memory.stream_unit_mib = `unit_mib`), or None."""
    if resident <= count:
        return None
    return (f"memory.resident_blocks: {resident} is more than the {count} stream blocks of this denoiser "
            f"(its {', '.join(containers)}, a block of more than memory.stream_unit_mib = {unit_mib:g} MiB "
            f"cut into its parts); set at most {count}, or leave it out to have memory.vram_budget choose")
