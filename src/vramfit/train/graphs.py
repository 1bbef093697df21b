"""CUDA graphs for the denoiser's forward and backward (train.cuda_graphs).

At the batch sizes people fine-tune at, a step of an SDXL-class denoiser on a fast GPU is bound
by the host: the GPU finishes each of a few thousand small kernels sooner than Python launches
the next one (docs/benchmarks.md: SSD-1B's forward takes about 100 ms of host time for about
20 ms of GPU work on the H200). A CUDA graph records the kernels of one forward and of one
backward once and replays each with a single launch, so the host cost of a step no longer grows
with the number of kernels.

`GraphedDenoiser` stands in for the denoiser inside the training loss. Calls are grouped by
input signature (shapes, dtypes, which arguments are given, autocast). The very first training
call runs eagerly (it warms up what a recording must not do for the first time: library handles,
workspaces, kernel selection); from then on the first call of each signature records the forward
and the backward, and that call and every later one of the signature replay them. Each
aspect-ratio bucket (and a smaller last batch) records once; all of them share one memory pool,
so no eager activations ever sit beside it. Calls in eval mode or without grad (sample grids)
run the denoiser as usual. Before a sample grid renders (train/samples.py) every recording is
dropped with its pool and the gradient buffers this module or the hooks keep
(`GraphedDenoiser.release`, through the step engine): the grid gets that memory, as it would
after an eager step, and the next training call records again. When the weights have moved since the recordings otherwise,
the recordings are dropped and made again too.

Gradients. The recorded backward adds each weight's gradient into a buffer that this module
owns and that stays put (`p.grad` is that buffer whenever a replay runs): autograd's own
accumulation, recorded, so micro-batches accumulate as they do eagerly. When the loop sets
`p.grad` to None after an optimizer step, the next call zeroes the buffers and puts them back.
The gradients are therefore held through the whole step (eager training frees them after the
optimizer step), and a weight the forward does not use keeps no gradient, as eagerly. A
signature whose recording fails (a warning says why) runs eagerly, adding into whatever `p.grad`
holds. Accumulation into bf16 gradients with stochastic rounding (`sums`: the hooks of
optim/in_backward.py with round_sums) is recorded too: those weights get no owned buffer, their
hooks' accumulation buffers stay put instead (`keep_sums`), and the recorded backward adds each
micro-batch's gradient into them with the same rounding and the same random draws as an eager
backward (`RecordedSums`).

The optimizer step inside backward (`steps`: train.optimizer_in_backward, one micro-batch a
step) is recorded with the backward instead: the gradient hooks run while the backward is
recorded, so their packed steps become kernels of the same graph, and each replay of the
backward steps every weight it reaches, each gradient freed as soon as it is applied, as
eagerly. No gradient buffers are owned then. optim/in_backward.py `RecordedStep` says what the
recording sets up for the host work a replay skips (the learning rate and step counts, read from
the device and loaded before each replay; the rounding generator; the last pack).

What a replay needs, and how a run provides it:
- the weights stay where they were recorded: every vramfit optimizer writes parameters in place.
  Streamed weights (memory.stream_weights) record with their copies: the streamer's hooks run
  while the forward and backward record, so the copies of each unit from its pinned home into
  the streamer's fixed device buffers, the waits between the copy streams and the compute, the
  step of the streamed weights on those copies (train.optimizer_in_backward with Adafactor) and
  the copies of their new values home become nodes of the graphs, and a replay moves the same
  bytes between the same places (memory/offload/slots.py: the buffers are fixed for that). Offloaded
  activations (memory.offload_activations) record alike: their copies to the streamer's kept
  pinned buffers in forward and back in backward are nodes too; as with compiled blocks, each
  signature runs once eagerly first, which makes the pinned buffers of its saves. Settings
  whose work a replay cannot repeat are refused beside cuda_graphs (config/schema.py):
  streamed weights stepping in CPU memory (their gradients go home and a CPU step follows the
  backward), and the optimizer step inside backward over several micro-batches (gradient hooks whose host work
  differs between micro-batches, which a recorded backward would bake in). A quantized LoRA
  base records as it is: widening its weights is GPU work like any other, and replaying it
  removes the host cost of torchao's tensor subclasses, which otherwise dominates such a step.
- no compiling inside the recording: with compiled blocks (train.compile) each signature's first
  call runs eagerly, so that torch.compile builds and loads that shape's kernels (CUDA cannot
  load a kernel while it records), and its second call records; after recordings are dropped
  (a sample grid, moved weights) the first call runs eagerly again. The recording then holds the
  compiled kernels, and a replay skips the guards that select them: the signature, shapes
  included, is what they guard, and it is the recording's key.
- no host work inside the recording: gradient checkpointing runs without saving and restoring
  the RNG state (memory/checkpointing.py `graph_safe_checkpoint`), which is exact because the denoisers draw no random
  numbers in their forward (LoRA dropout would: refused).

Memory: the recordings' activations live in a pool of their own, which eager work (the optimizer
step) does not reuse. While that work runs the pool's room is reserved, not allocated, so
`torch.cuda.max_memory_allocated` leaves it out: the planner adds it to the step's temporaries,
and the fit probe (which records graphs as the run does) measures reserved memory instead.
The recordings make cuBLAS workspaces of their own; the eager ones are freed before the first
recording (`release_cublas_workspaces`).
"""
from __future__ import annotations

import gc
import logging
import weakref
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramfit.memory.offload import WeightStreamer
from vramfit.optim.in_backward import RecordedStep, RecordedSums

log = logging.getLogger("vramfit")


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"train.cuda_graphs records CUDA graphs and needs a CUDA device; this run's device "
                         f"is {device}. Set train.cuda_graphs = false (or train.device to a GPU)")


class _Flat(torch.nn.Module):
    """The denoiser called with the tensors of one call signature as a flat tuple, its output
    flattened likewise."""

    def __init__(self, denoiser: torch.nn.Module, template: list, positions: list[int], spec):
        super().__init__()
        self.denoiser = denoiser
        self._template, self._positions, self._spec = template, positions, spec
        self.out_spec = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._template)
        for position, tensor in zip(self._positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out, self.out_spec = pytree.tree_flatten(self.denoiser(*args, **kwargs))
        if not all(torch.is_tensor(t) for t in out):
            raise TypeError("train.cuda_graphs: the denoiser returned something other than tensors")
        return tuple(out)


def used_parameters(outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that `outs` were computed from (their AccumulateGrad nodes)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    keep: list = []  # holds the node wrappers so their ids stay unique while walking
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if type(node).__name__ == "CheckpointFunctionBackward":  # reentrant checkpointing hides its weights
            raise RuntimeError("reentrant gradient checkpointing runs its own backward, which a recording "
                               "cannot follow")
        seen.add(id(node))
        keep.append(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


class CudaRecording:
    """One signature's forward and backward, recorded as two CUDA graphs on `stream` into `pool`.

    `prepare(outs)` runs between the two recordings with the recorded forward's outputs: it puts
    the owned gradient buffers in place, so that the recorded backward adds into them. `around()`
    is entered inside each recording (streamed weights: memory/offload/weights.py WeightStreamer.recorded)."""

    def __init__(self, flat: _Flat, tensors: tuple[torch.Tensor, ...], prepare: Callable, pool, stream,
                 around: Callable = nullcontext):
        self.device = stream.device
        self.static_in = [t.detach().clone() for t in tensors]
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.fwd, pool=pool, stream=stream), around():
            outs = flat(*self.static_in)
        self.step = prepare(outs)  # optim/in_backward.py RecordedStep or RecordedSums: hook work recorded; or None
        self.static_grad_out = [torch.zeros_like(o) for o in outs]
        if self.step is not None:
            self.step.begin(self.bwd)
        failed = True
        try:
            with torch.cuda.graph(self.bwd, pool=pool, stream=stream), around():
                torch.autograd.backward(outs, self.static_grad_out)
                if self.step is not None:
                    self.step.end()
            failed = False
        finally:
            if self.step is not None:
                self.step.close(failed)
        torch.cuda.current_stream().wait_stream(stream)
        self.static_out = [o.detach() for o in outs]

    def forward(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        with torch.cuda.device(self.device):
            for static, tensor in zip(self.static_in, tensors):
                static.copy_(tensor)
            self.fwd.replay()
        return self.static_out

    def backward(self, grads: tuple[Optional[torch.Tensor], ...]) -> None:
        with torch.cuda.device(self.device):
            for static, grad in zip(self.static_grad_out, grads):
                static.copy_(grad) if grad is not None else static.zero_()
            if self.step is not None:
                self.step.before_replay()
            self.bwd.replay()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recording, anchor, *tensors):
        ctx.recording = recording
        return tuple(o.detach() for o in recording.forward(tensors))

    @staticmethod
    def backward(ctx, *grads):
        ctx.recording.backward(grads)
        return (None, None) + (None,) * len(ctx.recording.static_in)


class GraphedDenoiser(torch.nn.Module):
    """The denoiser, with each training call signature recorded and replayed (see the module doc)."""

    def __init__(self, denoiser: torch.nn.Module, recorder: Optional[Callable] = None, steps=None, sums=None,
                 warm_each: bool = False, streamer: Optional[WeightStreamer] = None):
        super().__init__()
        self.denoiser = denoiser
        self._recorder = recorder
        # compiled blocks (train.compile): each signature runs once eagerly before it records, since
        # compiling for a new shape loads kernels, which CUDA refuses while it records
        self._streamer = streamer  # streamed weights (memory/offload/): their copies are recorded too
        # offloaded activations: the same for the pinned buffers a shape's saved tensors are copied
        # into, which are not made while CUDA records (memory/offload/activations.py `host_buffer`)
        self._warm_each = warm_each or bool(self._streamer and self._streamer.offload_activations)
        self._eager_keys: set = set()  # the signatures that ran eagerly (with warm_each only)
        self._steps = steps  # optim/in_backward.py BackwardSteps when the step runs inside backward
        self._sums = sums  # the same when its hooks sum bf16 gradients of several micro-batches
        self._recordings: dict[Any, Optional[object]] = {}
        self._owned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(p) -> (p, its gradient buffer)
        self._used: dict[Any, list[torch.Tensor]] = {}
        self._adopted: dict[Any, list[torch.Tensor]] = {}  # of those, the ones given owned buffers
        self._summed: dict[Any, list[torch.Tensor]] = {}  # ... and the ones whose sums `sums` keeps
        self._pool = self._stream = None
        self._warm = False  # the first training call ran (eagerly)
        self._weights_at: Optional[list[int]] = None  # the weights' addresses the recordings use
        self._parts = list(denoiser.modules())  # where those weights are read from (weight_addresses)
        self.device = self._streamer.device if self._streamer else next(denoiser.parameters()).device
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)  # makes replayed outputs need grad
        _LIVE.add(self)

    @property
    def captures(self) -> int:
        """Signatures recorded so far (each bucket shape once)."""
        return sum(1 for v in self._recordings.values() if v is not None)

    def forward(self, *args, **kwargs):
        if not (self.denoiser.training and torch.is_grad_enabled()):
            return self.denoiser(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        tensors = tuple(leaves[i] for i in positions)
        key = _signature(spec, leaves, tensors)
        if not self._warmed_up() or any(t.requires_grad for t in tensors):  # warm-up; or inputs that want gradients
            self._warm = True
            if self._warm_each:
                self._eager_keys.add(key)
            return self.denoiser(*args, **kwargs)
        self._forget_if_moved()
        if self._warm_each and key not in self._eager_keys:  # compiles its blocks for this shape
            self._eager_keys.add(key)
            return self.denoiser(*args, **kwargs)
        if key not in self._recordings:
            self._recordings[key] = self._record(key, leaves, positions, spec, tensors)
        recording = self._recordings[key]
        if recording is None:  # recording failed for this signature: it runs as it would without graphs
            return self.denoiser(*args, **kwargs)
        if self._steps is None:  # the step inside backward takes each gradient as it comes
            self._adopt(self._adopted[key])
            if self._summed.get(key):
                self._sums.mark_summed(self._summed[key])
        outs = _Replay.apply(recording, self._anchor, *tensors)
        return pytree.tree_unflatten(list(outs), recording.out_spec)

    def release(self) -> None:
        """Between steps: drop every recording, its pool and the gradient buffers kept for them
        (owned ones; the hooks' kept sums), so that their memory is free; the next training call
        records again."""
        self._drop_recordings()
        for p, buffer in self._owned.values():
            if p.grad is buffer:
                p.grad = None
        self._owned.clear()
        if self._sums is not None:
            self._sums.release_sums()

    def forget_eager_calls(self) -> None:
        """With warm_each: every signature runs eagerly once more before it records (what ran in
        between, a sample grid, may have compiled its blocks anew)."""
        self._eager_keys.clear()

    def _warmed_up(self) -> bool:
        """Whether a training call has run eagerly. With the step inside backward, one whose step
        ran too: the optimizer's kernels (Triton's among them) must have been loaded before a
        recording launches them, as CUDA cannot load them while it records; a first step whose loss
        was not finite skips its backward and leaves them unloaded."""
        return self._warm and (self._steps is None or self._steps.completed > 0)

    @torch.no_grad()
    def _adopt(self, params: list[torch.Tensor]) -> None:
        """Make each parameter's gradient its owned buffer: zeroed where the loop cleared
        `p.grad`, holding the sum so far where an eager call left one elsewhere."""
        cleared: list[torch.Tensor] = []
        for p in params:
            entry = self._owned.get(id(p))
            if entry is None:
                entry = self._owned[id(p)] = (p, torch.zeros_like(p))
                if p.grad is None:
                    p.grad = entry[1]
                    continue
            buffer = entry[1]
            if p.grad is None:
                cleared.append(buffer)
                p.grad = buffer
            elif p.grad is not buffer:
                buffer.copy_(p.grad)
                p.grad = buffer
        if cleared:
            torch._foreach_zero_(cleared)

    def _forget_if_moved(self) -> None:
        """Drop every recording when a weight no longer lives where they read it."""
        now = weight_addresses(self._parts)
        if self._weights_at is not None and now != self._weights_at and self.captures:
            log.info("train.cuda_graphs: the denoiser's weights moved; recording again")
            self._drop_recordings()
        self._weights_at = now

    def _drop_recordings(self) -> None:
        """Forget every recording and what was noted of it; the pool goes with the last of them.
        With compiled blocks each signature runs eagerly again before it records again: calls
        since (a sample grid's, other shapes') may have had torch.compile build kernels for any
        size, which a signature's next call would then use, and load, for the first time."""
        self._recordings.clear()
        self.forget_eager_calls()
        self._used.clear()
        self._adopted.clear()
        self._summed.clear()
        self._pool = self._stream = None

    def _record(self, key, leaves: list, positions: list[int], spec, tensors: tuple):
        chosen = set(positions)
        template = [None if i in chosen else leaf for i, leaf in enumerate(leaves)]
        flat = _Flat(self.denoiser, template, positions, spec)
        shapes = ", ".join("x".join(map(str, t.shape)) or "scalar" for t in tensors)

        def prepare(outs):
            used = self._used[key] = used_parameters(outs)
            if self._steps is not None:
                return RecordedStep(self._steps, used, self.device)
            summed = self._sums.keep_sums(used) if self._sums is not None else set()
            self._adopted[key] = [p for p in used if id(p) not in summed]
            self._summed[key] = [p for p in used if id(p) in summed]
            self._adopt(self._adopted[key])
            return RecordedSums(self._sums, self._summed[key], self.device) if summed else None

        try:
            if self._recorder is not None:
                recording = self._recorder(flat, tensors, prepare)
            else:
                with torch.cuda.device(self.device):
                    if self._pool is None:
                        release_cublas_workspaces(self)
                        self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
                    recording = CudaRecording(flat, tensors, prepare, self._pool, self._stream,
                                              self._streamer.recorded if self._streamer else nullcontext)
        except torch.OutOfMemoryError:
            raise  # a run that does not fit is the fit probe's and the user's business, not a fallback
        except RuntimeError as err:  # an operation that a graph cannot hold: warn, go on without
            log.warning("train.cuda_graphs: recording the denoiser for inputs %s failed (%s); these "
                        "inputs run without CUDA graphs", shapes, (str(err).splitlines() or [""])[0])
            return None
        recording.out_spec = flat.out_spec
        log.info("train.cuda_graphs: recorded the denoiser's forward and backward for inputs %s "
                 "(%d weights get gradients)", shapes, len(self._used[key]))
        return recording


# Every GraphedDenoiser alive (a weak set). cuBLAS workspaces are the process's, not one denoiser's, so
# whether any may be freed depends on every recording in the process (`release_cublas_workspaces`).
_LIVE: "weakref.WeakSet[GraphedDenoiser]" = weakref.WeakSet()


def release_cublas_workspaces(owner: Optional[GraphedDenoiser] = None) -> bool:
    """Free the workspaces cuBLAS holds for the streams matrix products ran on so far; returns
    whether it did.

    torch gives cuBLAS a workspace per (handle, stream), 32 MiB each on the H200, and keeps it
    for the life of the process. The eager warm-up's forward (this thread) and backward
    (autograd's device thread) leave two on the default stream; a recording runs on a stream of
    its own and gets two more in its pool. Before the first recording of a new pool (`owner`'s)
    nothing recorded reads the old ones, and an eager product later (a sample grid, a signature
    whose recording failed) makes its workspace again: so they go, and a recorded run holds the
    two workspaces an eager run holds, not four. After the fit probe (fit/probe.py) the same
    frees the workspaces its recordings made, which would otherwise pin its pool.

    The workspaces are the process's, not one denoiser's: while another denoiser still holds
    recordings, whose replays use the workspaces they were recorded with, nothing is freed."""
    def busy() -> bool:  # (no list of them: it would keep garbage alive through the collection)
        return any(d is not owner and d.captures for d in _LIVE)

    held = busy()
    if held:  # perhaps only garbage (the fit probe's): collect it and look again
        gc.collect()
        held = busy()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if held or clear is None:
        return False
    torch.cuda.synchronize()
    clear()
    return True


def weight_addresses(modules: Iterable[torch.nn.Module]) -> list[int]:
    """Where the parameters and buffers of `modules` live; for a tensor subclass (torchao's
    quantized weights, whose own data_ptr is 0) where its inner tensors do. It runs before every
    graphed call, so it takes the modules listed once (a denoiser's structure does not change
    while it trains) and reads their tensors directly: walking the module tree again each call
    (`parameters()`, `buffers()`) cost several times more host time."""
    found: list[int] = []
    for module in modules:
        for group in (module._parameters, module._buffers):
            for t in group.values():
                if t is None:
                    continue
                if is_traceable_wrapper_subclass(t):
                    _inner_addresses(t, found)
                else:
                    found.append(t.data_ptr())
    return found


def _inner_addresses(t: torch.Tensor, found: list[int]) -> None:
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        if is_traceable_wrapper_subclass(inner):
            _inner_addresses(inner, found)
        else:
            found.append(inner.data_ptr())


def _signature(spec, leaves: list, tensors: tuple) -> tuple:
    device = tensors[0].device.type if tensors else "cpu"
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    return (str(spec), tuple(repr(leaf) for leaf in leaves if not torch.is_tensor(leaf)),
            tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in tensors), autocast)
