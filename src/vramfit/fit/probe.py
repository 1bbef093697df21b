"""Fit probe: before the cache is filled, measure two real training steps and stop early when
the run cannot fit.

A stand-in denoiser of the same architecture is built with throwaway (zero) weights, placed exactly
as the run will place it (train/setup.py place_denoiser: precision, LoRA, quantized base,
checkpointing, streaming, offload; with [ema] on the GPU, an EMA of its trained weights) and trained
for two optimizer steps of up to two micro-batches each by the training loop itself, on a synthetic
batch of the largest bucket's shapes. Two steps, because the optimizer state exists only from the
first step on and the second step's backward is the real peak; two micro-batches, because the
accumulated gradients live through the next backward. Memory does not depend on weight values, so
the peak equals the run's; the real weights are never touched, so nothing has to be put back: the
stand-in, its optimizer and their device memory are dropped afterwards.

Cost: the stand-in in host memory (the denoiser's size in its training precision, beside the
real one) and four micro-steps, a few seconds on a GPU. Only acts on CUDA (memory.fit_probe);
on the CPU it is skipped, unless a measuring function is passed in (tests).
"""
from __future__ import annotations

import dataclasses
import logging
import mmap
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

import torch
from accelerate import init_empty_weights

from vramfit.config.rules import streamed_sums_on_device
from vramfit.config.schema import RunConfig
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import PlanError, budget_of, choose, setting
from vramfit.memory import pinned
from vramfit.memory.accounting import return_freed_host_memory
from vramfit.memory.ema import EMA
from vramfit.optim.build import build_optimizer, build_schedule
from vramfit.train import graphs
from vramfit.train.data import free_device_memory
from vramfit.train.engine import StepEngine
from vramfit.train.loop import LoopHooks, run_loop
from vramfit.train.setup import place_denoiser
from vramfit.train.state import Progress

log = logging.getLogger("vramfit")
GIB = 2**30
Measure = Callable[[Callable[[], object]], int]  # runs the steps, returns their peak bytes


class FitProbeError(ValueError):
    """The probe's measured peak does not fit; the message says by how much and what to change."""


# What the loop names when a step is not finite (the zero-weight stand-in under an fp8 base gives
# NaN, which the probe's "skip" policy skips: the memory was still used).
PROBE_RECORD = SimpleNamespace(item=SimpleNamespace(key="the fit probe's synthetic batch"))


class _SyntheticData:
    """What the training loop asks of TrainingData, answered with one synthetic batch."""

    def __init__(self, batch: dict[str, torch.Tensor], size: int):
        self._batch, self._size = batch, size
        self.trained = [PROBE_RECORD]

    def batches(self, batch_size: int, generator: torch.Generator, shuffle: bool, epoch: int = 0) -> Iterator[list]:
        return iter([[PROBE_RECORD] * self._size] * 64)

    def batch(self, records: list) -> dict[str, torch.Tensor]:
        return self._batch


def stand_in(bundle, dtype: torch.dtype):
    """A copy of `bundle` whose denoiser has the same architecture and zero weights, on the CPU."""
    real = bundle.denoiser
    with init_empty_weights(include_buffers=False):
        model = type(real).from_config(real.config)
    model = model.to(dtype)
    untouched_zeros(model)
    real_buffers = dict(real.named_buffers())
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(real_buffers[name])  # fixed tables (positional embeddings), small
    return dataclasses.replace(bundle, denoiser=model, vae=None, text_encoders=[])


def untouched_zeros(model: torch.nn.Module, align: int = 64) -> None:
    """Give `model`'s (meta) parameters CPU memory that reads as zeros and is not resident: parts
    of one anonymous memory map never written. Pages nobody writes are the kernel's shared zero
    page, so the stand-in costs no host memory until the run's placement copies from it (into its
    own homes, or to the device), where a zeroed copy would hold the denoiser's size beside the
    real one for the whole probe."""
    placed: dict[int, torch.nn.Parameter] = {}
    slots = [(m, name, p) for m in model.modules() for name, p in m.named_parameters(recurse=False)]
    total = sum(-(-p.numel() * p.element_size() // align) * align for _, _, p in slots) or align
    memory = mmap.mmap(-1, total)  # each tensor below keeps it alive
    offset = 0
    for module, name, p in slots:
        if id(p) not in placed:  # tied weights stay tied
            # a tensor of its own over the map (not a view of one): views of one base would share
            # autograd's version counter, and a weight stepped in place would fail the others' checks
            data = torch.frombuffer(memory, dtype=p.dtype, count=p.numel(), offset=offset).view(p.shape) \
                if p.numel() else torch.empty(p.shape, dtype=p.dtype)
            placed[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            offset += -(-p.numel() * p.element_size() // align) * align
        module._parameters[name] = placed[id(p)]


def cuda_peak(device: torch.device, reserved: bool = False) -> Measure:
    """The peak allocated bytes of `run`; with `reserved` the peak reserved instead (CUDA graphs
    keep their pool's room reserved, not allocated, while eager work runs beside it)."""
    def measure(run: Callable[[], object]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated)(device)
    return measure


def probe_steps(family, bundle, cfg: RunConfig, device: torch.device, bucket: tuple[int, int]) -> Callable[[], object]:
    """The probe's work: place a stand-in and train it two steps; returns the callable that
    runs the steps (placement happens first, outside the measured part)."""
    train = cfg.train.model_copy(update={"steps": 2, "grad_accum": min(cfg.train.grad_accum, 2),
                                         "warmup_steps": 0, "nonfinite": "skip"})
    dtype = torch.bfloat16 if cfg.train.precision == "full_bf16" else torch.float32
    twin = stand_in(bundle, dtype)
    streamer = place_denoiser(twin, cfg, device)
    if streamer is not None:  # its sums at home: the GPU's work and copies, not a sum per value
        streamer.share_home_sums()
    optimizer = build_optimizer(twin.denoiser.parameters(), train)
    schedule = build_schedule(optimizer, train)
    batch = family.synthetic_batch(dict(twin.denoiser.config), cfg.step_batch, bucket, cfg)
    data = _SyntheticData(batch, cfg.step_batch)
    ema = probe_ema(twin.denoiser, cfg)
    hooks = LoopHooks(on_update=ema.maybe_update if ema is not None else None)

    def run():  # the LoopResult of the two steps
        engine = StepEngine(family, twin, optimizer, train, device, streamer=streamer)
        return run_loop(engine, data, schedule, train, Progress(), hooks=hooks, shuffle=False)
    return run


def probe_ema(denoiser: torch.nn.Module, cfg: RunConfig) -> Optional[EMA]:
    """The EMA a run with [ema] on the GPU keeps beside the weights (memory/ema.py), over the
    stand-in's trained tensors, so the measured peak holds its shadows; None otherwise (an EMA in
    CPU memory takes no GPU memory: leaving it out spares its host copies)."""
    e = cfg.ema
    if not e.enabled or e.device != "gpu":
        return None
    params = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    return EMA(params, decay=e.decay, update_every=e.update_every, warmup=e.warmup, device=e.device,
               dtype=e.dtype, seed=cfg.train.seed)


def fit_probe(family, bundle, cfg: RunConfig, device: torch.device, buckets: list[tuple[int, int]],
              *, limit: Optional[int] = None, measure: Optional[Measure] = None) -> Optional[int]:
    """Measure the training peak at the largest bucket; raise FitProbeError when it exceeds
    `limit` (default: memory.vram_budget, else the GPU's total). Returns the peak, or None when
    skipped (memory.fit_probe off, or no CUDA and no `measure` given)."""
    if not cfg.memory.fit_probe or not buckets:
        return None
    if measure is None:
        if device.type != "cuda":
            log.debug("fit probe skipped: it measures CUDA memory and the device is %s", device)
            return None
        measure = cuda_peak(device, reserved=cfg.train.cuda_graphs is True)
    if limit is None:
        limit = budget_of(cfg) or torch.cuda.get_device_properties(device).total_memory
    bucket = max(buckets, key=lambda b: b[0] * b[1])
    what = f"{cfg.step_batch} x {bucket[0]}x{bucket[1]}"
    failed = False
    try:
        peak = measure(probe_steps(family, bundle, cfg, device, bucket))
    except torch.cuda.OutOfMemoryError:  # (the exception is not kept: its frames hold the stand-in)
        peak, failed = limit + 1, True
    except Exception as exc:  # a probe that cannot run is no reason to stop; training will tell
        log.warning("fit probe could not run (%s: %s); continuing without it", type(exc).__name__, exc)
        return None
    finally:
        free_device_memory(device)
        pinned.release_deferred()
        return_freed_host_memory()  # the stand-in's host memory, before the run's own is made
        if cfg.train.cuda_graphs is True and device.type == "cuda":
            # the cuBLAS workspaces the probe's recordings made would pin their pool through caching

            if graphs.release_cublas_workspaces():
                torch.cuda.empty_cache()
    if peak > limit:
        measured = "ran out of GPU memory" if failed else f"peaked at {peak / GIB:.2f} GiB"
        raise FitProbeError(
            f"fit probe: two training steps at the largest bucket ({what}) {measured}, more than the "
            f"{limit / GIB:.2f} GiB {'budget' if cfg.memory.vram_budget else 'of the GPU'}; nothing was "
            f"cached. {_graphs_note(cfg)}{_sums_note(cfg)}{_suggestion(cfg, limit)}")
    log.info("fit probe: two training steps at %s peaked at %.2f GiB of %.2f GiB", what, peak / GIB, limit / GIB)
    return peak


def _graphs_note(cfg: RunConfig) -> str:
    if cfg.train.cuda_graphs is not True:
        return ""
    return ("With train.cuda_graphs this counts the recordings' memory pool, which stays reserved between "
            "steps; the same step without them (--set train.cuda_graphs=false) holds less. ")


def _sums_note(cfg: RunConfig) -> str:
    if not streamed_sums_on_device(cfg):
        return ""
    return ("With memory.streamed_grad_sums = \"device\" this counts the streamed weights' gradient sums "
            "kept on the GPU; \"home\" sums them in CPU memory and holds less. ")


def _suggestion(cfg: RunConfig, limit: int) -> str:
    try:
        choice = choose(cfg, limit, read_facts(cfg))
    except PlanError as exc:
        return f"The planner finds no setting that fits either: {exc}"
    except Exception as exc:  # the probe's message matters more than the planner's
        return f"(no planner suggestion: {exc})"
    changed = {k: v for k, v in choice.chosen.items() if v != setting(cfg, k)}
    if not changed:
        return ("The planner predicts these settings fit, so its prediction is off here: lower "
                "train.batch_size or data.resolution, or turn on memory.stream_weights.")
    settings = " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changed.items())
    return f"The planner suggests: {settings} (or set memory.vram_budget to let it choose)."
