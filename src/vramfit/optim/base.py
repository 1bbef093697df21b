"""The base of vramfit's optimizers: fp32 math per parameter (or per pack of them), stochastic write-back.

Every optimizer vramfit offers derives from `ParamOptimizer` and implements `_init_state`,
`scalars(group, step)` (the numbers of one step that change from step to step: the learning rate
and whatever the step count sets) and `_update(p32, grad32, state, group, hyper, finite,
batch_dims)`: the new fp32 parameter from fp32 copies of one parameter and its gradient, with its
state updated, `hyper` being those scalars. The base turns that into

- `step_param(p, grad, finite=None)`: step one parameter now (`step_params` below steps many,
  packed: the loop's `step()` after backward, and optim/in_backward.py from gradient hooks
  while backward still runs). `p` may live on another device than the model's compute (streamed
  weights keep their home copy in CPU memory): the math, the state and the random generator all
  follow `p.device`, and `grad` is moved there first. `finite`, a 0-dim bool tensor on any
  device, makes the step conditional without a host sync: when it is False the parameter and
  its state keep their values (the step counter still advances).
- the write-back: a bf16 parameter is written with stochastic rounding (memory/
  stochastic_rounding.py) when the optimizer has `RoundingGenerators`, so updates smaller than
  bf16's spacing survive on average; without them, round-to-nearest. fp32 parameters are
  written as computed. bf16 moments (AdamW's state follows the parameter's dtype) are written
  back the same way.
- state_dict()/load_state_dict() that keep every state tensor in its own dtype and carry the
  rounding generators' states, so a resumed run draws the same random bits as an unbroken one.

`step()` (the loop's step after backward) does not call `step_param` one parameter at a time:
it packs parameters into few tensors and runs `_update` once per pack (`step_params`). An
optimizer whose update is elementwise (AdamW) concatenates the flattened parameters, gradients
and states of one dtype and device; one that is not (Adafactor: row and column factors, an RMS
per tensor) stacks tensors of one shape and updates the stack with a leading batch dimension.
The results are those of `step_param` for each parameter: the same math on the same values
(tests hold them to 1e-6 relative, bitwise in practice for AdamW), except that under stochastic
rounding the random bits are drawn per pack, so they differ from the per-parameter draw while
keeping its distribution. Each pack holds at most as many values as the largest parameter on
its device (or 4 Mi values, whichever is more: `pack_limit`), so the fp32 temporaries stay about
those of the largest parameter: per value stepped a pack costs a little more than one tensor
alone (measured on CPU: AdamW on bf16 weights 27 bytes against 21, Adafactor 22 against 20; the
fp32 in-place path below 4). `finite` may also be one flag per parameter (the step inside backward's
per-tensor check): the flags become a mask over the pack (per value of a concatenation, per
member of a stack; an 8-bit moment's block scales take their block's flag), so a non-finite
member keeps its value and state while the rest of its pack steps.

Where a pack would be fp32 throughout (fp32 parameters, gradients and state, as under
mixed_bf16 with AdamW) there is nothing to round, and an optimizer may instead update the
tensors in place (`_update_in_place`; AdamW does, with torch's fused AdamW kernel where torch
has one, else with foreach ops in _update's order of operations, chunked like the packs), which
saves the packing copies. The fused kernel makes no temporaries, so it takes all the tensors of
a pack key in one call, however many values they hold, and holds the whole update back on the
device where a 0-dim `finite` is False.

Cost: one pass of packing and unpacking (a copy of each parameter, gradient and state tensor)
in exchange for about ten kernel launches per pack instead of per parameter: SSD-1B's UNet has
about 1,700 tensors, which one-at-a-time stepping pays in Python overhead (milliseconds each on
the host) while the GPU idles. A step inside backward (optim/in_backward.py) packs too: it
gathers gradients up to one pack limit before stepping them (with per-parameter flags, so
always through packs, never the in-place path). fp32 temporaries are bounded as above; never a
full fp32 copy of the model.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import ContextManager, Optional

import torch

from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.stochastic_rounding import copy_stochastic_


class RoundingGenerators:
    """One seeded torch.Generator per device type ("cpu", "cuda"), made when first needed.

    Keyed by type, not by index: every rank of a data-parallel run (cuda:0, cuda:1, ...) starts
    from the same seed and rounds identically, and a state saved by rank 0, or on another GPU
    index, restores on any of them. A saved state whose device type this machine lacks waits
    until (if ever) a device of that type asks for its generator.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._by_type: dict[str, torch.Generator] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        gen = self._by_type.get(device.type)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            if device.type in self._pending:
                gen.set_state(self._pending.pop(device.type))
            self._by_type[device.type] = gen
        return gen

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self._pending, **{kind: gen.get_state() for kind, gen in self._by_type.items()}}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        for key, state in states.items():  # keys of older states name a device ("cuda:0")
            kind = torch.device(key).type
            if kind in self._by_type:
                self._by_type[kind].set_state(state.cpu())
            else:
                self._pending[kind] = state.cpu()


def scaled(a: torch.Tensor, b: torch.Tensor, alpha) -> torch.Tensor:
    """a + alpha * b, a new tensor; `alpha` a number or a 0-dim tensor (a recorded step's scalar)."""
    return torch.addcmul(a, b, alpha) if torch.is_tensor(alpha) else torch.add(a, b, alpha=alpha)


def scaled_(a: torch.Tensor, b: torch.Tensor, alpha) -> torch.Tensor:
    """a += alpha * b, in place; `alpha` as in `scaled`."""
    return a.addcmul_(b, alpha) if torch.is_tensor(alpha) else a.add_(b, alpha=alpha)


class RecordedScalars:
    """The numbers of optimizer steps recorded into a CUDA graph (train/graphs.py, with the step
    inside backward), kept on the device.

    A recording holds kernels, not Python: a learning rate or a bias correction handed to a kernel
    as a number would come back as the recording step's number at every replay. So while steps
    are recorded each of them (one parameter, or a pack) takes places for its `scalars` in one
    fp32 device tensor, and its kernels read them there. A recording runs none of its kernels, so
    `close()` counts back the step counts the recorded steps advanced. Before each replay `load()`
    counts every recorded step once, as an eager step would, works out their scalars on the host
    and puts them all in place with one host-to-device copy.

    Each place is 16 bytes from the next (one fp32 value and padding): a Triton kernel handed one
    (Adafactor's decay) then sees the 16-byte alignment a fresh tensor has, as it does eagerly.
    Triton compiles a variant per pointer alignment, and a variant first met while a graph records
    cannot be loaded (CUDA forbids loading a module during capture): the recording would fail.

    The recorded steps keep the optimizer's state and group dicts of the recording. Loading a state
    dict into the optimizer replaces those, so it must come before any recording (a resumed run
    loads its state before its first step).

    Cost: 16 bytes a scalar (up to four a step of a parameter or pack) on the device and in pinned
    host memory; the host's work per replay is a loop over the recorded steps (about 1,700 for a
    full SSD-1B UNet stepped alone, far fewer packed).
    """

    SLOT = 4  # fp32 values from one place to the next: 16 bytes

    def __init__(self, optimizer: "ParamOptimizer", device: torch.device, capacity: int):
        self.optimizer = optimizer
        self.capacity = capacity
        self.values = torch.zeros(capacity * self.SLOT, dtype=torch.float32, device=device)
        self._host = torch.zeros(capacity * self.SLOT, dtype=torch.float32, pin_memory=self.values.is_cuda)
        self._steps: list[tuple[list[dict], dict]] = []
        self._used = 0
        self._copied: Optional[torch.cuda.Event] = None  # the last load's copy; the host buffer is free after it

    def place(self, states: list[dict], group: dict) -> dict[str, torch.Tensor]:
        """The places of the scalars of a step of `states` (already counted) in `group`."""
        self._steps.append((states, group))  # first: a failure below still counts these steps back
        names = list(self.optimizer.scalars(group, states[0]["step"]))
        start, self._used = self._used, self._used + len(names)
        if self._used > self.capacity:
            raise RuntimeError(f"the recorded optimizer steps need more than {self.capacity} scalars")
        return {name: self.values[(start + i) * self.SLOT] for i, name in enumerate(names)}

    def close(self) -> None:
        """The recording ended: steps read numbers again, and the step counts go back."""
        self.optimizer._recorded = None
        for states, _ in self._steps:
            for state in states:
                state["step"] -= 1

    def load(self) -> None:
        """Before a replay: count each recorded step and put its scalars in their places."""
        numbers: list[float] = []
        for states, group in self._steps:
            for state in states:
                state["step"] += 1
            numbers.extend(self.optimizer.scalars(group, states[0]["step"]).values())
        if self._copied is not None:
            self._copied.synchronize()
        count = len(numbers) * self.SLOT
        self._host.view(-1, self.SLOT)[:len(numbers), 0] = torch.tensor(numbers, dtype=torch.float32)
        self.values[:count].copy_(self._host[:count], non_blocking=True)
        if self.values.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


class ParamOptimizer(torch.optim.Optimizer):
    """A torch Optimizer whose step is `step_param` for each parameter (see the module doc)."""

    def __init__(self, params, defaults: dict, rounding: Optional[RoundingGenerators] = None):
        super().__init__(params, defaults)
        self.rounding = rounding
        self._groups_by_param: Optional[dict[int, dict]] = None
        self._recorded: Optional[RecordedScalars] = None  # while a CUDA graph records steps
        self._counting = False
        self._counted: list[dict] = []  # the states the last `step(finite=...)` counted
        self._on_device: dict[tuple, dict[str, torch.Tensor]] = {}  # `device_scalars`, by the numbers

    def _advance(self, states: list[dict], group: dict) -> dict:
        """Count one step of each of `states` (one parameter, or a pack of them at one step
        count) and return that step's `scalars`: numbers, or while a step is recorded
        (`record_scalars`) their places on the device."""
        for state in states:
            state["step"] += 1
        if self._counting:
            self._counted.extend(states)
        if self._recorded is not None:
            return self._recorded.place(states, group)
        return self.scalars(group, states[0]["step"])

    def device_scalars(self, hyper: dict, device: torch.device) -> dict[str, torch.Tensor]:
        """A step's `scalars` as 0-dim fp32 tensors on `device`, 16 bytes apart as RecordedScalars
        places are, for kernels that read them there: a recorded step's places as they are, else
        the numbers, copied there once (one copy from pinned memory, which does not hold the host
        up) for every step that shares them (a group's parameters at one step count)."""
        if any(torch.is_tensor(v) for v in hyper.values()):
            return hyper
        key = (device, *hyper.items())
        found = self._on_device.get(key)
        if found is None:
            if len(self._on_device) >= 64:  # earlier steps' numbers (a schedule moves the learning rate)
                self._on_device.clear()
            slot = RecordedScalars.SLOT
            host = torch.zeros(len(hyper) * slot, dtype=torch.float32)
            host[::slot] = torch.tensor(list(hyper.values()), dtype=torch.float32)
            if device.type == "cuda":
                host = host.pin_memory()
            values = host.to(device, non_blocking=True)
            found = self._on_device[key] = {name: values[i * slot] for i, name in enumerate(hyper)}
        return found

    def record_scalars(self, device: torch.device, capacity: int) -> "RecordedScalars":
        """From now until `RecordedScalars.close()`, steps read their scalars from places on
        `device` (see RecordedScalars)."""
        self._recorded = RecordedScalars(self, device, capacity)
        return self._recorded

    def averaged(self) -> ContextManager:
        """A `with` block in which the model holds the weights to sample, validate and save: the
        trained ones themselves, except for a schedule-free optimizer's average (optim/wrapped.py)."""
        return nullcontext()

    def ensure_state(self, params) -> None:
        """Make the state of each of `params` that has none yet (a recording must find it)."""
        for p in params:
            if not self.state[p]:
                self.state[p].update(self._init_state(p, self._group_of(p)))

    # ---- what a subclass implements -------------------------------------------------------
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        raise NotImplementedError

    def scalars(self, group: dict, step: int) -> dict[str, float]:
        """The numbers `_update` and `step_chunked` read that change between steps (the learning
        rate, which a schedule sets, and what the step count `step` sets), by name. A recorded
        step (`record_scalars`) reads them from the device instead, so each must be used as a
        factor (`mul`, `scaled`), never as a Python number the kernel bakes in."""
        raise NotImplementedError

    def _update(self, p32: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, hyper: dict,
                finite: Optional[torch.Tensor], batch_dims: int) -> torch.Tensor:
        """The new fp32 value of the parameter, as a new tensor; `p32` is read only (for an fp32
        parameter it is the parameter itself) and each state tensor is written through
        `self._store(state[key], new_value, finite)`. `hyper`: `scalars(group, step)` of this
        step, as numbers or (a recorded step) 0-dim tensors. With `batch_dims` 1 the tensors are a
        stack of parameters of one shape along dimension 0, each to be updated on its own."""
        raise NotImplementedError

    def _in_place_kind(self, device: torch.device, finite: Optional[torch.Tensor]) -> Optional[str]:
        """Whether this optimizer updates fp32 tensors on `device` in place (`_update_in_place`),
        with or without a `finite` flag: "fused" (one kernel, no temporaries: any number of
        tensors at once), "foreach" (temporaries of the tensors stepped: bounded as packs are),
        or None (the pack's `_update`)."""
        return None

    def _update_in_place(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                         group: dict, hyper: dict, finite: Optional[torch.Tensor] = None) -> None:
        """The update of fp32 parameters with fp32 gradients and state, written in place (no
        packing copies), none of it where the 0-dim `finite` is False; called only where
        `_in_place_kind` says it can."""
        raise NotImplementedError

    # ---- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, finite: Optional[torch.Tensor] = None):
        """Step every parameter that has a gradient. `finite`: a 0-dim bool tensor, read on the
        device: where it is False no parameter or state changes (no host sync is needed before
        the step launches), and `take_back()` then undoes the step counts, which the host
        advanced."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._counted, self._counting = [], finite is not None
        try:
            self.step_params([(p, p.grad) for group in self.param_groups for p in group["params"]
                              if p.grad is not None], finite=finite)
        finally:
            self._counting = False
        return loss

    def take_back(self) -> None:
        """After a `step(finite=...)` whose flag turned out False: its step counts go back, as if
        the step had never been taken."""
        for state in self._counted:
            state["step"] -= 1
        self._counted = []

    # An update in which each element depends only on the same element of the parameter, the
    # gradient and the state (AdamW) packs by concatenation; otherwise tensors of one shape stack.
    elementwise = False
    MIN_PACK_NUMEL = 1 << 22
    # State that is a small fraction of the weights (Adafactor's row and column factors): a streamed
    # weight's state may then live on the compute device and the weight step there (memory/offload/grads.py).
    compact_state = False

    @classmethod
    def chunks_weights_of(cls, dtype: torch.dtype) -> bool:
        """Whether this optimizer steps large weights of `dtype` in chunks (`chunks` says which
        tensors): by class, so that the planner can tell before any weight exists."""
        return False

    def chunks(self, p: torch.Tensor) -> bool:
        """Whether `step_chunked` can step `p`: an optimizer that implements it says so for tensors
        of more than MIN_PACK_NUMEL values. The base steps every tensor whole."""
        return False

    def step_chunked(self, p: torch.Tensor, grad: "ChunkedGrad", max_norm: float = 0.0) -> torch.Tensor:
        """Step `p` reading its gradient in row chunks (ChunkedGrad), so that no fp32 temporary
        holds more than about MIN_PACK_NUMEL values (see `chunks`). With `max_norm` > 0 the
        gradient is first scaled as clip_grad_norm_ would scale it to that norm. Returns the
        finite flag (0-dim bool tensor): when False, `p` and its state keep their values."""
        raise NotImplementedError

    def _chunkable(self, p: torch.Tensor, above: Optional[int] = None) -> bool:
        """A dense contiguous tensor of more than `above` values (default MIN_PACK_NUMEL) whose
        [shape[0], rest] rows each fit in MIN_PACK_NUMEL (a chunk is whole rows)."""
        above = self.MIN_PACK_NUMEL if above is None else above
        return (p.dim() >= 1 and p.numel() > above and p.numel() // p.shape[0] <= self.MIN_PACK_NUMEL
                and type(p.data) is torch.Tensor and p.is_contiguous())

    def _begin_chunked(self, p: torch.Tensor, grad: "ChunkedGrad") -> tuple[dict, dict, dict, list[tuple[int, int]]]:
        """(group, state with the step counted, the step's scalars, row spans) of a chunked step of `p`."""
        group, state = self._group_of(p), self.state[p]
        if not state:
            state.update(self._init_state(p, group))
        hyper = self._advance([state], group)
        return group, state, hyper, grad.spans(self.MIN_PACK_NUMEL)

    def follow(self, p: torch.Tensor) -> None:
        """Move `p`'s state tensors to `p`'s device where they are elsewhere (a streamed weight's
        state, loaded next to its CPU home, whose step runs on the compute device)."""
        state = self.state.get(p)
        for key, value in (state or {}).items():
            if torch.is_tensor(value) and value.device != p.device:
                state[key] = value.to(p.device)

    def pack_limit(self, params) -> int:
        """The most values one pack of these parameters holds: the largest of them, or
        MIN_PACK_NUMEL, whichever is more."""
        return max(self.MIN_PACK_NUMEL, max((p.numel() for p in params), default=0))

    def pack_key(self, p: torch.Tensor) -> tuple:
        """What the parameters of one pack share besides their group, step count and state layout:
        the device and dtype, and the shape unless the update is elementwise (Adafactor's
        factored one is not)."""
        return p.device, p.dtype, None if self.elementwise else tuple(p.shape)

    @torch.no_grad()
    def step_params(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], finite=None) -> None:
        """Step every (parameter, gradient) pair, packed as the module docstring says. `finite`:
        None, one 0-dim bool tensor for every pair, or a list of them, one per pair (each
        parameter is then held back or applied on its own, packed or not). Packs are bounded by
        `pack_limit` of the pairs' parameters on each device."""
        per_member = isinstance(finite, list)
        flags = finite if per_member else [finite] * len(pairs)
        packs: dict[tuple, list[int]] = {}
        storages: set[tuple] = set()
        for index, (p, grad) in enumerate(pairs):
            group, state = self._group_of(p), self.state[p]
            if not state:
                state.update(self._init_state(p, group))
            layout = tuple((k, _layout(v)) for k, v in state.items() if torch.is_tensor(v))
            # a sharded parameter (FSDP's DTensor), state this base cannot pack, or a second parameter
            # over the same memory as one already packed (a pack reads all before it writes; views
            # of one storage that start apart, such as a split qkv, still pack) steps by itself
            storage = (p.device, p.data_ptr()) if type(p.data) is torch.Tensor else None
            if storage is None or storage in storages or any(kind is None for _, kind in layout):
                key = ("alone", id(p))
            else:
                key = (id(group), *self.pack_key(p), state["step"], layout)
                storages.add(storage)
            packs.setdefault(key, []).append(index)
        # the bound of each device's packs: its own largest parameter (streamed weights, updated in
        # CPU memory, do not set the size of the device's packs)
        limits = {device: self.pack_limit([p for p, _ in pairs if p.device == device])
                  for device in {p.device for p, _ in pairs}}
        for key, indices in packs.items():
            if key[0] == "alone":
                self.step_param(*pairs[indices[0]], finite=flags[indices[0]])
                continue
            members = [pairs[i] for i in indices]
            in_place = None if per_member else self._in_place(members, finite)
            if in_place == "fused":
                self._step_pack(members, finite, in_place)  # no temporaries, so no bound: one update of them all
                continue
            chunks: list[list[int]] = [[]]
            size = 0
            bound = limits[pairs[indices[0]][0].device]
            for index in indices:
                numel = pairs[index][0].numel()
                if chunks[-1] and size + numel > bound:
                    chunks.append([])
                    size = 0
                chunks[-1].append(index)
                size += numel
            for chunk in chunks:
                self._step_pack([pairs[i] for i in chunk], [flags[i] for i in chunk] if per_member else finite)

    def _in_place(self, members: list[tuple[torch.Tensor, torch.Tensor]], finite) -> Optional[str]:
        """How these members can step in place (`_in_place_kind`): where they are fp32 throughout
        (parameters, gradients and plain state tensors, on one device) there is nothing to round,
        so the update may write the tensors themselves instead of a pack. None where not."""
        if isinstance(finite, list) or self._recorded is not None:
            return None
        device = members[0][0].device
        state = [v for p, _ in members for v in self.state[p].values() if torch.is_tensor(v)]
        if not all(type(t) is torch.Tensor for t in state) or not all(  # 8-bit moments are not
                t.dtype == torch.float32 and t.device == device for t in [*(t for m in members for t in m), *state]):
            return None
        return self._in_place_kind(device, finite)

    def _step_pack(self, members: list[tuple[torch.Tensor, torch.Tensor]], finite, in_place: Optional[str] = None) -> None:
        """One `_update` for the members, or one update in place; `finite` as in step_params (a
        list: one per member). `in_place`: what `_in_place` said of these members, where the
        caller asked it already."""
        in_place = in_place or self._in_place(members, finite)
        if len(members) == 1 and in_place is None:
            self.step_param(*members[0], finite=finite[0] if isinstance(finite, list) else finite)
            return
        params = [p for p, _ in members]
        device = params[0].device
        async_copy = device.type == "cuda"
        states = [self.state[p] for p in params]
        group = self._group_of(params[0])
        hyper = self._advance(states, group)
        grads = [g for _, g in members]
        if in_place is not None:
            self._update_in_place(params, grads, states, group, hyper,
                                  None if finite is None else finite.to(device, non_blocking=async_copy))
            return
        flat = self.elementwise
        if isinstance(finite, list):
            finite = _member_mask(finite, params, flat, device, async_copy)
        elif finite is not None:
            finite = finite.to(device, non_blocking=async_copy)

        def pack(tensors):
            return torch.cat([t.reshape(-1) for t in tensors]) if flat else torch.stack(list(tensors))

        packed_p = pack(params)
        grads = pack([g.to(device, non_blocking=async_copy) for g in grads]).float()
        packed_state: dict = {"step": states[0]["step"]}
        for key, value in states[0].items():
            if torch.is_tensor(value):
                packed_state[key] = _pack_state([s[key] for s in states], pack)
        new = self._update(packed_p.float(), grads, packed_state, group, hyper, finite, batch_dims=0 if flat else 1)
        self._store(packed_p, new, finite)
        _unpack_into(params, packed_p, flat)
        for key, value in packed_state.items():
            if torch.is_tensor(value):
                _unpack_into([s[key] for s in states], value, flat)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, grad: torch.Tensor, finite: Optional[torch.Tensor] = None) -> None:
        """Update parameter `p` with gradient `grad` now (see the module docstring)."""
        group = self._group_of(p)
        state = self.state[p]
        if not state:
            state.update(self._init_state(p, group))
        hyper = self._advance([state], group)
        # A copy to the GPU may be asynchronous; one to the CPU must not be (the CPU math would
        # read it before it lands).
        async_copy = p.device.type == "cuda"
        if finite is not None:
            finite = finite.to(p.device, non_blocking=async_copy)
        grad = grad.to(p.device, torch.float32, non_blocking=async_copy)
        new = self._update(p.float(), grad, state, group, hyper, finite, batch_dims=0)
        self._store(p, new, finite)

    def _store(self, dst: torch.Tensor, value: torch.Tensor, finite: Optional[torch.Tensor]) -> None:
        """Write the fp32 `value` into `dst` (a parameter or a state tensor), unless not finite.
        `finite` is 0-dim, or a pack's mask (_member_mask): per value of a flat pack, [B, 1, ...]
        for a stack of B, whose per-member state ([B, n]: Adafactor's factors) takes it as [B, 1]."""
        if finite is not None and finite.dim():
            finite = finite.view(finite.shape[0], *[1] * (dst.dim() - 1))
        if getattr(dst, "codes", None) is not None:  # block-quantized state (optim/adamw.py)
            old = (dst.codes.clone(), dst.scale.clone()) if finite is not None else None
            dst.copy_(value)  # quantizes
            if old is not None:
                keep, keep_scale = finite, finite
                if finite.dim():  # the codes take the mask per value, each block's scale its first value's
                    keep = finite.expand(dst.codes.shape)
                    keep_scale = keep.reshape(-1, dst.block_size)[:, 0].view(dst.scale.shape)
                dst.codes.copy_(torch.where(keep, dst.codes, old[0]))
                dst.scale.copy_(torch.where(keep_scale, dst.scale, old[1]))
            return
        rounds = self.rounding is not None and dst.dtype == torch.bfloat16
        if rounds and (finite is None or finite.dim() == 0):  # the flag goes with the rounding (one kernel on a GPU)
            copy_stochastic_(dst, value, self.rounding(dst.device), finite)
            return
        if finite is not None:
            if not rounds and value.dtype == dst.dtype and value.shape == dst.shape:
                torch.where(finite, value, dst, out=dst)  # one kernel: the masked write itself
                return
            value = torch.where(finite, value, dst)  # fp32 (promoted); dst's own value rounds to itself
        if rounds:
            copy_stochastic_(dst, value, self.rounding(dst.device))
        else:
            dst.copy_(value)

    def _group_of(self, p: torch.Tensor) -> dict:
        if self._groups_by_param is None:
            self._groups_by_param = {id(q): g for g in self.param_groups for q in g["params"]}
        return self._groups_by_param[id(p)]

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._groups_by_param = None

    # ---- saving ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        saved = super().state_dict()
        if self.rounding is not None:
            saved["rounding_generators"] = self.rounding.state_dict()
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating state to each parameter's dtype (an fp32 Adafactor factor
        of a bf16 weight would come back bf16); put every saved tensor back in its own dtype, on
        the parameter's device."""
        saved = dict(state_dict)
        generators = saved.pop("rounding_generators", None)
        super().load_state_dict(saved)
        self._groups_by_param = None
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in saved["state"].items():
            live = self.state[params[index]]
            for key, value in values.items():
                if torch.is_tensor(value):
                    live[key] = value.to(params[index].device)
        if generators is not None and self.rounding is not None:
            self.rounding.load_state_dict(generators)


def norm_checks(norm: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(finite flag, clipping factor) of a gradient whose L2 norm is `norm` (or of several: a
    vector of norms): the flag in one kernel (a norm is >= 0 or NaN, so `norm < inf`, where
    isfinite takes four), and with `max_norm` > 0 clip_grad_norm_'s factor
    min(1, max_norm / (norm + 1e-6)), else None."""
    scale = (max_norm / (norm + 1e-6)).clamp_(max=1.0) if max_norm > 0 else None
    return norm < math.inf, scale


class ChunkedGrad:
    """A parameter's gradient read in chunks of whole rows (of its [shape[0], rest] matrix view) as
    new fp32 tensors: the sum of `parts` (tensors of the parameter's shape in any float dtype, such
    as a bf16 accumulation buffer and the fresh bf16 gradient). Each chunk holds the values the
    whole fp32 gradient would hold there (`buffer.float() + grad`), so a chunked step computes
    what a whole one does, without an fp32 copy of the whole gradient."""

    def __init__(self, parts: list[torch.Tensor]):
        rows = parts[0].shape[0]
        self.parts = [t.reshape(rows, -1) for t in parts]
        self.shape = self.parts[0].shape

    def spans(self, numel: int) -> list[tuple[int, int]]:
        """Row ranges [start, stop) of at most `numel` values each (at least one row)."""
        rows, cols = self.shape
        step = max(1, numel // max(cols, 1))
        return [(start, min(start + step, rows)) for start in range(0, rows, step)]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        out = self.parts[0][start:stop].to(torch.float32, copy=True)
        for extra in self.parts[1:]:
            out.add_(extra[start:stop])
        return out

    def times(self, factor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """`factor` (a new fp32 tensor of the rows' shape) times the rows, in place: a single part
        is read as it is (widened inside the kernel, exactly), with no fp32 copy of its own."""
        if len(self.parts) == 1:
            return factor.mul_(self.parts[0][start:stop])
        return factor.mul_(self.rows(start, stop))


def _layout(t: torch.Tensor) -> Optional[tuple]:
    """What must agree for state tensors to share a pack; None for one that cannot be packed."""
    codes = getattr(t, "codes", None)
    if codes is None:
        return (t.dtype,) if type(t) is torch.Tensor else None
    if t.block_size and codes.numel() % t.block_size == 0:  # blocks never straddle two tensors
        return ("8bit", t.signed, t.block_size, t.dtype)
    return None


def _member_mask(flags: list[torch.Tensor], params: list[torch.Tensor], flat: bool, device: torch.device,
                 async_copy: bool) -> torch.Tensor:
    """Members' 0-dim finite flags as a mask that broadcasts against their pack: one value per
    element of a flat pack, [B, 1, ...] for a stack. Built from expanded views rather than
    repeat_interleave, whose repeats would be a host-to-device copy that waits for the device."""
    flags = [f.to(device, non_blocking=async_copy) for f in flags]
    if not flat:
        return torch.stack(flags).view(-1, *[1] * params[0].dim())
    return torch.cat([f.expand(p.numel()) for f, p in zip(flags, params)])


def _pack_state(tensors: list[torch.Tensor], pack) -> torch.Tensor:
    first = tensors[0]
    if getattr(first, "codes", None) is None:
        return pack(tensors)
    return type(first)(pack([t.codes for t in tensors]), torch.cat([t.scale for t in tensors]), first.qmap,
                       first.signed, dtype=first.dtype)


def _unpack_into(targets: list[torch.Tensor], packed: torch.Tensor, flat: bool) -> None:
    """Copy a pack's values back into the tensors it was made of."""
    if getattr(packed, "codes", None) is not None:
        _unpack_into([t.codes for t in targets], packed.codes, flat)
        _unpack_into([t.scale for t in targets], packed.scale, True)
        return
    if flat:
        parts = torch.split(packed, [t.numel() for t in targets])
        views = [part.view(t.shape) for part, t in zip(parts, targets)]
    else:
        views = list(packed.unbind(0))
    torch._foreach_copy_(targets, views)


def fp32(t: torch.Tensor) -> torch.Tensor:
    """A state tensor's value in float32 (block-quantized state is dequantized)."""
    return t.dequantize() if getattr(t, "codes", None) is not None else t.float()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in optimizer state tensors (for the it-saves tests and the planner)."""
    return sum(tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))
