"""Weight streaming: the units' weights live at home in CPU memory and visit the device only while used.

Where a weight is. Between uses every streamed parameter's `.data` is its *home*: a pinned CPU
tensor (a plain CPU tensor on CPU-only runs). So `state_dict()`, checkpoint and state saving,
`lora_state` and the optimizer all see the real, current weights with no context to enter, and
an optimizer updates a streamed weight where it lives. When a module of a unit is called (its
forward pre-hook; also when gradient checkpointing recomputes it in backward), the unit's weights
are copied into a slot (slots.py) and `.data` points into it; the copy of the unit that usually
comes next (learned from the previous pass, forward and backward separately) is started at once
on a side CUDA stream, so it overlaps the current unit's compute. At most `capacity` units (2:
the current one and the one prefetched) are on the device; the least recently used goes first,
and after every forward and every backward all of them go. The copy into a slot waits, on the
GPU, for the work queued before on the compute stream and on the copy-home stream, so the host
never waits for the GPU. Since the same calls come in the same order every step, the copies go to
the same places every step, which is what lets a CUDA graph record a streamed step
(train/graphs.py, `recorded`). A unit's tensors that autograd saves for backward are saved as
references (unit, offset, shape, strides) and fetched again when backward needs them, so without
checkpointing the weights do not stay on the device from forward to backward either; the other
saved tensors go to activations.py.

WeightStreamer composes the parts: it owns the units, the copy streams, the hooks on the model
and the forward and backward boundaries, and calls the slot pool (slots.py), the gradients'
part (grads.py) and the activation offload (activations.py), each given what it needs when made.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch
from torch import nn

from vramfit.config.load import ConfigError
from vramfit.config.schema import MemoryConfig
from vramfit.memory import pinned
from vramfit.memory.accounting import concrete_device, tensor_bytes
from vramfit.memory.offload.activations import ActivationOffload, HostBuffer
from vramfit.memory.offload.grads import GradsHome
from vramfit.memory.offload.slots import Slot, SlotPool, layout, use_count
from vramfit.memory.offload.units import StreamStats, Unit, stream_blocks, too_many_resident


@dataclass(frozen=True)
class _WeightRef:
    unit: int
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, a tuple/list or a dict-like (diffusers' outputs)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _is_plain(p: torch.Tensor) -> bool:
    # Quantized weights (tensor subclasses, memory/quantize.py) stay where they are.
    return type(p.data) is torch.Tensor


def _streams(p: nn.Parameter, trainable: bool) -> bool:
    """Whether weight streaming moves `p` (trained weights only where `trainable`: a full fine-tune)."""
    return _is_plain(p) and (trainable or not p.requires_grad)


class WeightStreamer:
    """Streams the weights of a denoiser's blocks (see the package docstring). Build it with
    `stream_weights`; it lives as long as the hooks it puts on the model. `resident` of the stream
    blocks (units.py `stream_blocks`: the blocks, the large ones cut), spread through the forward
    order, are not streamed: their weights go to the device with the other resident ones
    (gradients, optimizer step and saved tensors as theirs)."""

    def __init__(self, denoiser: nn.Module, device: torch.device, *, blocks: Sequence[str], stream: bool,
                 stream_trainable: bool, max_unit_bytes: int, offload_activations: bool, capacity: int = 2,
                 resident: int = 0, sums_on_device: bool = False, keep_recomputed_whole: bool = False):
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
            return stream and _streams(p, stream_trainable)

        found = stream_blocks(denoiser, blocks, max_unit_bytes, streamed, resident if stream else 0,
                              keep_recomputed_whole)
        named = [(name, module) for name, module, kept in found if not kept]
        self.stats.blocks, self.stats.streamed_blocks = len(found), len(named)
        self.stats.resident_blocks = len(found) - len(named)
        self.units: list[Unit] = []
        self._handles = []
        seen: set[int] = set()
        for name, module in named:
            params = [p for p in module.parameters() if streamed(p) and id(p) not in seen]
            seen.update(id(p) for p in params)
            packed, homes = self._homes_of(params)
            for p, home in zip(params, homes):
                p.data = home
            unit = Unit(len(self.units), name, params, homes, sum(tensor_bytes(h) for h in homes), packed=packed)
            self.units.append(unit)
            self._hook_calls(module, unit, {id(p) for p in params})
        self._move_resident(seen)
        self._resident_storages = {p.untyped_storage().data_ptr() for p in denoiser.parameters()
                                   if id(p) not in seen}
        self._lru: list[Unit] = []  # resident units, least recently used first
        self._by_storage: dict[int, tuple[Unit, torch.dtype]] = {}
        self._current: Optional[Unit] = None
        self._next: dict[str, dict[Optional[int], int]] = {"fwd": {}, "bwd": {}}
        self._prev: dict[str, Optional[int]] = {"fwd": None, "bwd": None}
        self._task: Optional[int] = None  # autograd graph task whose end is awaited
        self._saving = None  # the saved-tensor hooks of a running forward
        self.activations = ActivationOffload(device, enabled=offload_activations, stats=self.stats)
        # the device buffers units are copied into (`_slot`), one per dtype each; made as needed, kept
        self.slots = SlotPool(device, self.capacity)
        self.grads = GradsHome(self.units, device, side=self.side, back=self.back, stats=self.stats,
                               slots=self.slots, expect_end_of_backward=self._expect_end_of_backward,
                               in_backward=lambda: self._task is not None, sums_on_device=sums_on_device)
        self._recording = False  # inside a CUDA graph's recording (train/graphs.py): no host syncs
        self.trainable = self.grads.trainable
        for p in self.trainable:
            self._handles.append(p.register_post_accumulate_grad_hook(self.grads.grad_ready))
        self._handles.append(denoiser.register_forward_pre_hook(self._forward_begins))
        self._handles.append(denoiser.register_forward_hook(self._forward_ends, always_call=True))

    def step_on_device(self, steps) -> None:
        """Step the streamed weights inside backward on their compute copies, through `steps` (an
        optim/in_backward.py BackwardSteps whose optimizer has compact state), and copy the new
        values home; None: back to moving their gradients home (the normal path)."""
        self.grads.steps = steps

    def share_home_sums(self) -> None:
        """One set of gradient sums at home for every unit (grads.py `share_home_sums`: the fit
        probe's stand-in, whose sums' values matter to nothing)."""
        self.grads.share_home_sums()

    @property
    def _recording(self) -> bool:
        return self.grads.recording

    @_recording.setter
    def _recording(self, value: bool) -> None:
        # no host syncs (grads), no pinned memory made (activations) inside a recording
        self.grads.recording = self.activations.recording = value

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
        self.slots.forget_events()

    # ---- placement ---------------------------------------------------------------------------

    def _homes_of(self, params: list[nn.Parameter]) -> tuple[Optional[dict[torch.dtype, torch.Tensor]],
                                                              list[torch.Tensor]]:
        """A unit's homes, and the buffers that hold them: one per dtype, in order (on CUDA pinned,
        exactly its size: memory/pinned.py), so that a fetch copies each buffer whole, one copy
        instead of one a weight. Copies: never the caller's storage."""
        packed = {dtype: pinned.empty(n, dtype, pin=self.cuda, device=self.device)
                  for dtype, n in layout([p.data for p in params]).items()}
        offsets = dict.fromkeys(packed, 0)
        homes = []
        for p in params:
            t = p.data
            home = packed[t.dtype].narrow(0, offsets[t.dtype], t.numel()).view(t.shape)
            home.copy_(t)
            offsets[t.dtype] += t.numel()
            homes.append(home)
        return packed, homes

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

    def _hook_calls(self, module: nn.Module, unit: Unit, ids: set[int]) -> None:
        # Every sub-module that holds a streamed weight fetches its unit when called: gradient
        # checkpointing recomputes a block's pieces without calling the block itself.
        for sub in module.modules():
            if any(id(p) in ids for p in sub.parameters(recurse=False)):
                self._handles.append(sub.register_forward_pre_hook(partial(self._called, unit)))

    # ---- fetch and release -------------------------------------------------------------------

    def _called(self, unit: Unit, module, args) -> None:
        if self._current is not unit or not unit.bound:
            self.use(unit)

    def use(self, unit: Unit) -> None:
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

    def _prefetch(self, unit: Unit) -> None:
        if unit.buffers is None:
            self._fetch(unit)
        self._lru.remove(unit)
        self._lru.insert(max(0, len(self._lru) - 1), unit)  # behind the current unit only

    def _fetch(self, unit: Unit) -> None:
        while len(self._lru) >= self.capacity:
            victim = next((u for u in self._lru if u is not self._current), None)
            if victim is None:
                break
            self._evict(victim)
        self._rehome(unit)
        slot = self._slot(layout(unit.homes))
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
            for dtype, home in (unit.packed or {}).items():  # the homes in the slot's order: whole
                buffers[dtype].narrow(0, 0, home.numel()).copy_(home, non_blocking=self.cuda)
            offsets = dict.fromkeys(buffers, 0)
            views = []
            for h in unit.homes:
                view = buffers[h.dtype].narrow(0, offsets[h.dtype], h.numel()).view(h.shape)
                if unit.packed is None:
                    view.copy_(h, non_blocking=self.cuda)
                offsets[h.dtype] += h.numel()
                views.append(view)
            if self.cuda:
                unit.ready = torch.cuda.Event()
                unit.ready.record(self.side)
        self.grads.let_go(unit)  # fetched again: the new copy serves its gradients
        unit.buffers, unit.views, unit.streams, unit.slot = buffers, views, set(), slot
        unit.own_refs = {dtype: use_count(buf) for dtype, buf in buffers.items()}
        for dtype, buf in buffers.items():
            self._by_storage[buf.untyped_storage().data_ptr()] = (unit, dtype)
        self._lru.append(unit)
        self.stats.fetched(unit.nbytes)

    def _slot(self, need: dict[torch.dtype, int]) -> Slot:
        """A slot for `need` elements per dtype that no unit holds (slots.py `SlotPool.take`)."""
        return self.slots.take(need, [u.slot for u in self.units if u.slot is not None])

    @property
    def _slots(self) -> list[Slot]:
        return self.slots.slots

    @property
    def _releases(self) -> int:
        return self.slots.releases

    @_releases.setter
    def _releases(self, value: int) -> None:
        self.slots.releases = value

    def free_slots(self) -> None:
        """Let the slots and the pinned buffers of offloaded activations go (after training: the
        save phase does not hold them). Only once no CUDA graph that copies into them will be
        replayed again; the next use makes new ones.
        Gradients gathered by a backward that did not finish (an error) are dropped, not stepped."""
        self.grads.drop()
        self.release_all()
        self.slots.clear()
        self.activations.clear()

    def slot_bytes(self) -> int:
        """Bytes of the device buffers units are copied into (kept between steps)."""
        return self.slots.nbytes()

    def _rehome(self, unit: Unit) -> None:
        # Something outside moved or replaced a weight between uses (Module.to, a load with
        # assign): that tensor is the value now; it goes back to CPU memory.
        for i, p in enumerate(unit.params):
            if p.data_ptr() != unit.homes[i].data_ptr():
                unit.homes[i] = self._to_home(p.data)
                p.data = unit.homes[i]
                unit.packed = None  # the homes are no longer the buffers' views: copied one by one

    def _bind(self, unit: Unit) -> None:
        unit.await_copy(self.device)
        if not unit.bound:
            for p, view in zip(unit.params, unit.views):
                p.data = view
            unit.bound = True

    def _unbind(self, unit: Unit) -> None:
        self.grads.unbinding(unit)
        for p, home in zip(unit.params, unit.homes):
            p.data = home
        unit.bound = False

    def _evict(self, unit: Unit) -> None:
        if unit.bound:
            self._unbind(unit)
        self.grads.evicting(unit)
        for buf in unit.buffers.values():
            self._by_storage.pop(buf.untyped_storage().data_ptr(), None)
        if unit.linger is None:
            unit.release_slot(self.slots)
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
        self.grads.settle()
        self._current = None

    # ---- forward and backward boundaries -----------------------------------------------------

    def _forward_begins(self, module, args) -> None:
        self._prev["fwd"] = None
        self.grads.drop_stale()
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
        self.activations.forward_done()
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
        self.grads.set_aside()

    def _expect_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._prev["bwd"] = None
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._task = None
        self.grads.step_gathered()
        self.release_all()
        self.grads.backward_done()

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
        # the rest: activations (through `_host_buffer`, the one place a pinned buffer is chosen)
        return self.activations.pack(t, ptr, self._host_buffer)

    def _host_buffer(self, dtype: torch.dtype, numel: int) -> HostBuffer:
        """A kept pinned buffer for an offloaded save (activations.py `ActivationOffload.host_buffer`)."""
        return self.activations.host_buffer(dtype, numel)

    @property
    def _host_buffers(self) -> list[HostBuffer]:
        return self.activations.buffers

    def host_bytes(self) -> int:
        """Bytes of the pinned buffers that saved tensors are offloaded into."""
        return self.activations.host_bytes()

    def _unpack(self, packed):
        if isinstance(packed, _WeightRef):
            unit = self.units[packed.unit]
            self.use(unit)
            return unit.buffers[packed.dtype].as_strided(packed.size, packed.stride, packed.offset)
        return self.activations.unpack(packed)

    # ---- accounting -------------------------------------------------------------------------

    def streamed_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def device_copies(self) -> list[torch.Tensor]:
        """The compute-side buffers held now (empty between uses)."""
        return [b for u in self.units if u.buffers for b in u.buffers.values()]


def stream_weights(denoiser: nn.Module, device: torch.device, settings: MemoryConfig, *,
                   blocks: Sequence[str], stream_trainable: bool,
                   checkpointed: bool = False) -> Optional[WeightStreamer]:
    """Apply settings.stream_weights (every stream block but settings.resident_blocks of them) and
    offload_activations to `denoiser`, whose blocks are in its attributes `blocks` (see the package
    docstring); None when both are off. Call after LoRA is added and before the optimizer is built;
    the weights that are not streamed are moved to `device` here. `checkpointed`: the denoiser
    recomputes blocks in backward; where only frozen weights stream (not `stream_trainable`), no
    unit is then a part of a recomputed block (units.py `recomputed_whole`)."""
    whole = checkpointed and not stream_trainable
    if not (settings.stream_weights or settings.offload_activations):
        return None
    # None: a config that fit/resolve.py did not resolve streams every block, as the resolved default does
    resident = settings.resident_blocks or 0
    limit = int(settings.stream_unit_mib * 2**20)
    if settings.stream_weights and resident:  # fit/resolve.py checks it first, from the model's facts
        count = len(stream_blocks(denoiser, blocks, limit, partial(_streams, trainable=stream_trainable),
                                  keep_recomputed_whole=whole))
        problem = too_many_resident(resident, count, blocks, settings.stream_unit_mib)
        if problem:
            raise ConfigError([problem])
    return WeightStreamer(denoiser, device, blocks=blocks, stream=settings.stream_weights,
                          stream_trainable=stream_trainable, max_unit_bytes=limit,
                          offload_activations=settings.offload_activations, resident=resident,
                          sums_on_device=settings.streamed_grad_sums == "device", keep_recomputed_whole=whole)
