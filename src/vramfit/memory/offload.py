"""Streamed weights: the denoiser's blocks live in CPU memory and visit the GPU only while used.

What is streamed. The blocks of the denoiser (the modules in the attributes its family names as
`block_containers`: SDXL family `down_blocks`, `mid_block`, `up_blocks`; SD3 each of
`transformer_blocks`), split into their sub-modules where a block
holds more than `max_unit_bytes`, are the *units*. Of each unit the frozen weights are streamed,
and with `stream_trainable` (a full fine-tune) the trained ones too; LoRA matrices, embeddings,
conv_in/out and the final norms stay resident on the device.

Where a weight is. Between uses every streamed parameter's `.data` is its *home*: a pinned CPU
tensor (a plain CPU tensor on CPU-only runs). So `state_dict()`, checkpoint and state saving,
`lora_state` and the optimizer all see the real, current weights with no context to enter, and
an optimizer updates a streamed weight where it lives. When a module of a unit is called (its
forward pre-hook; also when gradient checkpointing recomputes it in backward), the unit's
weights are copied into a *slot* (device buffers, one per dtype) and `.data` points into it; the
copy of the unit that usually comes next (learned from the previous pass, forward and backward
separately) is started at once on a side CUDA stream, so it overlaps the current unit's compute.
At most `capacity` units (2: the current one and the one prefetched) are on the device; the
least recently used goes first, and after every forward and every backward all of them go. A slot is reused once no unit holds
it and autograd keeps nothing of it (a checkpointed block's recomputed weights, until its
backward is done; a block split into several units holds all of them then); the smallest free
slot the unit fits in is taken, else one of the unit's size is made, and slots are kept. The
copy into a slot waits, on the GPU, for the work queued before on the compute stream and on the
copy-home stream, so the host never waits for the GPU. Since the same calls come in the same
order every step, the copies go to the same places every step, which is what lets a CUDA graph
record a streamed step (train/graphs.py, `recorded`). A unit's
tensors that autograd saves for backward are saved as references (unit, offset, shape, strides)
and fetched again when backward needs them, so without checkpointing the weights do not stay on
the device from forward to backward either.

Gradients of streamed weights (full fine-tune). A post-accumulate-grad hook (registered when the
streamer is built, before the loop's own hooks, so it sees the gradient first) moves each gradient to pinned CPU memory on the side
stream and frees the device copy. When backward ends they are handed to the home parameters
through autograd's own accumulation (a small backward into the CPU leaves), so `p.grad` is a
CPU tensor summed exactly as autograd sums micro-batches, and every other post-accumulate-grad
hook (accumulation with stochastic rounding, the optimizer step in backward) runs on the CPU
parameter as it would on a device one. The loop's clipping and `optimizer.step()` then run on
the CPU for these parameters.

Stepping on the device (`step_on_device`: the loop turns it on for the step in backward with an
optimizer of compact state, Adafactor). In the backward that steps, a streamed weight's complete
gradient is not moved home: the weight steps on its compute copy on the device, with the unit's
other gradients that arrive together (through optim/in_backward.py `step_now`, so clipping, the
finite check, packing and chunks are those of resident weights), and the new values are copied to
their homes on the back stream; the next fetch of the unit waits for that copy. Its optimizer
state moves to the device at its first such step and stays there. The compute copy must still
exist when the gradient arrives: a unit evicted while autograd still holds its copy (a
checkpointed block's recomputed weights) and while some of its gradients are still to come is
kept (`linger`) until they have stepped, which costs nothing while autograd holds that memory
anyway (a kept copy autograd has let go of is dropped at the next eviction); a weight whose copy
nothing kept (a projection whose input needs no gradient, such as cross-attention's keys and
values of the text; under mixed_bf16 most weights, since autocast saves its bf16 casts instead)
is fetched again alone, on the compute stream. Gradients of earlier
micro-batches (accumulation) still go home and are brought back to be added when the last one
steps. Compared with the CPU step this costs the optimizer state and up to a unit of waiting
gradients on the device, and no weight crosses PCIe more often than before (the ones fetched
again alone once more); the CPU step's seconds become milliseconds of GPU work.

Activation offload (`offload_activations`): every other tensor saved for backward in the
denoiser's forward (under gradient checkpointing that is the checkpointed blocks' inputs) is
copied to pinned CPU memory and back when backward needs it, both on the compute stream; a
tensor saved by several ops is copied once. The pinned buffers are kept from step to step (each
save takes the smallest free one it fits), so a step allocates no pinned memory after the first
and a CUDA graph can record the copies (`_host_buffer`).

Costs: per step the streamed weights cross PCIe about twice (forward, and backward's recompute
under checkpointing or its re-fetch of saved weights without), and for a full fine-tune their
gradients once back (stepped on the device: their new values once back instead); otherwise the
optimizer step of the streamed weights runs on the CPU after backward, not overlapped with the
GPU; host memory holds the weights, their gradients and optimizer state, pinned. On the device:
the slots (kept between steps: as many units as are held at once, two or three where a
checkpointed block is one unit), the resident weights, and the streamed gradients only until
their copy to the host is done. Under mixed_bf16 without checkpointing the bf16 casts autocast
makes of the weights are saved as they are (on the device); autocast's cache of them is
cleared at each change of unit. On CPU-only runs every step still copies into separate compute
tensors, so tests see the mechanism work.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence

import torch
from torch import nn

from vramfit.config.schema import MemoryConfig
from vramfit.memory.accounting import CopyCounters, concrete_device, tensor_bytes


@dataclass
class StreamStats(CopyCounters):
    """Counters of the compute-side copies (bytes in device buffers held by the streamer)."""

    grads_moved: int = 0
    stepped_on_device: int = 0  # streamed weights stepped in backward on their compute copy
    offloaded_bytes: int = 0  # saved-for-backward tensors copied to the host
    kept_bytes: int = 0  # saved-for-backward tensors left on the compute device (weights excluded)


@dataclass
class _Unit:
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
    # step on the device (WeightStreamer.step_on_device): (parameter, gradient) waiting to step; the
    # buffers' use counts when only the streamer held them; an evicted unit's copies autograd still holds
    to_step: list = field(default_factory=list)
    own_refs: dict = field(default_factory=dict)
    linger: Optional[tuple] = None  # (buffers, views)
    homed: Optional[object] = None  # CUDA event: the stepped values' copy back home is done
    owner: Optional["_Unit"] = None  # of a one-weight unit fetched again alone (_fetch_alone)
    slot: Optional[_Slot] = None  # where its copy (fetched, or kept for its gradients) is

    def position(self, p: nn.Parameter) -> int:
        return next(i for i, q in enumerate(self.params) if q is p)


@dataclass(eq=False)  # one slot is itself, not any slot of equal contents
class _Slot:
    """Device buffers (one per dtype) that units are copied into; kept for the streamer's life."""

    buffers: dict[torch.dtype, torch.Tensor]
    released: int = -1  # when its last unit let go of it (the streamer's count of releases)
    read_home: Optional[object] = None  # CUDA event: the copies home of new values out of it are done


@dataclass(frozen=True)
class _WeightRef:
    unit: int
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple


@dataclass(eq=False)
class _Offloaded:
    host: torch.Tensor
    device: torch.device


@dataclass(eq=False)
class _HostBuffer:
    """Pinned CPU memory that saved tensors are offloaded into, kept while training (`_host_buffer`)."""

    data: torch.Tensor  # flat
    busy: bool = False  # a saved tensor that autograd still holds lives in it


def _set_free(buffer: _HostBuffer) -> None:
    buffer.busy = False


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, a tuple/list or a dict-like (diffusers' outputs)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


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


def _is_plain(p: torch.Tensor) -> bool:
    # Quantized weights (tensor subclasses, memory/quantize.py) stay where they are.
    return type(p.data) is torch.Tensor


def split_units(name: str, module: nn.Module, limit: int, streamed) -> list[tuple[str, nn.Module]]:
    """`module` as one unit, or its children's units when it streams more than `limit` bytes.
    Parameters held directly by a split module stay resident."""
    size = sum(tensor_bytes(p) for p in module.parameters() if streamed(p))
    if size == 0:
        return []
    children = list(module.named_children())
    if size <= limit or not children:
        return [(name, module)]
    units = []
    for child_name, child in children:
        units += split_units(f"{name}.{child_name}", child, limit, streamed)
    return units


class WeightStreamer:
    """Streams the weights of a denoiser's blocks (see the module docstring). Build it with
    `stream_weights`; it lives as long as the hooks it puts on the model."""

    def __init__(self, denoiser: nn.Module, device: torch.device, *, blocks: Sequence[str], stream: bool,
                 stream_trainable: bool, max_unit_bytes: int, offload_activations: bool, capacity: int = 2):
        device = concrete_device(device)  # tensors report cuda:N; compare alike
        self.model, self.device = denoiser, device
        self.cuda = device.type == "cuda"
        self.capacity = max(2, capacity)
        self.offload_activations = offload_activations
        self.stats = StreamStats()
        # Copies to the device and back to the host on two streams: PCIe carries both at once.
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.back = torch.cuda.Stream(self.device) if self.cuda else None

        def streamed(p: nn.Parameter) -> bool:
            return stream and _is_plain(p) and (stream_trainable or not p.requires_grad)

        named = []
        for block_name, block in block_modules(denoiser, blocks):
            named += split_units(block_name, block, max_unit_bytes, streamed)
        self.units: list[_Unit] = []
        self._handles = []
        seen: set[int] = set()
        for name, module in named:
            params = [p for p in module.parameters() if streamed(p) and id(p) not in seen]
            seen.update(id(p) for p in params)
            homes = [self._to_home(p.data) for p in params]
            for p, home in zip(params, homes):
                p.data = home
            unit = _Unit(len(self.units), name, params, homes, sum(tensor_bytes(h) for h in homes))
            self.units.append(unit)
            self._hook_calls(module, unit, {id(p) for p in params})
        self._move_resident(seen)
        self._resident_storages = {p.untyped_storage().data_ptr() for p in denoiser.parameters()
                                   if id(p) not in seen}
        self._lru: list[_Unit] = []  # resident units, least recently used first
        self._by_storage: dict[int, tuple[_Unit, torch.dtype]] = {}
        self._current: Optional[_Unit] = None
        self._next: dict[str, dict[Optional[int], int]] = {"fwd": {}, "bwd": {}}
        self._prev: dict[str, Optional[int]] = {"fwd": None, "bwd": None}
        self._task: Optional[int] = None  # autograd graph task whose end is awaited
        self._saving = None  # the saved-tensor hooks of a running forward
        self._offloaded: dict[tuple, tuple] = {}
        self._host_buffers: list[_HostBuffer] = []  # where saved tensors are offloaded to, kept
        self._stash: dict[nn.Parameter, Optional[torch.Tensor]] = {}
        self._moved: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._delivering = False
        # the device buffers units are copied into (`_slot`), one per dtype each; made as needed, kept
        self._slots: list[_Slot] = []
        self._releases = 0
        self._recording = False  # inside a CUDA graph's recording (train/graphs.py): no host syncs
        self.trainable = [p for u in self.units for p in u.params if p.requires_grad]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self.steps = None  # optim/in_backward.py BackwardSteps that steps streamed weights on the device
        self._stepped: set[int] = set()  # streamed weights stepped in the running backward
        self._lingering: list[_Unit] = []
        self._gathering: Optional[_Unit] = None  # the unit whose gradients arrive now
        for p in self.trainable:
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._handles.append(denoiser.register_forward_pre_hook(self._forward_begins))
        self._handles.append(denoiser.register_forward_hook(self._forward_ends, always_call=True))

    def step_on_device(self, steps) -> None:
        """Step the streamed weights inside backward on their compute copies, through `steps` (an
        optim/in_backward.py BackwardSteps whose optimizer has compact state), and copy the new
        values home; None: back to moving their gradients home (the normal path)."""
        self.steps = steps

    @contextmanager
    def recorded(self):
        """Around a CUDA graph's recording of the streamed forward or backward (train/graphs.py),
        on the recording's stream: the copy streams join the recording at its start and it waits
        for them at its end (a recording must end with every stream it forked joined back), no
        host sync runs inside, and the events made inside are forgotten after it (they belong to
        the recording; every replay ends with its copies done, in its stream's order)."""
        if not self.cuda:
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        self.side.wait_stream(stream)
        self.back.wait_stream(stream)
        # a recording may wait only on events it made: those of the eager steps before are done (a
        # recording starts after a device synchronization, and a replay runs after it)
        self._forget_events()
        self._recording = True
        try:
            yield
            stream.wait_stream(self.side)
            stream.wait_stream(self.back)
        finally:
            self._recording = False
            self._forget_events()

    def _forget_events(self) -> None:
        for unit in self.units:
            unit.ready = unit.homed = None
        for slot in self._slots:
            slot.read_home = None

    # ---- placement ---------------------------------------------------------------------------

    def _to_home(self, t: torch.Tensor) -> torch.Tensor:
        home = t.detach().to("cpu").contiguous()
        if self.cuda:
            home = home.pin_memory()
        elif home.data_ptr() == t.data_ptr():
            home = home.clone()  # never share storage with what the caller handed in
        return home

    def _move_resident(self, streamed_ids: set[int]) -> None:
        for module in self.model.modules():
            for _, p in module.named_parameters(recurse=False):
                if id(p) not in streamed_ids and p.device != self.device:
                    p.data = p.data.to(self.device)
            for name, b in module.named_buffers(recurse=False):
                if b.device != self.device:
                    setattr(module, name, b.to(self.device))

    def _hook_calls(self, module: nn.Module, unit: _Unit, ids: set[int]) -> None:
        # Every sub-module that holds a streamed weight fetches its unit when called: gradient
        # checkpointing recomputes a block's pieces without calling the block itself.
        for sub in module.modules():
            if any(id(p) in ids for p in sub.parameters(recurse=False)):
                self._handles.append(sub.register_forward_pre_hook(partial(self._called, unit)))

    # ---- fetch and release -------------------------------------------------------------------

    def _called(self, unit: _Unit, module, args) -> None:
        if self._current is not unit or not unit.bound:
            self.use(unit)

    def use(self, unit: _Unit) -> None:
        """Make `unit`'s weights the compute copies now and start copying the next unit."""
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
        if phase == "bwd":
            self._expect_end_of_backward()
        prev = self._prev[phase]
        if prev != unit.index:
            self._next[phase][prev] = unit.index
            self._prev[phase] = unit.index
        if unit.buffers is None:
            self._fetch(unit)
        self._bind(unit)
        self._lru.remove(unit)
        self._lru.append(unit)
        if self._current is not None and self._current is not unit and self._current.bound:
            self._unbind(self._current)
            if torch.is_autocast_enabled(self.device.type):
                # autocast keeps its casts of trained weights until it exits: a bf16 copy of every
                # unit by the end of forward. The previous unit's are not used again.
                torch.clear_autocast_cache()
        self._current = unit
        upcoming = self._next[phase].get(unit.index)
        if upcoming is not None and upcoming != unit.index:
            self._prefetch(self.units[upcoming])

    def _prefetch(self, unit: _Unit) -> None:
        if unit.buffers is None:
            self._fetch(unit)
        self._lru.remove(unit)
        self._lru.insert(max(0, len(self._lru) - 1), unit)  # behind the current unit only

    def _fetch(self, unit: _Unit) -> None:
        while len(self._lru) >= self.capacity:
            victim = next((u for u in self._lru if u is not self._current), None)
            if victim is None:
                break
            self._evict(victim)
        self._rehome(unit)
        slot = self._slot(_layout(unit.homes))
        buffers = slot.buffers
        if self.cuda:
            # The slot's earlier units are done with once the work queued so far on the compute
            # stream (their forward or backward) and the copies home of their stepped values out
            # of it are; the unit's home holds its new values once their copy is done. The CPU may
            # run ahead of the GPU: the copy waits on the GPU, the host does not.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            for event in (slot.read_home, unit.homed):
                if event is not None:
                    self.side.wait_event(event)
            slot.read_home = unit.homed = None
        with torch.cuda.stream(self.side) if self.cuda else nullcontext():
            offsets = dict.fromkeys(buffers, 0)
            views = []
            for h in unit.homes:
                view = buffers[h.dtype].narrow(0, offsets[h.dtype], h.numel()).view(h.shape)
                view.copy_(h, non_blocking=self.cuda)
                offsets[h.dtype] += h.numel()
                views.append(view)
            if self.cuda:
                unit.ready = torch.cuda.Event()
                unit.ready.record(self.side)
        self._let_go(unit)  # fetched again: the new copy serves its gradients
        unit.buffers, unit.views, unit.streams, unit.slot = buffers, views, set(), slot
        unit.own_refs = {dtype: _use_count(buf) for dtype, buf in buffers.items()}
        for dtype, buf in buffers.items():
            self._by_storage[buf.untyped_storage().data_ptr()] = (unit, dtype)
        self._lru.append(unit)
        self.stats.fetched(unit.nbytes)

    def _slot(self, need: dict[torch.dtype, int]) -> _Slot:
        """Device buffers of at least `need` elements per dtype that no unit holds and nothing else
        reads (autograd keeps a checkpointed block's recomputed weights until its backward is done,
        all of the block's units when it spans several): the smallest such kept slot, else a new
        one of exactly `need`. Kept buffers rather than the allocator's: a CUDA graph recording a
        streamed step (train/graphs.py) bakes in where each copy goes, and memory freed during a
        recording after another stream used it is memory the allocator reuses only after the
        recording ends. Of the smallest free slots the one let go of longest ago is taken; where that
        is the one just let go of, whose stepped values are still being copied home, and no more
        than `capacity` slots exist, a new one is made instead, so that the copy in does not wait
        for that copy out (the backward of a streamed step on the device: copies both ways at once)."""
        held = {id(u.slot) for u in self.units if u.slot is not None}  # fetched, or kept for gradients
        free = [slot for slot in self._slots
                if id(slot) not in held
                and all(d in slot.buffers and slot.buffers[d].numel() >= n for d, n in need.items())
                and all(_use_count(b) == self._alone for b in slot.buffers.values())]
        if free:
            best = min(free, key=lambda slot: (sum(tensor_bytes(b) for b in slot.buffers.values()), slot.released))
            copying_home = best.read_home is not None and best.released == self._releases - 1
            if not (copying_home and len(self._slots) <= self.capacity):
                return best
        slot = _Slot({dtype: torch.empty(n, dtype=dtype, device=self.device) for dtype, n in need.items()})
        self._alone = _use_count(next(iter(slot.buffers.values())))  # what a buffer nothing else shares counts
        self._slots.append(slot)
        return slot

    def free_slots(self) -> None:
        """Let the slots and the pinned buffers of offloaded activations go (after training: the
        save phase does not hold them). Only once no CUDA graph that copies into them will be
        replayed again; the next use makes new ones.
        Gradients gathered by a backward that did not finish (an error) are dropped, not stepped."""
        for unit in self.units:
            unit.to_step.clear()
        self._drop_lingering()
        self._stepped.clear()
        self._gathering = None
        self.release_all()
        self._slots.clear()
        self._host_buffers.clear()

    def slot_bytes(self) -> int:
        """Bytes of the device buffers units are copied into (kept between steps)."""
        return sum(tensor_bytes(b) for slot in self._slots for b in slot.buffers.values())

    def _rehome(self, unit: _Unit) -> None:
        # Something outside moved or replaced a weight between uses (Module.to, a load with
        # assign): that tensor is the value now; it goes back to CPU memory.
        for i, p in enumerate(unit.params):
            if p.data_ptr() != unit.homes[i].data_ptr():
                unit.homes[i] = self._to_home(p.data)
                p.data = unit.homes[i]

    def _await_copy(self, unit: _Unit) -> None:
        """The current stream waits for the unit's copy to the device; the allocator keeps the
        buffers until the work queued on this stream that uses them is done."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            if stream not in unit.streams:
                stream.wait_event(unit.ready)
                unit.streams.add(stream)

    def _bind(self, unit: _Unit) -> None:
        self._await_copy(unit)
        if not unit.bound:
            for p, view in zip(unit.params, unit.views):
                p.data = view
            unit.bound = True

    def _unbind(self, unit: _Unit) -> None:
        if unit.to_step:
            self._step_unit(unit)
        for p, home in zip(unit.params, unit.homes):
            p.data = home
        unit.bound = False

    def _evict(self, unit: _Unit) -> None:
        if unit.bound:
            self._unbind(unit)
        if unit.to_step:
            self._step_unit(unit)
        if self._awaits_grads(unit) and self._shared(unit.buffers, unit.own_refs):
            # autograd still holds this copy (a checkpointed block's recomputed weights) and gradients
            # of the unit are to come: keep it, at no cost, so that they step on it
            unit.linger = (unit.buffers, unit.views)
            self._lingering.append(unit)
        for other in list(self._lingering):  # one autograd let go of is not kept longer
            if other is not unit and not self._shared(other.linger[0], other.own_refs):
                if other.to_step:
                    self._step_unit(other)
                self._let_go(other)
        for buf in unit.buffers.values():
            self._by_storage.pop(buf.untyped_storage().data_ptr(), None)
        if unit.linger is None:
            self._release_slot(unit)
        unit.buffers = unit.views = unit.ready = None
        unit.streams = set()
        self._lru.remove(unit)
        if self._current is unit:
            self._current = None
        self.stats.released(unit.nbytes)

    def release_all(self) -> None:
        """Every streamed weight back at its home; no compute copy is held."""
        for unit in list(self._lru):
            self._evict(unit)
        for unit in list(self._lingering):  # a step may drop it from the list
            if unit.to_step:
                self._step_unit(unit)
        self._drop_lingering()
        self._current = None

    def _let_go(self, unit: _Unit) -> None:
        """Stop keeping `unit`'s copy for its gradients, if it is kept."""
        if unit.linger is not None:
            unit.linger = None
            self._lingering.remove(unit)
            self._release_slot(unit)

    def _drop_lingering(self) -> None:
        for unit in self._lingering:
            unit.linger = None
            self._release_slot(unit)
        self._lingering.clear()

    def _release_slot(self, unit: _Unit) -> None:
        """The unit's slot is no longer its own (`_slot` takes it once nothing else reads it)."""
        if unit.slot is not None:
            unit.slot.released = self._releases
            self._releases += 1
            unit.slot = None

    # ---- forward and backward boundaries -----------------------------------------------------

    def _forward_begins(self, module, args) -> None:
        self._prev["fwd"] = None
        if self._stepped or self._lingering:  # a backward that stepped on the device did not finish
            for unit in self.units:
                unit.to_step.clear()
            self._drop_lingering()
            self._stepped.clear()
            self._gathering = None
        if not torch.is_grad_enabled():
            return
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saving.__enter__()
        first = self._next["fwd"].get(None)
        if first is not None:
            self._prefetch(self.units[first])

    def _forward_ends(self, module, args, output) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        self._offloaded.clear()
        self.release_all()
        if self.trainable and torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        # The gradient of the output comes before any of a weight's: autograd must not add a
        # device gradient to the CPU one, so the CPU gradients step aside until backward ends.
        # (At forward begin would be too early: a forward whose backward is skipped must leave
        # the gradients to the loop's zero_grad.)
        if self._task == torch._C._current_graph_task_id():
            return
        self._expect_end_of_backward()
        for p in self.trainable:
            self._stash[p] = p.grad
            p.grad = None

    def _expect_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._prev["bwd"] = None
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._task = None
        if self._gathering is not None and self._gathering.to_step:  # a weight fetched alone, say
            self._step_unit(self._gathering)
        self._gathering = None
        self.release_all()
        self._stepped.clear()
        self._deliver_grads()

    # ---- saved tensors ----------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one storage
            return t
        hit = self._by_storage.get(ptr)
        if hit is not None and hit[1] == t.dtype:
            return _WeightRef(hit[0].index, t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        if ptr in self._resident_storages:
            return t
        if not self.offload_activations or t.device != self.device:
            self.stats.kept_bytes += tensor_bytes(t)
            return t
        return self._offload(t, ptr)

    def _offload(self, t: torch.Tensor, ptr: int) -> _Offloaded:
        key = (ptr, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype, t._version)
        hit = self._offloaded.get(key)
        if hit is not None and hit[0]() is not None:
            return hit[1]
        buffer = self._host_buffer(t.dtype, t.numel())
        host = buffer.data[:t.numel()].view(t.size())
        host.copy_(t, non_blocking=self.cuda)  # on the compute stream: ordered before any reuse of t
        packed = _Offloaded(host, t.device)
        buffer.busy = True
        weakref.finalize(packed, _set_free, buffer)  # autograd let go of it: its backward is done
        self._offloaded[key] = (weakref.ref(t), packed)
        self.stats.offloaded_bytes += tensor_bytes(host)
        return packed

    def _host_buffer(self, dtype: torch.dtype, numel: int) -> _HostBuffer:
        """A kept pinned buffer of `dtype` with room for `numel` values that no saved tensor lives in:
        the smallest, the first made of those; else a new one. Kept rather than the pinned allocator's
        per tensor: the same saves come in the same order every step, so a step finds its buffers
        free and in the same places, which is what lets a CUDA graph record the copies (train/graphs.py:
        a replay copies to the addresses the recording saw). A buffer is written in forward and read
        in backward on the compute stream, so its next step's write is ordered after that read."""
        free = [b for b in self._host_buffers if not b.busy and b.data.dtype == dtype and b.data.numel() >= numel]
        if free:
            return min(free, key=lambda b: b.data.numel())  # min keeps the first of equals
        if self._recording:
            # pinned memory is not made while CUDA records; an eager call of this signature comes first
            # (train/graphs.py), so this is a save that call did not make
            raise RuntimeError(f"offloaded activations: a {dtype} tensor of {numel} values saved only "
                               "while recording has no pinned buffer")
        buffer = _HostBuffer(torch.empty(numel, dtype=dtype, pin_memory=self.cuda))
        self._host_buffers.append(buffer)
        return buffer

    def host_bytes(self) -> int:
        """Bytes of the pinned buffers that saved tensors are offloaded into."""
        return sum(tensor_bytes(b.data) for b in self._host_buffers)

    def _unpack(self, packed):
        if isinstance(packed, _WeightRef):
            unit = self.units[packed.unit]
            self.use(unit)
            return unit.buffers[packed.dtype].as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Offloaded):
            return packed.host.to(packed.device, non_blocking=self.cuda)
        return packed

    # ---- gradients of streamed weights --------------------------------------------------------

    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        if self._delivering or p.grad is None:
            return
        self._expect_end_of_backward()
        grad, p.grad = p.grad, None
        unit = self._unit_of[id(p)]
        if self.steps is not None and self.steps.stepping:
            # stepped on the compute copy, with the rest of the unit's gradients that arrive together
            # (a weight whose copy is gone, one autograd did not keep, is fetched again alone)
            if self._copy_of(unit) is None:
                unit = self._fetch_alone(unit, p)
            earlier = self._stash.pop(p, None)  # earlier micro-batches' sum, as autograd accumulated it
            if earlier is not None:
                grad = grad.add_(earlier.to(grad.device, non_blocking=True))
            if self._gathering is not None and self._gathering is not unit:
                self._step_unit(self._gathering)
            self._gathering = unit
            unit.to_step.append((p, grad))
            self._stepped.add(id(p))
            return
        host = torch.empty(grad.size(), dtype=grad.dtype, pin_memory=self.cuda)
        if self.cuda:
            self.back.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.back):
                host.copy_(grad, non_blocking=True)
            grad.record_stream(self.back)  # its memory is reused only after the copy
        else:
            host.copy_(grad)
        self._moved.append((p, host))
        self.stats.grads_moved += 1

    def _fetch_alone(self, unit: _Unit, p: nn.Parameter) -> _Unit:
        """A one-weight unit holding a new compute copy of `p` (whose own unit holds none now)."""
        home = unit.homes[unit.position(p)]
        if self.cuda and unit.homed is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.homed)
        copy = home.to(self.device, non_blocking=True) if self.cuda else home.clone()
        self.stats.fetched(tensor_bytes(copy))
        self.stats.released(tensor_bytes(copy))
        return _Unit(unit.index, unit.name, [p], [home], tensor_bytes(copy), linger=({copy.dtype: copy}, [copy]),
                     owner=unit)

    @staticmethod
    def _shared(buffers: dict, own_refs: dict) -> bool:
        """Whether tensors other than the streamer's own views share one of these buffers."""
        return any(_use_count(buf) > own_refs[dtype] for dtype, buf in buffers.items())

    def _copy_of(self, unit: _Unit) -> Optional[tuple]:
        """(buffers, views) of the unit's compute copy: fetched, or kept for its gradients; or None."""
        if unit.buffers is not None:
            return unit.buffers, unit.views
        return unit.linger

    def _awaits_grads(self, unit: _Unit) -> bool:
        """In the backward that steps on the device, whether a trained weight of `unit` has not
        had its gradient yet."""
        return (self.steps is not None and self.steps.stepping and self._task is not None
                and any(p.requires_grad and id(p) not in self._stepped for p in unit.params))

    def _step_unit(self, unit: _Unit) -> None:
        """Step the unit's weights whose gradients are complete on their compute copies, then copy
        the new values home on the back stream."""
        pairs, unit.to_step = unit.to_step, []
        if self._gathering is unit:
            self._gathering = None
        if unit.buffers is not None:  # a prefetched copy may not have been used (and waited for) yet
            self._await_copy(unit)
        _, views = self._copy_of(unit)
        bound = [p.data for p, _ in pairs]
        positions = [unit.position(p) for p, _ in pairs]
        for (p, _), i in zip(pairs, positions):
            p.data = views[i]  # already so while the unit is bound
        self.steps.step_now(pairs)
        self.stats.stepped_on_device += len(pairs)
        # A copy of one weight fetched alone is the allocator's memory, which the compute stream
        # reuses as soon as it is dropped: its copy home runs on the compute stream, so that no
        # later kernel overwrites it first (a small copy, for that weight only). A slot is not
        # reused before the copy-home stream is done with it (`_fetch`): the rest go there.
        home_stream = None
        if self.cuda:
            home_stream = self.back if unit.owner is None else torch.cuda.current_stream(self.device)
            home_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(home_stream) if self.cuda else nullcontext():
            for (p, _), i in zip(pairs, positions):
                unit.homes[i].copy_(p.data, non_blocking=self.cuda)
            if self.cuda:
                unit.homed = torch.cuda.Event()
                unit.homed.record(home_stream)
        if unit.slot is not None:  # the slot is not copied into again before these copies are done
            unit.slot.read_home = unit.homed
        for (p, _), data in zip(pairs, bound):
            p.data = data
        if unit.owner is not None:  # fetched alone: its home belongs to the owner's copies
            unit.owner.homed = unit.homed
        elif unit.linger is not None and not self._awaits_grads(unit):
            self._let_go(unit)

    def _deliver_grads(self) -> None:
        """Hand the moved gradients to the home parameters through autograd's accumulation."""
        if self.cuda and not self._recording:
            self.side.synchronize()  # no copy may still read a home the optimizer will change
            self.back.synchronize()
        for p, grad in self._stash.items():
            p.grad = grad
        self._stash.clear()
        moved, self._moved = self._moved, []
        if not moved:
            return
        self._delivering = True
        try:
            torch.autograd.backward([p for p, _ in moved], [g for _, g in moved])
        finally:
            self._delivering = False

    # ---- accounting -------------------------------------------------------------------------

    def streamed_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def device_copies(self) -> list[torch.Tensor]:
        """The compute-side buffers held now (empty between uses)."""
        return [b for u in self.units if u.buffers for b in u.buffers.values()]


def _layout(tensors: list[torch.Tensor]) -> dict[torch.dtype, int]:
    """Elements of `tensors` by dtype."""
    found: dict[torch.dtype, int] = {}
    for t in tensors:
        found[t.dtype] = found.get(t.dtype, 0) + t.numel()
    return found


def _use_count(t: torch.Tensor) -> int:
    """How many tensors share `t`'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# id(denoiser) -> its streamer, which its hooks keep alive (a weak value: the registry keeps neither)
def stream_weights(denoiser: nn.Module, device: torch.device, settings: MemoryConfig, *,
                   blocks: Sequence[str], stream_trainable: bool) -> Optional[WeightStreamer]:
    """Apply settings.stream_weights / offload_activations to `denoiser`, whose blocks are in its
    attributes `blocks` (see the module docstring); None when both are off. Call after LoRA is
    added and before the optimizer is built; the weights that are not streamed are moved to
    `device` here."""
    if not (settings.stream_weights or settings.offload_activations):
        return None
    return WeightStreamer(denoiser, device, blocks=blocks, stream=settings.stream_weights,
                          stream_trainable=stream_trainable,
                          max_unit_bytes=int(settings.stream_unit_mib * 2**20),
                          offload_activations=settings.offload_activations)
