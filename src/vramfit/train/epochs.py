"""Epochs as a unit beside steps: how many optimizer steps train.epochs takes, and at which step
an epoch ends (save.every_epochs, sample.every_epochs).

An epoch is one pass over the datasets with their repeats (a fractional weight makes the
epochs' lengths differ slightly), cut into same-bucket micro-batches; an optimizer step takes
grad_accum micro-batches on each of the processes. Everything here is a function of the data and
the global micro-batch count in the training state, so a resumed run marks the same steps.
"""
from __future__ import annotations

import bisect
import math

from vramfit.train.data import TrainingData
from vramfit.train.state import Progress


class EpochClock:
    """Where the epochs end in micro-batches, for one run's data and batch size."""

    def __init__(self, data: TrainingData, batch_size: int, per_step: int):
        self.data, self.batch_size, self.per_step = data, batch_size, per_step
        self._ends: list[int] = []  # micro-batches used when epoch i ends

    def end(self, epoch: int) -> int:
        """Micro-batches used by the end of epoch `epoch` (counting from 0)."""
        while len(self._ends) <= epoch:
            before = self._ends[-1] if self._ends else 0
            self._ends.append(before + self.data.epoch_length(len(self._ends), self.batch_size))
        return self._ends[epoch]

    def done(self, micro_batches: int) -> int:
        """Epochs finished once `micro_batches` micro-batches are used."""
        epoch = len(self._ends)
        while not self._ends or self._ends[-1] <= micro_batches:
            self.end(epoch)
            epoch += 1
        return bisect.bisect_right(self._ends, micro_batches)

    def steps_for(self, epochs: int) -> int:
        """Optimizer steps that train `epochs` whole epochs (the last may reach into the next)."""
        return max(1, math.ceil(self.end(epochs - 1) / self.per_step))

    def due(self, every: int):
        """A LoopHooks predicate: whether the step just taken finished an N-th epoch (N = every)."""
        def check(progress: Progress) -> bool:
            now = self.done(progress.micro_batches)
            before = self.done(max(0, progress.micro_batches - self.per_step))
            return now // every > before // every
        return check
