"""Gradients of streamed weights (full fine-tune): home to pinned CPU memory, or a step on the device.

Moving home. A post-accumulate-grad hook (`grad_ready`, registered by the streamer when it is
built, before the loop's own hooks, so it sees the gradient first) moves each gradient to pinned
CPU memory on the copy-home stream and frees the device copy. When backward ends they are handed
to the home parameters through autograd's own accumulation (`deliver`: a small backward into the
CPU leaves), so `p.grad` is a CPU tensor summed exactly as autograd sums micro-batches, and every
other post-accumulate-grad hook (accumulation with stochastic rounding, the optimizer step in
backward) runs on the CPU parameter as it would on a device one. The loop's clipping and
`optimizer.step()` then run on the CPU for these parameters.

Stepping on the device (`steps` set: the loop turns it on for the step in backward with an
optimizer of compact state, Adafactor). In the backward that steps, a streamed weight's complete
gradient is not moved home: the weight steps on its compute copy on the device, with the unit's
other gradients that arrive together (through optim/in_backward.py `step_now`, so clipping, the
finite check, packing and chunks are those of resident weights), and the new values are copied to
their homes on the copy-home stream; the next fetch of the unit waits for that copy. Its optimizer
state moves to the device at its first such step and stays there. The compute copy must still
exist when the gradient arrives: a unit evicted while autograd still holds its copy (a
checkpointed block's recomputed weights) and while some of its gradients are still to come is
kept (`linger`) until they have stepped, which costs nothing while autograd holds that memory
anyway (a kept copy autograd has let go of is dropped at the next eviction); a weight whose copy
nothing kept (a projection whose input needs no gradient, such as cross-attention's keys and
values of the text; under mixed_bf16 most weights, since autocast saves its bf16 casts instead)
is fetched again alone, on the compute stream.

Accumulation (several micro-batches a step) while stepping on the device. `sums_on_device` off
(memory.streamed_grad_sums = "home"): the gradients of the earlier micro-batches are copied home
into a few kept pinned sheets and added on the CPU, by a worker thread while backward goes on
(staging.py), into kept sums in pinned CPU memory (a buffer per dtype a unit, the first gradient
copied in; all exactly their size: memory/pinned.py): fp32 for bf16 gradients with
train.stochastic_rounding, so the sum is exact and needs no rounding pass (a plain add: about a
tenth of the cost of the fp32 add with stochastic rounding the hooks' bf16 sums pay), else in the
gradient's dtype, as autograd would sum them. When the last micro-batch steps the sum goes to the
device with it: a bf16 gradient's fp32 sum as a part the step adds in fp32 (moved there one tensor
at a time, by `step_now`), else added into the gradient. A weight whose gradient came only from
earlier micro-batches hands its sum to the hooks' `finish`. Costs the streamed trained weights'
values in the sum's dtype of pinned CPU memory, kept, and the sheets (staging.py SHEETS x the
largest unit's values). On ("device"):
they stay on the device, added into kept sums (one buffer per dtype a unit, made at the first
gradient of that unit and kept, as slots are, until `drop`) as each gradient arrives: bf16 with
train.stochastic_rounding as optim/in_backward.py sums (fp32 add, stochastic rounding), else added
in the gradient's dtype. The last micro-batch's gradient steps with its sum (bf16 sums: added in
fp32 by the step, as a buffer is), and the sum is zeroed after the step. A weight whose gradient
came only from earlier micro-batches has its sum handed home as `p.grad` when backward ends, where
the step after it (`finish`) steps it. A skipped step (the hooks' `discard`) zeroes the sums at
the next backward. Costs the streamed trained weights' gradient bytes on the device, kept; saves
the copies home and back and the CPU's additions (in bf16 over a billion values: seconds).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch import nn

from vramfit.memory import pinned
from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.offload.slots import SlotPool, layout, use_count
from vramfit.memory.offload.staging import StagedSums, copy_home
from vramfit.memory.offload.units import StreamStats, Unit


class GradsHome:
    """The gradients of the trained weights of `units`: moved home, or stepped on the device.
    The streamer calls it at its boundaries (`set_aside`, `step_gathered`, `backward_done`,
    `evicting`, `settle`, `drop_stale`) and tells it whether a backward runs (`in_backward`) and
    that one must be awaited (`expect_end_of_backward`)."""

    def __init__(self, units: list[Unit], device: torch.device, *, side, back, stats: StreamStats,
                 slots: SlotPool, expect_end_of_backward: Callable[[], None],
                 in_backward: Callable[[], bool], sums_on_device: bool = False):
        self.units, self.device, self.stats, self.slots = units, device, stats, slots
        self.cuda = device.type == "cuda"
        self.side, self.back = side, back  # the copy streams: to the device, and home
        self._expect_end_of_backward = expect_end_of_backward
        self._in_backward = in_backward
        self._stash: dict[nn.Parameter, Optional[torch.Tensor]] = {}
        self._moved: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._delivering = False
        self.recording = False  # inside a CUDA graph's recording (train/graphs.py): no host syncs
        self.trainable = [p for u in self.units for p in u.params if p.requires_grad]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self.steps = None  # optim/in_backward.py BackwardSteps that steps streamed weights on the device
        self._stepped: set[int] = set()  # streamed weights stepped in the running backward
        self._lingering: list[Unit] = []
        self._gathering: Optional[Unit] = None  # the unit whose gradients arrive now
        # accumulation on the device (`sums_on_device`): per unit index, its kept sums (buffers per
        # dtype, a view per trained weight); the weights whose sum holds a gradient; the hooks'
        # `discarded` count the sums are of
        self.sums_on_device = sums_on_device
        self._sums: dict[int, tuple[dict[torch.dtype, torch.Tensor], dict[int, torch.Tensor]]] = {}
        self._summed: set[int] = set()
        self._discards_seen = 0
        # accumulation at home (`sums_on_device` off, stepping on the device): per unit index, its kept
        # sums in (pinned) CPU memory, likewise; the weights whose home sum holds a gradient; the copies
        # home of this backward's gradients, added into the sums when it ends
        self._home: dict[int, tuple[dict[torch.dtype, torch.Tensor], dict[int, torch.Tensor]]] = {}
        self._home_summed: set[int] = set()
        self._staging: Optional[StagedSums] = None  # on CUDA: the copies home on their way into the sums
        # `share_home_sums`: one set of home sums for every unit, and its buffers (made at first use)
        self._share_home = False
        self._shared_home: Optional[dict[torch.dtype, torch.Tensor]] = None

    # ---- boundaries the streamer calls ---------------------------------------------------------

    def set_aside(self) -> None:
        """At the start of a backward: the CPU gradients step aside until it ends (autograd must not
        add a device gradient to a CPU one)."""
        for p in self.trainable:
            self._stash[p] = p.grad
            p.grad = None
        if self.steps is not None and self.steps.discarded != self._discards_seen:
            self._discards_seen = self.steps.discarded  # a skipped step: its sums are not this one's
            self._zero_sums()
            self._home_summed.clear()

    def step_gathered(self) -> None:
        """At the end of a backward: step the unit whose gradients were arriving last."""
        if self._gathering is not None and self._gathering.to_step:  # a weight fetched alone, say
            self._step_unit(self._gathering)
        self._gathering = None

    def backward_done(self) -> None:
        """After the streamer let every unit go at the end of a backward: hand the gradients home."""
        if self._stepped or (self.steps is not None and self.steps.stepping):
            self._hand_sums_home()
        self._stepped.clear()
        self._deliver_grads()

    def drop_stale(self) -> None:
        """At a forward's start: drop what a backward that stepped on the device and did not
        finish left behind."""
        if self._stepped or self._lingering:  # a backward that stepped on the device did not finish
            self.drop()

    def drop(self) -> None:
        """Gradients gathered by a backward that did not finish (an error) are dropped, not stepped;
        the sums on the device go (made again at the next gradient)."""
        for unit in self.units:
            unit.to_step.clear()
        self._drop_lingering()
        self._stepped.clear()
        self._gathering = None
        self._sums.clear()
        self._summed.clear()
        if self._staging is not None:
            self._staging.drop()  # no addition into the sums still runs before they go
        self._home.clear()
        self._home_summed.clear()
        self._shared_home = None  # made again at the next gradient, as the others

    def unbinding(self, unit: Unit) -> None:
        """`unit` stops being the compute copy: its gathered gradients step now."""
        if unit.to_step:
            self._step_unit(unit)

    def evicting(self, unit: Unit) -> None:
        """`unit` leaves the device: its gathered gradients step, its copy is kept where autograd
        holds it and gradients are to come; kept copies autograd let go of are dropped."""
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
                self.let_go(other)

    def settle(self) -> None:
        """Every kept copy's gradients step, and the copies go."""
        for unit in list(self._lingering):  # a step may drop it from the list
            if unit.to_step:
                self._step_unit(unit)
        self._drop_lingering()

    def let_go(self, unit: Unit) -> None:
        """Stop keeping `unit`'s copy for its gradients, if it is kept."""
        if unit.linger is not None:
            unit.linger = None
            self._lingering.remove(unit)
            unit.release_slot(self.slots)

    def _drop_lingering(self) -> None:
        for unit in self._lingering:
            unit.linger = None
            unit.release_slot(self.slots)
        self._lingering.clear()

    # ---- gradients of streamed weights --------------------------------------------------------

    @torch.no_grad()
    def grad_ready(self, p: nn.Parameter) -> None:
        """The post-accumulate-grad hook of a streamed trained weight."""
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
            unit.to_step.append((p, self._with_sum(p, grad)))
            self._stepped.add(id(p))
            return
        if self.sums_on_device and self.steps is not None:
            self._add_to_sum(unit, p, grad)
            return
        self.stats.grads_moved += 1
        if self.steps is not None:  # into its sum at home: behind its copy there (on the CPU: now)
            first = id(p) not in self._home_summed
            self._home_summed.add(id(p))
            total = self._home_sum_of(id(p))
            if self.cuda:
                self._staged_sums().add(total, grad, unit, first)
            elif first:
                total.copy_(grad)
            else:
                total.add_(grad)
            return
        self._moved.append((p, self._copy_home(grad)))

    def _copy_home(self, grad: torch.Tensor) -> torch.Tensor:
        """A new CPU tensor (pinned on CUDA) that `grad` is copied into, on the copy-home stream."""
        host = torch.empty(grad.size(), dtype=grad.dtype, pin_memory=self.cuda)
        copy_home(host, grad, self.back if self.cuda else None)
        return host

    def _fetch_alone(self, unit: Unit, p: nn.Parameter) -> Unit:
        """A one-weight unit holding a new compute copy of `p` (whose own unit holds none now)."""
        home = unit.homes[unit.position(p)]
        if self.cuda and unit.homed is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.homed)
        copy = home.to(self.device, non_blocking=True) if self.cuda else home.clone()
        self.stats.fetched(tensor_bytes(copy))
        self.stats.released(tensor_bytes(copy))
        return Unit(unit.index, unit.name, [p], [home], tensor_bytes(copy),
                    linger=({copy.dtype: copy}, [copy]), owner=unit)

    @staticmethod
    def _shared(buffers: dict, own_refs: dict) -> bool:
        """Whether tensors other than the streamer's own views share one of these buffers."""
        return any(use_count(buf) > own_refs[dtype] for dtype, buf in buffers.items())

    @staticmethod
    def _copy_of(unit: Unit) -> Optional[tuple]:
        """(buffers, views) of the unit's compute copy: fetched, or kept for its gradients; or None."""
        if unit.buffers is not None:
            return unit.buffers, unit.views
        return unit.linger

    def _awaits_grads(self, unit: Unit) -> bool:
        """In the backward that steps on the device, whether a trained weight of `unit` has not
        had its gradient yet."""
        return (self.steps is not None and self.steps.stepping and self._in_backward()
                and any(p.requires_grad and id(p) not in self._stepped for p in unit.params))

    def _step_unit(self, unit: Unit) -> None:
        """Step the unit's weights whose gradients are complete on their compute copies, then copy
        the new values home on the back stream."""
        pairs, unit.to_step = unit.to_step, []
        if self._gathering is unit:
            self._gathering = None
        if unit.buffers is not None:  # a prefetched copy may not have been used (and waited for) yet
            unit.await_copy(self.device)
        _, views = self._copy_of(unit)
        bound = [p.data for p, _ in pairs]
        positions = [unit.position(p) for p, _ in pairs]
        for (p, _), i in zip(pairs, positions):
            p.data = views[i]  # already so while the unit is bound
        self.steps.step_now(pairs)
        self.stats.stepped_on_device += len(pairs)
        self._zero_sums([p for p, _ in pairs])
        # A copy of one weight fetched alone is the allocator's memory, which the compute stream
        # reuses as soon as it is dropped: its copy home runs on the compute stream, so that no
        # later kernel overwrites it first (a small copy, for that weight only). A slot is not
        # reused before the copy-home stream is done with it (the streamer's fetch): the rest go there.
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
            self.let_go(unit)

    # ---- sums of earlier micro-batches on the device -----------------------------------------

    def _sum_views(self, unit: Unit) -> dict[int, torch.Tensor]:
        """The unit's kept sums, a view per trained weight (by id); made, zeroed, at first use."""
        kept = self._sums.get(unit.index)
        if kept is None:
            trained = [p for p in unit.params if p.requires_grad]
            kept = self._sums[unit.index] = _kept_sums(trained, {id(p): p.dtype for p in trained},
                                                       device=self.device)
        return kept[1]

    def _add_to_sum(self, unit: Unit, p: nn.Parameter, grad: torch.Tensor) -> None:
        """An earlier micro-batch's gradient of `p` into its sum on the device, summed as the step's
        hooks sum (optim/in_backward.py): bf16 with round_sums in fp32 with stochastic rounding.
        Off the GPU the first gradient is copied in (no rounding pass, no draws), as the hooks do."""
        total = self._sum_views(unit)[id(p)]
        if id(p) not in self._summed and self.device.type not in self.steps.UNIFORM_ON:
            total.copy_(grad)
        elif self.steps.round_sums and grad.dtype == torch.bfloat16:
            self.steps.add_to_sum(total, grad)
        else:
            total.add_(grad)
        self._summed.add(id(p))
        self.stats.grads_summed += 1

    def _with_sum(self, p: nn.Parameter, grad: torch.Tensor):
        """The last micro-batch's gradient of `p` with the sum of the earlier ones: added into it in
        its dtype, or for a bf16 sum of round_sums (or an fp32 sum at home) the two as parts the step
        adds in fp32 (a part at home is moved to the device by the step)."""
        if id(p) in self._home_summed:
            self._home_summed.discard(id(p))
            total = self._home_sum_of(id(p))
            if total.dtype != grad.dtype:
                return [grad, total]
            return grad.add_(total.to(grad.device, non_blocking=True))
        if id(p) not in self._summed:
            return grad
        total = self._sum_of(id(p))
        if self.steps.round_sums and grad.dtype == torch.bfloat16:
            return [grad, total]
        return grad.add_(total)

    def _zero_sums(self, params: Optional[list[nn.Parameter]] = None) -> None:
        """Zero the sums of `params` (all when None) that hold a gradient."""
        ids = set(self._summed) if params is None else self._summed & {id(p) for p in params}
        if ids:
            torch._foreach_zero_([self._sum_of(key) for key in ids])
            self._summed -= ids

    def _sum_of(self, key: int) -> torch.Tensor:
        """The kept sum of the weight whose id is `key`."""
        return self._sums[self._unit_of[key].index][1][key]

    def _hand_sums_home(self) -> None:
        """After the backward that steps: a weight with a sum and no gradient in it (used in
        earlier micro-batches only) gets its sum as `p.grad` in CPU memory, for the hooks' `finish`."""
        left = [p for p in self.trainable if id(p) in self._summed and id(p) not in self._stepped]
        for p in left:
            total = self._sum_of(id(p)).to(p.device, copy=True)  # the sum is zeroed below
            self._stash[p] = total if self._stash.get(p) is None else self._stash[p].add_(total)
        self._zero_sums(left)
        # at home: lent to the hooks, which step it in `finish` before the next gradient is copied in
        for p in [p for p in self.trainable if id(p) in self._home_summed and id(p) not in self._stepped]:
            self._home_summed.discard(id(p))
            self.steps.add_sum(p, self._home_sum_of(id(p)))

    # ---- sums of earlier micro-batches at home ----------------------------------------------------

    def _home_sum_dtype(self, p: nn.Parameter) -> torch.dtype:
        """fp32 for a bf16 gradient the hooks would sum with stochastic rounding, else its own."""
        return torch.float32 if p.dtype == torch.bfloat16 and self.steps.round_sums else p.dtype

    def share_home_sums(self) -> None:
        """Give every unit's sums at home the same buffers, as large as the largest unit's: for the fit
        probe's stand-in, which measures GPU memory and whose sums' values matter to nothing, so that
        it does not hold a sum per streamed value (twice the streamed weights' bytes for bf16 weights
        summed in fp32) in CPU memory beside the real model. The copies and additions stay the same."""
        self._share_home = True

    def _home_sum_of(self, key: int) -> torch.Tensor:
        """The kept sum at home of the weight whose id is `key` (made at its unit's first use)."""
        unit = self._unit_of[key]
        kept = self._home.get(unit.index)
        if kept is None:
            trained = [p for p in unit.params if p.requires_grad]
            dtypes = {id(p): self._home_sum_dtype(p) for p in trained}
            if not self._share_home:
                buffers = _zeroed(_sizes(trained, dtypes), pin=self.cuda, device=self.device)
            else:
                buffers = self._shared_sum_buffers()
            kept = self._home[unit.index] = buffers, _views(buffers, trained, dtypes)
        return kept[1][key]

    def _shared_sum_buffers(self) -> dict[torch.dtype, torch.Tensor]:
        """`share_home_sums`' buffers: per dtype the largest unit's count (made at first use, when the
        hooks that decide the sums' dtypes are set)."""
        if self._shared_home is None:
            sizes: dict[torch.dtype, int] = {}
            for unit in self.units:
                trained = [p for p in unit.params if p.requires_grad]
                for dtype, n in _sizes(trained, {id(p): self._home_sum_dtype(p) for p in trained}).items():
                    sizes[dtype] = max(sizes.get(dtype, 0), n)
            self._shared_home = _zeroed(sizes, pin=self.cuda, device=self.device)
        return self._shared_home

    def _staged_sums(self) -> StagedSums:
        """The sheets gradients wait in between their copy home and their sum (staging.py), as
        large as the largest unit's trained values of each dtype; made at first use."""
        if self._staging is None:
            sizes: dict[torch.dtype, int] = {}
            for unit in self.units:
                for dtype, n in layout([p for p in unit.params if p.requires_grad]).items():
                    sizes[dtype] = max(sizes.get(dtype, 0), n)
            self._staging = StagedSums(sizes, self.back, self.device)
        return self._staging

    def staging_bytes(self) -> int:
        """Pinned bytes of the sheets gradients wait in on their way into the sums at home."""
        return 0 if self._staging is None else self._staging.nbytes()

    def home_sum_buffers(self) -> list[torch.Tensor]:
        """The kept sums in CPU memory (a buffer per dtype a unit; shared ones once)."""
        seen = {id(b): b for buffers, _ in self._home.values() for b in buffers.values()}
        return list(seen.values())

    def home_sum_bytes(self) -> int:
        """Bytes of the kept sums in CPU memory."""
        return sum(tensor_bytes(b) for b in self.home_sum_buffers())

    def sum_buffers(self) -> list[torch.Tensor]:
        """The kept sums on the device (a buffer per dtype a unit)."""
        return [b for buffers, _ in self._sums.values() for b in buffers.values()]

    def sum_bytes(self) -> int:
        """Bytes of the kept sums on the device."""
        return sum(tensor_bytes(b) for b in self.sum_buffers())

    def _deliver_grads(self) -> None:
        """Hand the moved gradients to the home parameters through autograd's accumulation."""
        if self.cuda and not self.recording:
            self.side.synchronize()  # no copy may still read a home the optimizer will change
            self.back.synchronize()
        if self._staging is not None:
            self._staging.wait()  # every earlier micro-batch's gradient in its sum
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


def _kept_sums(params: list[nn.Parameter], dtypes: dict[int, torch.dtype], *, device=None, pin: bool = False):
    """Zeroed buffers, one per dtype (of `dtypes`, by parameter id), and a view of them per parameter:
    on `device`, or with `pin` in pinned CPU memory for copies to and from `device`."""
    buffers = _zeroed(_sizes(params, dtypes), pin=pin, device=device)
    return buffers, _views(buffers, params, dtypes)


def _sizes(params: list[nn.Parameter], dtypes: dict[int, torch.dtype]) -> dict[torch.dtype, int]:
    """Values per dtype of `params`' sums (`dtypes` by parameter id)."""
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[dtypes[id(p)]] = sizes.get(dtypes[id(p)], 0) + p.numel()
    return sizes


def _zeroed(sizes: dict[torch.dtype, int], *, pin: bool, device) -> dict[torch.dtype, torch.Tensor]:
    return {dtype: pinned.zeros(n, dtype, device=device) if pin else torch.zeros(n, dtype=dtype, device=device)
            for dtype, n in sizes.items()}


def _views(buffers: dict[torch.dtype, torch.Tensor], params: list[nn.Parameter],
           dtypes: dict[int, torch.dtype]) -> dict[int, torch.Tensor]:
    """A view of `buffers` per parameter (by id), in order from each dtype's start."""
    offsets = dict.fromkeys(buffers, 0)
    views = {}
    for p in params:
        dtype = dtypes[id(p)]
        views[id(p)] = buffers[dtype].narrow(0, offsets[dtype], p.numel()).view(p.shape)
        offsets[dtype] += p.numel()
    return views