"""Gradient checkpointing of the denoiser's blocks, all of them or a share (train.gradient_checkpointing).

diffusers' models call a checkpointing function for each block they run (SD3's joint blocks; the
UNet's resnets and transformer blocks) once `enable_gradient_checkpointing(function)` is set.
`checkpointing_function` gives that function: torch's non-reentrant checkpoint of every block
(true; diffusers' own default does the same), or `PartialCheckpoint`, which checkpoints only a
share of the blocks and runs the others as usual, so that they keep their activations for
backward.

Which blocks: in the order the forward first calls them, block i recomputes when
floor((i + 1) x share) > floor(i x share): one in four for 0.25, spread evenly through the
forward, the same blocks at every call (decided once per module). For SD3, whose blocks are
alike, that is exactly the share of the activations kept by false and the recomputation of true;
a UNet's blocks differ in size, so what a share keeps depends on which blocks recompute:
fit/planner.py lists the blocks in the same order and applies the same rule
(`recomputed_blocks`).

Cost: a share keeps the activations of the blocks that do not recompute beside the inputs of
those that do (for SD3 about (1 - s) of the no-checkpointing activations and s of the
checkpointed inputs), and recomputes s of the forward in backward (true: all of it).
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

log = logging.getLogger("vramfit")


def checkpoint_block(module: Callable, *args, **kwargs):
    """torch's non-reentrant checkpoint of one block call (diffusers' own default)."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)


def graph_safe_checkpoint(module: Callable, *args, **kwargs):
    """Gradient checkpointing without saving the RNG state, which a CUDA graph recording cannot do
    (exact: the denoisers draw no random numbers in their blocks)."""
    return checkpoint_block(module, *args, preserve_rng_state=False, **kwargs)


class PartialCheckpoint:
    """A checkpointing function for diffusers' `enable_gradient_checkpointing` that recomputes a
    `share` (0 < share < 1) of the blocks with `checkpoint` and runs the rest directly."""

    def __init__(self, share: float, checkpoint: Callable = checkpoint_block):
        if not 0.0 < share < 1.0:
            raise ValueError(f"a share of the blocks between 0 and 1 (exclusive), not {share}")
        self.share, self.checkpoint = share, checkpoint
        self._decided: dict[int, tuple[torch.nn.Module, bool]] = {}  # id -> (module, recomputes)
        self._told = False

    def recomputes(self, module) -> bool:
        """Whether `module` is one of the checkpointed blocks (decided at its first call). The
        first block called again (a forward has seen them all) logs how many recompute."""
        entry = self._decided.get(id(module))
        if entry is not None and not self._told:
            self._told = True
            log.info("train.gradient_checkpointing = %g: %d of the denoiser's %d checkpointable blocks "
                     "recompute in backward", self.share, *self.counts)
        if entry is None:
            entry = self._decided[id(module)] = (module, _recomputes(len(self._decided), self.share))
        return entry[1]

    @property
    def counts(self) -> tuple[int, int]:
        """(blocks that recompute, blocks seen so far)."""
        return sum(1 for _, r in self._decided.values() if r), len(self._decided)

    def __call__(self, module, *args, **kwargs):  # (SDXL's and SD3's blocks get positional arguments only)
        return self.checkpoint(module, *args, **kwargs) if self.recomputes(module) else module(*args, **kwargs)


def _recomputes(i: int, share: float) -> bool:
    """Whether the i-th block the forward calls (from 0) recomputes under a share."""
    return math.floor((i + 1) * share) > math.floor(i * share)


def recomputed_blocks(share: float, count: int) -> list[bool]:
    """Which of `count` blocks, in the order the forward calls them, recompute under `share` (what
    PartialCheckpoint decides; fit/planner.py predicts from it)."""
    return [_recomputes(i, share) for i in range(count)]


def checkpointing_function(setting: bool | float, graph_safe: bool) -> Callable:
    """The function to give `enable_gradient_checkpointing` for train.gradient_checkpointing =
    `setting` (true or a share; false never checkpoints). `graph_safe`: under train.cuda_graphs,
    a checkpoint that saves no RNG state (`graph_safe_checkpoint`)."""
    if setting is False:
        raise ValueError("gradient checkpointing is off: there is no checkpointing function to give")
    inner = graph_safe_checkpoint if graph_safe else checkpoint_block
    return inner if setting is True else PartialCheckpoint(float(setting), inner)
