"""CUDA graphs for the denoiser's forward and backward (train.cuda_graphs).

At the batch sizes people fine-tune at, a step of an SDXL-class denoiser on a fast GPU is bound
by the host: the GPU finishes each of a few thousand small kernels sooner than Python launches
the next one (docs/benchmarks.md: SSD-1B's forward takes about 100 ms of host time for about
20 ms of GPU work on the H200). A CUDA graph records the kernels of one forward and of one
backward once and replays each with a single launch, so the host cost of a step no longer grows
with the number of kernels.

`GraphedDenoiser` stands in for the denoiser inside the training loss. The first training call
with inputs of a new signature (shapes, dtypes, which arguments are given, autocast) records
graphs for that signature with torch.cuda.make_graphed_callables (three warm-up passes, then
the capture); later calls with it replay them. Each aspect-ratio bucket records once. Calls in
eval mode or without grad (sample grids) run the denoiser as usual.

What a replay needs, and how a run provides it:
- the weights stay where they were recorded: every vramfit optimizer writes parameters in place.
  Settings whose hooks move weights or saved tensors between devices (memory.stream_weights,
  memory.offload_activations), a quantized LoRA base, train.compile and the optimizer step
  inside backward (its hooks step each weight while backward runs; a replayed backward hands
  over every gradient at its end) are refused beside cuda_graphs (config/schema.py).
- no host work inside the recorded forward: gradient checkpointing runs without saving and
  restoring the RNG state (`graph_safe_checkpoint`), which is exact because the denoisers draw
  no random numbers in their forward (LoRA dropout would: refused).
- gradients: the replayed backward writes each weight's gradient into a buffer that belongs to
  the graph, and autograd takes that buffer as `p.grad` when the weight has no gradient yet; the
  next replay would overwrite it. So with grad_accum > 1 `own_gradients` copies a gradient that
  arrives at an empty `p.grad` (a hook on each trainable weight), and the later micro-batches add
  into that copy; with grad_accum 1 the optimizer reads the graph's buffers before the next
  replay and nothing is copied.

Memory: the graphs' activations and gradient buffers live in a pool of their own, which eager
work (the optimizer step) does not reuse, and with grad_accum > 1 the copied gradients come on
top of the graph's; the memory report's train phase measures the result, and the fit probe
records graphs as the run does.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

log = logging.getLogger("vramfit")


def make_graphed(module: torch.nn.Module, sample_args: tuple[torch.Tensor, ...]) -> torch.nn.Module:
    """Record `module`'s forward and backward for inputs like `sample_args` (torch's recorder;
    a weight the forward does not use gets no gradient rather than an error)."""
    return torch.cuda.make_graphed_callables(module, sample_args, allow_unused_input=True)


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"train.cuda_graphs records CUDA graphs and needs a CUDA device; this run's device "
                         f"is {device}. Set train.cuda_graphs = false (or train.device to a GPU)")


def graph_safe_checkpoint(module: Callable, *args):
    """Gradient checkpointing without saving the RNG state, which a graph recording cannot do."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, preserve_rng_state=False)


class _Flat(torch.nn.Module):
    """The denoiser called with the tensors of one call signature as a flat tuple, its output
    flattened likewise (what the recorder takes and gives)."""

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


class GraphedDenoiser(torch.nn.Module):
    """The denoiser, with each training call signature recorded once and replayed after."""

    def __init__(self, denoiser: torch.nn.Module, recorder: Optional[Callable] = None):
        super().__init__()
        self.denoiser = denoiser
        self._recorder = recorder or make_graphed
        self._graphed: dict[Any, Optional[_Flat]] = {}

    @property
    def captures(self) -> int:
        """Signatures recorded so far (each bucket shape once)."""
        return sum(1 for v in self._graphed.values() if v is not None)

    def forward(self, *args, **kwargs):
        if not (self.denoiser.training and torch.is_grad_enabled()):
            return self.denoiser(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        tensors = tuple(leaves[i] for i in positions)
        key = _signature(spec, leaves, tensors)
        if key not in self._graphed:
            self._graphed[key] = self._record(leaves, positions, spec, tensors)
        flat = self._graphed[key]
        if flat is None:  # recording failed for this signature: it runs as it would without graphs
            return self.denoiser(*args, **kwargs)
        return pytree.tree_unflatten(list(flat(*tensors)), flat.out_spec)

    def _record(self, leaves: list, positions: list[int], spec, tensors: tuple) -> Optional[_Flat]:
        chosen = set(positions)
        template = [None if i in chosen else leaf for i, leaf in enumerate(leaves)]
        flat = _Flat(self.denoiser, template, positions, spec)
        shapes = ", ".join("x".join(map(str, t.shape)) for t in tensors)
        try:
            self._recorder(flat, tensors)
        except RuntimeError as err:  # an operation that a graph cannot hold: warn, go on without
            log.warning("train.cuda_graphs: recording the denoiser for inputs %s failed (%s); these "
                        "inputs run without CUDA graphs", shapes, str(err).splitlines()[0] if str(err) else err)
            return None
        log.info("train.cuda_graphs: recorded the denoiser's forward and backward for inputs %s", shapes)
        return flat


def _signature(spec, leaves: list, tensors: tuple) -> tuple:
    device = tensors[0].device.type if tensors else "cpu"
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    return (str(spec), tuple(repr(leaf) for leaf in leaves if not torch.is_tensor(leaf)),
            tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in tensors), autocast)


def own_gradients(params: list[torch.nn.Parameter]) -> list:
    """Hooks that copy a gradient arriving at an empty `p.grad`, so that a sum over micro-batches
    never lives in a graph's buffer (see the module doc); returns the handles to remove."""
    def copy_if_first(grad: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        return grad.clone() if p.grad is None else grad

    return [p.register_hook(functools.partial(copy_if_first, p=p)) for p in params]
