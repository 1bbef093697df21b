"""Measured memory by phase: peak GPU allocated and reserved, peak process RSS, wall time.

Each phase resets CUDA's peak counters on entry and reads them on exit. Process RSS has no
per-phase peak counter, so a daemon thread samples it every 20 ms while a phase runs; its cost
is one /proc read per sample. Cost on CPU-only runs: the sampler thread alone.
"""
from __future__ import annotations

import ctypes
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import psutil
import torch

from vramfit.formats.safetensors_io import write_text_atomic
from vramfit.memory import pinned

GIB = 2**30


def pick_device(name: str) -> torch.device:
    """The device a setting names (train.device, generate's --device): "auto" is the GPU when
    there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def concrete_device(device) -> torch.device:
    """`device` as tensors on it report it: "cuda" without an index is the current GPU, cuda:N."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really stores; quantized tensor subclasses are counted by their parts."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        return sum(tensor_bytes(getattr(t, name)) for name in flatten()[0])
    return t.numel() * t.element_size()


@dataclass
class CopyCounters:
    """Bytes of compute-side copies a weight streamer holds: made, held now, and at most."""

    fetches: int = 0
    fetched_bytes: int = 0
    device_bytes: int = 0
    peak_device_bytes: int = 0

    def fetched(self, nbytes: int) -> None:
        self.fetches += 1
        self.fetched_bytes += nbytes
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def released(self, nbytes: int) -> None:
        self.device_bytes -= nbytes


@dataclass
class PhaseMemory:
    name: str
    seconds: float = 0.0
    gpu_peak_allocated: int = 0
    gpu_peak_reserved: int = 0
    rss_peak: int = 0
    # pinned CPU memory held at the phase's end: torch's caching host allocator's blocks (rounded up,
    # cached ones too) and the exact-size ones of memory/pinned.py
    pinned: int = 0
    steps: int = 0
    step_seconds: Optional[float] = None  # median seconds per step, for phases that step
    images_per_second: Optional[float] = None  # training: images a step (batch x accumulation) / median step

    def set_images_per_step(self, images: int) -> None:
        """Record throughput from the median step time (set step_seconds first)."""
        if self.step_seconds:
            self.images_per_second = images / self.step_seconds


@dataclass
class MemoryReport:
    device: str
    gpu_name: Optional[str] = None
    gpu_total: Optional[int] = None
    phases: list[PhaseMemory] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"device": self.device, "gpu_name": self.gpu_name, "gpu_total_bytes": self.gpu_total,
                "phases": [asdict(p) for p in self.phases]}

    def write(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2))

    def table(self) -> str:
        rows = [f"{'phase':<14}{'GPU alloc':>11}{'GPU resv':>11}{'RSS':>10}{'time':>9}{'s/step':>9}{'img/s':>9}"]
        for p in self.phases:
            gpu = self.device.startswith("cuda")
            alloc = f"{p.gpu_peak_allocated / GIB:.2f}G" if gpu else "-"
            resv = f"{p.gpu_peak_reserved / GIB:.2f}G" if gpu else "-"
            per = f"{p.step_seconds:.3f}" if p.step_seconds is not None else "-"
            ips = f"{p.images_per_second:.2f}" if p.images_per_second is not None else "-"
            rows.append(f"{p.name:<14}{alloc:>11}{resv:>11}{p.rss_peak / GIB:>9.2f}G{p.seconds:>8.1f}s{per:>9}{ips:>9}")
        return "\n".join(rows)


try:
    _LIBC = ctypes.CDLL("libc.so.6")  # glibc: malloc_trim (`return_freed_host_memory`)
    _LIBC.malloc_trim  # noqa: B018 - musl's libc.so.6, if any, may lack it
except (OSError, AttributeError):
    _LIBC = None


def return_freed_host_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    freed tensors between live ones otherwise stay resident."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class _RssSampler(threading.Thread):
    def __init__(self, interval: float = 0.02):
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = self.proc.memory_info().rss
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak, self.proc.memory_info().rss)


class MemoryTracker:
    """Collects a PhaseMemory for each `with tracker.phase(name):` block."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        name = torch.cuda.get_device_name(device) if self.cuda else None
        total = torch.cuda.get_device_properties(device).total_memory if self.cuda else None
        self.report = MemoryReport(str(device), name, total)

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseMemory]:
        rec = PhaseMemory(name)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        sampler = _RssSampler()
        sampler.start()
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
                rec.gpu_peak_allocated = torch.cuda.max_memory_allocated(self.device)
                rec.gpu_peak_reserved = torch.cuda.max_memory_reserved(self.device)
                pinned.release_deferred()
                stats = getattr(torch.cuda, "host_memory_stats", dict)()  # not in older torch
                rec.pinned = stats.get("allocated_bytes.current", 0) + pinned.locked_bytes()
            rec.rss_peak = sampler.stop()
            rec.seconds = time.perf_counter() - t0
            self.report.phases.append(rec)
