"""Gradient hooks: bf16 gradient accumulation with stochastic rounding, and the optimizer step
inside backward.

`BackwardSteps` puts one post-accumulate-grad hook on every trainable parameter. The loop says
before each backward whether it is the last micro-batch of the optimizer step.

Accumulation (grad_accum > 1). Autograd adds each micro-batch's gradient into `p.grad` in the
gradient's dtype, which for bf16 weights rounds every sum to nearest and loses small
contributions. With `round_sums` the hook instead moves the fresh gradient into a per-parameter
buffer of the same dtype, adding it in fp32 and writing the sum back with stochastic rounding
(exact on average). The buffer replaces `p.grad`, so this holds no more memory than autograd's
accumulation. On a GPU every micro-batch does the same work, the first included (it adds into a
buffer of zeros: exact, since a bf16 gradient is a bf16 value; one more rounding pass a step), so
that a recorded backward (train/graphs.py) replays what an eager one runs, random draws included:
`keep_sums` makes the buffers stay put from then on, zeroed before the first backward of each step
instead of handed over and made again. On the CPU (streamed weights' homes, CPU runs) the first
gradient becomes the buffer as it is. fp32 gradients accumulate in autograd as usual.

Step inside backward (`in_backward`). On the last micro-batch the hook forms the parameter's
full gradient (fp32: the buffer plus the fresh gradient, unrounded), takes it out of `p.grad` and
puts it on a pending list, grouped by the pack it would join (optim/base.py packs by device,
dtype and, for Adafactor, shape). When a gradient takes the pending values past the optimizer's
pack limit (`pack_limit` of the trainable parameters: the largest of them or 4 Mi values,
whichever is more), the largest pending group (often its own) is stepped with
`optimizer.step_params` and freed, until they are within it again, so that tensors that pack
together keep waiting together (gradients arrive in backward's order, shapes interleaved);
`finish()` steps the rest (and any tensor whose gradient came only from earlier micro-batches). A
group's norms (one multi-tensor kernel a device), finite flags and clipping (multi-tensor ops,
no tensor made from the host, so a recorded backward may make them) are made when it steps.
So at most one pack limit of gradients waits at a time instead of all of them (for a full
fine-tune, a bf16 copy of the model: 2.6 GiB for SSD-1B), and the optimizer runs once per pack
rather than once per tensor. A tensor on the compute device that the optimizer can step in chunks
(`chunks`: Adafactor, for tensors of more than MIN_PACK_NUMEL values, 1 Mi with its fused kernels;
the pack limit then leaves them out) does not wait: its hook steps it at once from its bf16
gradient (and accumulation buffer) read in row chunks (`step_chunked`), so neither an fp32 copy of
it nor a pack of its size is made. What this changes:
- clipping is per tensor, since the global norm is not known before every gradient exists:
  a tensor of n values out of N trainable values is clipped to max_norm * sqrt(n / N), its
  share of the global budget. If every tensor is at its limit the global norm is exactly
  max_norm; otherwise clipping acts only on the tensors that are out of line.
- a non-finite gradient tensor is not applied (no host sync: the step is made conditional on
  the device, per member of a pack) while the finite ones, in its pack too, are; `finish()`
  returns how many were held back.
- a parameter's update uses the learning rate of the step, as a normal step does; the
  parameters update during backward (each after its own gradient is complete, at the latest
  in `finish()`), which is safe because autograd saved what it needs.
Cost: pending fp32 gradients of at most one pack limit of values, 4 bytes each (16 MiB, or
4 bytes per value of the largest trainable tensor where that is more and the optimizer does not
chunk: AdamW on a full SDXL/SSD-1B UNet, its 1280 x 2560 x 3 x 3 up-block kernel, 118 MB),
besides the gradient whose hook runs; the optimizer's pack (or chunk) temporaries while a pack
steps; one norm per tensor (a multi-tensor kernel per group); the optimizer's Python work runs
during backward instead of after it, once per pack or per chunk of a chunked tensor (whose
gradient is read three times: the passes of optim/adafactor.py, the first of which also gives
its norm).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from vramfit.memory.accounting import concrete_device, tensor_bytes
from vramfit.memory.stochastic_rounding import copy_stochastic_
from vramfit.optim.base import ChunkedGrad, ParamOptimizer, norm_checks


class BackwardSteps:
    # devices whose first micro-batch adds into zeros like the later ones (where CUDA graphs record):
    # on the CPU that would cost a rounding pass over every gradient a step for nothing
    UNIFORM_ON = ("cuda",)

    def __init__(self, params: list[torch.nn.Parameter], optimizer: ParamOptimizer, *, in_backward: bool,
                 round_sums: bool, max_grad_norm: float = 0.0, device: Optional[torch.device] = None):
        self.params, self.optimizer = params, optimizer
        self.in_backward, self.round_sums, self.max_grad_norm = in_backward, round_sums, max_grad_norm
        total = sum(p.numel() for p in params)
        self._clip_to = {id(p): max_grad_norm * math.sqrt(p.numel() / total) for p in params}
        self._buffers: dict[int, torch.Tensor] = {}
        self._held_back: dict[torch.device, torch.Tensor] = {}
        # (parameter, fp32 gradient) waiting to step, by the pack they would join (the optimizer's `pack_key`); at
        # most _limit values in all. Their norms, finite flags and clipping are made when they step
        self._pending: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._group_numel: dict[tuple, int] = {}
        self._pending_numel = 0
        # tensors the optimizer steps in chunks (`chunks`) never wait: they step from the hook. Only
        # those on the compute `device` (when given): a streamed weight's home is in CPU memory, where
        # chunks save nothing and slow the CPU step
        self._chunked = {id(p) for p in params if in_backward and optimizer.chunks(p)
                         and (device is None or _same_device(p.device, device))}
        self._device = device
        # the pack limit leaves out every tensor the optimizer chunks where it lies now: a streamed
        # weight stepped on the device (memory/offload/grads.py) steps in chunks there. One the optimizer
        # chunks only on the GPU (Adafactor's fused kernels: 1 to 4 Mi values) counts as waiting,
        # which leaves the limit as it is: it is under the 4 Mi floor
        waiting = [p for p in params if not (in_backward and optimizer.chunks(p))]
        self._limit = optimizer.pack_limit(waiting) if in_backward else 0
        self._last = False
        self._kept = False  # `keep_sums`: the buffers stay put
        self._summed: set[int] = set()  # kept buffers added into since the last `finish`
        self._handed = False  # kept buffers hold sums `finish` handed to a step: zero before adding
        self.completed = 0  # steps finished in backward (`finish`)
        self.discarded = 0  # `discard` calls
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    @staticmethod
    def needed(params: list[torch.nn.Parameter], in_backward: bool, round_sums: bool, grad_accum: int) -> bool:
        return in_backward or (round_sums and grad_accum > 1 and any(p.dtype == torch.bfloat16 for p in params))

    def begin(self, last: bool) -> None:
        """Called before each micro-batch's backward."""
        if self._handed:
            torch._foreach_zero_(list(self._buffers.values()))
            self._handed = False
        self._last = last

    def keep_sums(self, params: list[torch.Tensor]) -> set[int]:
        """For a recorded backward (train/graphs.py): the ids of those of `params` whose gradients
        these hooks sum (bf16, with round_sums, not stepped in backward), each given its buffer
        now if it has none. From now on every buffer stays put: `finish` lends it to the step as
        `p.grad` and the next step's first `begin` zeroes it, so the recorded additions find it
        at the same place at every replay."""
        if self.in_backward or not self.round_sums:
            return set()
        hooked = {id(p) for p in self.params}
        summed = {id(p): p for p in params if id(p) in hooked and p.dtype == torch.bfloat16}
        for key, p in summed.items():
            if key not in self._buffers:
                self._buffers[key] = torch.zeros_like(p)
        self._kept = True
        return set(summed)

    def release_sums(self) -> None:
        """Between steps (after `finish` and the optimizer's zero_grad): the kept buffers go, and
        sums are made as without `keep_sums` until a recording keeps them again."""
        lent = {id(p.grad) for p in self.params if p.grad is not None}
        if self._kept and not lent & {id(b) for b in self._buffers.values()}:
            self._buffers.clear()
            self._kept = self._handed = False
            self._summed = set()

    def mark_summed(self, params: list[torch.Tensor]) -> None:
        """A replayed backward adds into these parameters' kept buffers (its hooks run no Python)."""
        self._summed.update(id(p) for p in params)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self.in_backward and self._last:
            self._take(p)
        elif self.round_sums and p.grad.dtype == torch.bfloat16:
            buffer = self._buffers.get(id(p))
            if buffer is None and p.grad.device.type not in self.UNIFORM_ON:
                self._buffers[id(p)] = p.grad  # the first micro-batch's gradient is the sum so far
            else:
                if buffer is None:  # on a GPU it adds into zeros, as a recorded backward does
                    buffer = self._buffers[id(p)] = torch.zeros_like(p.grad)
                self.add_to_sum(buffer, p.grad)
            self._summed.add(id(p))
            p.grad = None

    def add_to_sum(self, buffer: torch.Tensor, grad: torch.Tensor) -> None:
        """buffer += grad, added in fp32 and written back with stochastic rounding."""
        rounding = self.optimizer.rounding
        total = buffer.float().add_(grad)
        if rounding is None:
            buffer.copy_(total)
        else:
            copy_stochastic_(buffer, total, rounding(buffer.device))

    def add_sum(self, p: torch.Tensor, total: torch.Tensor) -> None:
        """A sum of earlier micro-batches' gradients of `p` kept elsewhere (memory/offload/grads.py's
        sums in CPU memory; in any float dtype, on `p`'s device): `finish` steps it as a buffer.
        Lent, not given: `finish` may scale it in place and lets go of it."""
        self._buffers[id(p)] = total

    @property
    def stepping(self) -> bool:
        """Whether the backward now running is the one whose hooks step the parameters."""
        return self.in_backward and self._last

    def step_now(self, pairs: list[tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]]) -> None:
        """Step these parameters with their fresh gradients (and their accumulation buffers) now,
        where each parameter's values lie at this moment: memory/offload/grads.py's streamed weights,
        whose gradient hook hands them over while their compute copy is on the device (their
        state moves there on the first such step; a tensor the optimizer chunks steps in chunks).
        A gradient given as a list is the sum of its parts (added in fp32, as a buffer is; the fresh
        gradient first, which the sum may be made in; a part elsewhere, such as a sum in CPU memory,
        is moved to the parameter's device here, one tensor at a time)."""
        for p, grad in pairs:
            self.optimizer.follow(p)
            buffer = self._buffers.pop(id(p), None)
            parts = [buffer.to(p.device, non_blocking=True)] if buffer is not None else []
            fresh = [t.to(p.device, non_blocking=True) for t in grad] if isinstance(grad, list) else [grad]
            self._step_parts(p, parts + fresh, chunked=self.optimizer.chunks(p))
        self._flush()

    def _take(self, p: torch.Tensor) -> None:
        """Take `p`'s full gradient (its accumulation buffer and p.grad, whichever exist) out of
        the hooks' hands and step it: at once in chunks where the optimizer chunks `p`, else onto
        the pending list. Nothing when `p` has no gradient."""
        parts = [t for t in (self._buffers.pop(id(p), None), p.grad) if t is not None]
        if not parts:
            return
        p.grad = None
        if self._device is not None and not _same_device(p.device, self._device):
            self.optimizer.follow(p)  # a streamed weight's home: its state may sit where its last step ran
        self._step_parts(p, parts, chunked=id(p) in self._chunked)

    def _step_parts(self, p: torch.Tensor, parts: list[torch.Tensor], chunked: bool) -> None:
        if chunked and all(t.device == p.device for t in parts):
            self._step_chunked(p, parts)
        else:
            grad = parts[0].float()  # a copy, but for an fp32 gradient (taken from p.grad: ours now)
            for extra in parts[1:]:
                grad.add_(extra)
            self._step(p, grad)

    def _max_norm(self, p: torch.Tensor) -> float:
        """The norm `p`'s gradient is clipped to (its share of max_grad_norm), or 0: not clipped."""
        return self._clip_to[id(p)] if self.max_grad_norm > 0 else 0.0

    def _step(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        key = self.optimizer.pack_key(p)
        self._pending.setdefault(key, []).append((p, grad))
        self._group_numel[key] = self._group_numel.get(key, 0) + grad.numel()
        self._pending_numel += grad.numel()
        while self._pending_numel > self._limit:
            # the largest waiting group steps (this gradient's, often): tensors that pack together
            # keep waiting together
            self._flush(max(self._group_numel, key=self._group_numel.__getitem__))

    def _step_chunked(self, p: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Clip and step one large tensor now, its gradient read in chunks (optim/base.py
        ChunkedGrad): no fp32 copy of the whole gradient is made."""
        self._count_held([self.optimizer.step_chunked(p, ChunkedGrad(parts), self._max_norm(p))])

    def _flush(self, key: Optional[tuple] = None) -> None:
        """Step the pending parameters (of one pack key, or all), packed, and count the held-back
        tensors."""
        if key is None:
            pending = [item for group in self._pending.values() for item in group]
            self._pending, self._group_numel = {}, {}
        else:
            pending = self._pending.pop(key)
            del self._group_numel[key]
        if not pending:
            return
        self._pending_numel -= sum(grad.numel() for _, grad in pending)
        flags = self._checked(pending)
        self.optimizer.step_params(pending, finite=flags)
        self._count_held(flags)

    def _checked(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each gradient's finite flag, and each clipped to its share of max_grad_norm (clip_grad_norm_'s
        rule); the norms of a device's gradients in one multi-tensor kernel."""
        flags: list = [None] * len(pending)
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, grad) in enumerate(pending):
            by_device.setdefault(grad.device, []).append(i)
        for indices in by_device.values():
            grads = [pending[i][1] for i in indices]
            norms = torch._foreach_norm(grads)
            if self.max_grad_norm > 0:  # min(1, max_norm / (norm + 1e-6)), no tensor made from the host
                scales = torch._foreach_add(norms, 1e-6)
                torch._foreach_reciprocal_(scales)
                torch._foreach_mul_(scales, [self._clip_to[id(pending[i][0])] for i in indices])
                torch._foreach_clamp_max_(scales, 1.0)
                for grad, scale in zip(grads, scales):
                    grad.mul_(scale)
            for i, flag in zip(indices, norm_checks(torch.stack(norms), 0.0)[0].unbind()):
                flags[i] = flag
        return flags

    def _count_held(self, flags: list[torch.Tensor]) -> None:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for finite in flags:
            by_device.setdefault(finite.device, []).append(finite)
        for device, group in by_device.items():
            # one flag (a chunked tensor's) adds itself: two kernels, not four
            held = group[0].logical_not() if len(group) == 1 else torch.stack(group).logical_not().sum()
            self._held_count(device).add_(held)

    def _held_count(self, device: torch.device) -> torch.Tensor:
        """The count of held-back tensors on `device`. It stays put once made (zeroed after each
        step, never replaced): a recorded step (RecordedStep) adds into it at every replay."""
        held = self._held_back.get(device)
        if held is None:
            held = self._held_back[device] = torch.zeros((), dtype=torch.int64, device=device)
        return held

    @torch.no_grad()
    def finish(self) -> int:
        """After the last backward. Normal step: the accumulated gradients become `p.grad` for
        clipping and `optimizer.step()`. In backward: the pending parameters, then (packed
        likewise) those whose gradient came only from earlier micro-batches, are stepped now;
        returns the number of gradient tensors held back as non-finite (one host sync)."""
        if not self.in_backward:
            for p in self.params:
                # a kept buffer nothing added into this step stays out, as an eager run has no sum there
                buffer = (self._buffers.get(id(p)) if id(p) in self._summed else None) if self._kept else \
                    self._buffers.pop(id(p), None)
                if buffer is not None:
                    p.grad = buffer if p.grad is None else p.grad.add_(buffer)
            self._handed, self._summed = self._kept, set()
            return 0
        self._flush()
        for p in self.params:
            # a gradient that came only from earlier micro-batches: in a bf16 sum's buffer, or (fp32,
            # or sums rounded to nearest) accumulated by autograd in p.grad
            self._take(p)
        self._flush()
        held = sum(int(h) for h in self._held_back.values())
        self._zero_held()
        self.completed += 1
        return held

    def _zero_held(self) -> None:
        for count in self._held_back.values():
            count.zero_()

    def discard(self) -> None:
        """Drop what was accumulated (a skipped step). `discarded` counts the calls: sums kept
        elsewhere (streamed weights' sums on the device, memory/offload/grads.py) go when it moves."""
        self.discarded += 1
        if self._kept:
            self._handed = bool(self._buffers)  # zeroed, not dropped: recordings add into them
        else:
            self._buffers.clear()
        self._summed = set()
        self._zero_held()
        self._pending, self._group_numel, self._pending_numel = {}, {}, 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._kept = False  # the recordings that added into the buffers are done with them
        self.discard()

    def grad_bytes(self) -> int:
        """Bytes of gradients held now, in p.grad, the accumulation buffers and the pending list."""
        lent = {id(p.grad) for p in self.params if p.grad is not None}  # kept buffers lent as p.grad
        return (sum(tensor_bytes(p.grad) for p in self.params if p.grad is not None)
                + sum(tensor_bytes(b) for b in self._buffers.values() if id(b) not in lent)
                + sum(tensor_bytes(grad) for group in self._pending.values() for _, grad in group))


class RecordedStep:
    """The step inside backward, recorded with a CUDA graph's backward (train/graphs.py).

    The recorded backward runs the gradient hooks once, as a recording: their packs, chunks,
    clipping, finite checks and stochastic rounding become kernels of the graph, so every replay
    of the backward steps the weights too, with no Python and no launches of its own. What a
    replay cannot redo is the hooks' host work, so the recording is set up for that:
    - the optimizer state of every weight the backward reaches exists before the recording
      (state made inside it would be memory of the graph's pool, zeroed at every replay);
    - the learning rate and the step-count scalars are read from the device (optim/base.py
      RecordedScalars), loaded before each replay, and the step counts the recording advanced
      go back (a recording runs none of its kernels);
    - the pack still waiting when backward ends steps inside the recording (`end`), not in
      `finish()` after it;
    - the rounding's generator is registered with the graph, which then advances its offset by
      the recording's draws at each replay, as the same draws made eagerly would;
    - the held-back count is a tensor that stays put (`_held_count`).
    One micro-batch per step only: with accumulation the last micro-batch's hooks step while the
    earlier ones' only sum, host work that differs between the calls one recording serves
    (config/schema.py refuses it).
    """

    def __init__(self, steps: BackwardSteps, params: list[torch.Tensor], device: torch.device):
        self.steps, self.params, self.device = steps, params, device
        self.scalars = None

    def begin(self, graph) -> None:
        """Before the backward's recording starts."""
        optimizer = self.steps.optimizer
        optimizer.ensure_state(self.params)
        self.steps._held_count(self.device)
        if optimizer.rounding is not None:
            graph.register_generator_state(optimizer.rounding(self.device))
        self.steps.begin(True)
        # at most a step per parameter, each with its group's `scalars`
        per_step = max(len(optimizer.scalars(group, 1)) for group in optimizer.param_groups)
        self.scalars = optimizer.record_scalars(self.device, per_step * len(self.params))

    def end(self) -> None:
        """Inside the recording, after backward: the pack still waiting steps too."""
        self.steps._flush()

    def close(self, failed: bool) -> None:
        """After the recording. A failed one leaves nothing of itself behind: no pending
        gradients, and no gradient of the recording's memory in `p.grad`."""
        if self.scalars is not None:
            self.scalars.close()
        if failed:
            self.steps.discard()
            for p in self.params:
                p.grad = None

    def before_replay(self) -> None:
        self.scalars.load()


class RecordedSums:
    """Accumulation's rounded gradient sums (BackwardSteps with round_sums), recorded with a CUDA
    graph's backward (train/graphs.py): each replay adds the micro-batch's bf16 gradients into
    the kept buffers (`keep_sums`, called before the recording) with stochastic rounding, as an
    eager backward does. The rounding's generator is registered with the graph, which advances
    its offset by the recording's draws at each replay; the step after backward draws from it
    eagerly between replays. `params`: the weights whose sums the hooks keep; the recording
    needs their `p.grad` empty, so that the recorded backward's gradient is a fresh tensor the
    hook adds and lets go of."""

    def __init__(self, steps: BackwardSteps, params: list[torch.Tensor], device: torch.device):
        self.steps, self.params, self.device = steps, params, device

    def begin(self, graph) -> None:
        """Before the backward's recording starts."""
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("a summed weight holds a gradient outside its accumulation buffer")
        rounding = self.steps.optimizer.rounding
        if rounding is not None:
            graph.register_generator_state(rounding(self.device))

    def end(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        """After the recording: a failed one leaves no gradient of the recording's memory."""
        if failed:
            for p in self.params:
                p.grad = None

    def before_replay(self) -> None:
        pass


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` is `b`, where "cuda" without an index means the current GPU."""
    return a.type == b.type and (a.type != "cuda" or concrete_device(a) == concrete_device(b))


def optional_steps(params: list[torch.nn.Parameter], optimizer, *, in_backward: bool, round_sums: bool,
                   grad_accum: int, max_grad_norm: float,
                   device: Optional[torch.device] = None) -> Optional[BackwardSteps]:
    """The hooks a run needs, or None when autograd's own accumulation does the job."""
    if not BackwardSteps.needed(params, in_backward, round_sums, grad_accum):
        return None
    if in_backward and not isinstance(optimizer, ParamOptimizer):
        raise TypeError(f"optimizer in backward needs a vramfit optimizer, not {type(optimizer).__name__}")
    return BackwardSteps(params, optimizer, in_backward=in_backward, round_sums=round_sums,
                         max_grad_norm=max_grad_norm, device=device)
