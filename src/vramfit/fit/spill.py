"""Spill warning: say so when a run near its memory limit suddenly runs several times slower.

NVIDIA's driver on Windows and WSL (the "CUDA - Sysmem Fallback Policy") does not fail an
allocation that exceeds the GPU's memory: it places the excess in system memory, reached over
PCIe, and the run continues many times slower without a word. The signs are both visible from
the training loop: reserved memory close to the limit (the device total or memory.vram_budget)
and steps that take much longer than they did. `SpillWatch` keeps the recent step times and
warns once when, after the first steps, `persist` steps in a row take more than `ratio` x the
median of the window before them while reserved memory is at or above `near` x the limit. One
slow step (a checkpoint save, a sample grid) is not enough. It only warns; it changes nothing.

Cost: a clock read and a `torch.cuda.memory_reserved` call per step.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Callable, Optional

import torch

log = logging.getLogger("vramfit")
GIB = 2**30


class SpillWatch:
    def __init__(self, limit: int, reserved: Callable[[], int], *, ratio: float = 2.5, window: int = 10,
                 warmup: int = 3, persist: int = 3, near: float = 0.9,
                 clock: Callable[[], float] = time.perf_counter, warn: Callable[[str], None] = log.warning):
        self.limit, self.reserved = limit, reserved
        self.ratio, self.warmup, self.persist, self.near = ratio, warmup, persist, near
        self.clock, self.warn = clock, warn
        self.times: deque[float] = deque(maxlen=window)
        self.seen = 0
        self.slow_in_a_row = 0
        self.warned = False
        self._last: Optional[float] = None

    @classmethod
    def for_device(cls, device: torch.device, budget: Optional[int] = None, **kwargs) -> Optional["SpillWatch"]:
        """A watch on a CUDA device against `budget` (default: the device's total); None elsewhere."""
        if device.type != "cuda":
            return None
        limit = budget or torch.cuda.get_device_properties(device).total_memory
        return cls(limit, lambda: torch.cuda.memory_reserved(device), **kwargs)

    def start(self) -> None:
        """Mark the start of the first timed step (else the first `step_done` only starts the clock)."""
        self._last = self.clock()

    def step_done(self) -> bool:
        """Call after each optimizer step; times it from the previous call. True when it warned now."""
        now = self.clock()
        if self._last is None:
            self._last = now
            return False
        seconds, self._last = now - self._last, now
        return self.observe(seconds)

    def observe(self, seconds: float) -> bool:
        """Record one step's duration; True when this step triggered the (single) warning."""
        self.seen += 1
        if self.seen <= self.warmup or len(self.times) < 2:
            if self.seen > self.warmup:
                self.times.append(seconds)
            return False
        typical = statistics.median(self.times)
        slow = seconds > self.ratio * typical
        self.slow_in_a_row = self.slow_in_a_row + 1 if slow else 0
        if not slow:
            self.times.append(seconds)  # the window keeps the normal pace, not the slow one
        if self.warned or self.slow_in_a_row < self.persist:
            return False
        reserved = self.reserved()
        if reserved < self.near * self.limit:
            return False
        self.warned = True
        self.warn(
            f"training slowed down: the last {self.slow_in_a_row} steps took {seconds:.2f} s against "
            f"{typical:.2f} s before, and {reserved / GIB:.2f} GiB of the {self.limit / GIB:.2f} GiB limit is "
            "reserved. The GPU driver is probably spilling GPU memory into system memory (NVIDIA's "
            "sysmem fallback on Windows and WSL), which runs many times slower. Lower memory.vram_budget "
            "so the planner picks leaner settings, turn on memory-saving settings (memory.offload_activations, "
            "train.optimizer_in_backward, memory.stream_weights), or set the driver's \"CUDA - Sysmem "
            "Fallback Policy\" to \"Prefer No Sysmem Fallback\" so an overflow fails at once instead.")
        return True
