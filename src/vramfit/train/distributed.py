"""Data-parallel training over several processes (one per GPU) through accelerate.

A run started by `accelerate launch` (or `vramfit train --gpus N`, launch.py) has a world of N
ranks; a run started any other way has a world of one and none of this changes it. What is split
and how, so that N ranks x grad_accum a train exactly what one process x grad_accum N*a trains:

- Data: every rank walks the same seeded epoch order of same-bucket groups (train/loop.py's
  epoch_batches); of each N consecutive micro-batches rank r takes the r-th. One optimizer step
  consumes N*a micro-batches on every world size, so the groups of a step are the same.
- Noise: each micro-batch draws its noise, timesteps and latent sample from a generator seeded by
  (train.seed, global micro-batch index), so it draws the same numbers on whichever rank (or in
  whichever single process) it lands. Resume needs nothing more than the index (in Progress).
- Gradients: DDP (accelerate's prepare_model) averages them across ranks in the backward of the
  step's last micro-batch; earlier ones run under no_sync. Each rank divides its loss by its own a,
  so the average equals one process's sum over N*a micro-batches divided by N*a. The logged loss is
  the same average (one all-reduce of a scalar per step). Frozen parameters are left out of DDP's
  start-up broadcast (every rank loaded the same file).
- Caching: each rank encodes its share of the missing entries; the cache is content-addressed and
  written atomically, so after a barrier every rank reads all of them.
- Files: rank 0 writes everything; each rank writes its own memory report.

Cost against one GPU: one all-reduce of the trainable gradients per optimizer step (overlapped with
backward by DDP), one all-reduce of a scalar for the loss and one for the stop flag per step, a
barrier after caching and around class-image generation. Every rank holds a whole model (DDP does
not shard). See docs/multi-gpu.md for what composes and what the config check refuses.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Iterator, Optional

import torch

from vramfit.config.schema import RunConfig
from vramfit.data.fingerprint import digest


def launched_world() -> int:
    """Processes of this run as the launcher (torchrun / accelerate launch) announced them."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def composition_problems(cfg: RunConfig, world: int) -> list[str]:
    """What this config cannot do on `world` processes; empty when it composes (always for 1)."""
    if world <= 1:
        return []
    t, problems = cfg.train, []
    where = f"with {world} processes (data-parallel)"
    if cfg.train.distributed == "fsdp":
        problems.append("train.distributed: 'fsdp' is not implemented yet; use 'ddp' (every rank holds the "
                        "whole model; see docs/multi-gpu.md)")
    if t.optimizer_in_backward:
        problems.append(f"train.optimizer_in_backward: does not compose {where}: each parameter would step "
                        "in its gradient hook before DDP has averaged that gradient across ranks, so the "
                        "ranks would drift apart; set it to false")
    if (t.mode == "full" and t.precision == "full_bf16" and t.stochastic_rounding and t.grad_accum > 1):
        problems.append(f"train.grad_accum = {t.grad_accum} with full_bf16 weights and stochastic_rounding: "
                        f"bf16 gradient sums rounded stochastically (a gradient hook) do not compose {where}, "
                        "as DDP reads each gradient in that hook's place; use train.grad_accum = 1 (the "
                        "processes multiply the batch already), train.stochastic_rounding = false or "
                        "train.precision = 'mixed_bf16'")
    if cfg.memory.stream_weights:
        problems.append(f"memory.stream_weights: does not compose {where}: streamed weights and their "
                        "gradients live in host memory, where DDP's GPU all-reduce cannot reach them; set it "
                        "to false (each GPU then holds the whole denoiser)")
    return problems


def micro_batch_generator(seed: int, index: int) -> torch.Generator:
    """The generator of global micro-batch `index`: the same on any rank and any world size."""
    return torch.Generator().manual_seed(int(digest("micro-batch noise", seed, index)[:15], 16))


class DataParallel:
    """This process's place among the ranks; `DataParallel()` is the plain single-process run."""

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.world = accelerator.num_processes if accelerator is not None else 1
        self.model: Optional[torch.nn.Module] = None  # the DDP-wrapped denoiser once wrap() ran

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> Optional[torch.device]:
        """The device this rank trains on (None for a single process: train.device decides)."""
        return self.accelerator.device if self.accelerator is not None else None

    def barrier(self) -> None:
        if self.world > 1:
            self.accelerator.wait_for_everyone()

    @contextmanager
    def main_first(self):
        """Rank 0 runs the block first (downloads, conversions, class images); the others after it."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    def share(self, items: list) -> list:
        """This rank's share of a list every rank computed alike. The barrier first makes sure no
        rank has started writing (which would change another rank's list) before all have listed."""
        if self.world <= 1:
            return items
        self.barrier()
        return items[self.rank::self.world]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The average of a scalar over the ranks (itself for one process)."""
        if self.world <= 1:
            return value
        return self.accelerator.reduce(value.detach().clone(), reduction="mean")

    def any_stop(self, requested: Optional[str], device: torch.device) -> Optional[str]:
        """A stop asked for on any rank stops every rank at the same step boundary."""
        if self.world <= 1:
            return requested
        flag = torch.tensor(1.0 if requested else 0.0, device=device)
        return requested or ("signal on another rank" if float(self.mean(flag)) > 0 else None)

    def wrap(self, module: torch.nn.Module) -> None:
        """Wrap the placed denoiser in DDP (nothing for one process)."""
        if self.world <= 1:
            return
        from torch.nn.parallel import DistributedDataParallel

        frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
        # Frozen weights and buffers are identical on every rank (loaded from one file), so DDP
        # neither broadcasts them at the start nor before each forward.
        frozen += [n for n, _ in module.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
        self.model = self.accelerator.prepare_model(module, device_placement=False)

    def forward_bundle(self, bundle):
        """The bundle whose denoiser the loss calls: the DDP wrapper, so its backward syncs."""
        return bundle if self.model is None else replace(bundle, denoiser=self.model)

    def sync(self, last: bool):
        """Context for one micro-batch's forward and backward: gradients are averaged across the
        ranks only in the optimizer step's last one."""
        if self.model is None or last:
            return nullcontext()
        return self.accelerator.no_sync(self.model)

    def micro_batches(self, batches: Iterator, progress) -> Iterator[tuple[int, list]]:
        """This rank's micro-batches from the global sequence, each with its global index. The
        global sequence advances `progress` for every micro-batch of every rank, so all ranks
        agree on the position (and a state saved by rank 0 is every rank's)."""
        while True:
            mine = None
            for r in range(self.world):
                group = next(batches)
                if r == self.rank:
                    mine = (progress.micro_batches - 1, group)
            yield mine

    def report_name(self, name: str) -> str:
        """Rank 0's memory report keeps the plain name; rank r > 0 writes <name>.memory.rank<r>.json."""
        return f"{name}.memory.json" if self.main else f"{name}.memory.rank{self.rank}.json"

    def close(self) -> None:
        if self.world > 1:
            self.barrier()
            self.accelerator.end_training()


def start(cfg: RunConfig) -> DataParallel:
    """The ranks of this run: a plain DataParallel() unless launched on several processes, where
    the config is checked for what does not compose (before any weight loads) and accelerate
    sets up the process group (NCCL on GPUs, gloo on CPUs)."""
    world = launched_world()
    if world <= 1:
        return DataParallel()
    problems = composition_problems(cfg, world)
    if problems:
        from vramfit.config.load import ConfigError

        raise ConfigError(problems, f"config for {world} processes")
    from accelerate import Accelerator

    cpu = cfg.train.device == "cpu" or not torch.cuda.is_available()
    # accelerate's own mixed precision stays off: train.precision already decides the dtypes.
    return DataParallel(Accelerator(cpu=cpu, mixed_precision="no"))


def resume_configs(saved: dict, current: dict, world: int, path) -> tuple[dict, dict]:
    """Saved and current config dicts made comparable across world sizes. A state continues
    exactly when an optimizer step consumes as many micro-batches as before (world x grad_accum):
    then the same groups, noise and averaged gradients follow. Otherwise a ResumeError says so."""
    from vramfit.train.state import ResumeError

    saved_world = int(saved.get("distributed", {}).get("world_size", 1))
    a_saved, a_now = saved.get("train", {}).get("grad_accum"), current["train"]["grad_accum"]
    if a_saved is None or (saved_world == world and a_saved == a_now):
        return saved, current
    per_step = saved_world * a_saved
    if per_step != world * a_now:
        fix = (f"train.grad_accum = {per_step // world} on {world} process(es)" if per_step % world == 0
               else f"a number of processes that divides {per_step}")
        raise ResumeError(
            f"{path} was saved by {saved_world} process(es) x train.grad_accum {a_saved} = {per_step} "
            f"micro-batches per optimizer step; now {world} x {a_now} = {world * a_now}, which would not "
            f"continue the same run. Use processes x grad_accum = {per_step} ({fix})")
    train = {**current["train"], "grad_accum": a_saved}
    return saved, {**current, "train": train}


def stamp(config: dict, ranks: DataParallel) -> dict:
    """The config dict a training state records, with the world size it was trained on."""
    return {**config, "distributed": {"world_size": ranks.world}}
