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

With train.distributed = "fsdp" (full fine-tune, AdamW) the denoiser is sharded in place by torch's
FSDP2 `fully_shard` (accelerate enables its FSDP plugin only on accelerator devices, so vramfit makes
the same call itself and the CPU tests run the GPU code): each block-list element is one unit,
gathered for its forward and backward. The optimizer steps each rank's local shards (exact for
AdamW, element by element); checkpoints and training states are gathered whole to rank 0 and are
the files a single process writes, so a state resumes on any world size.

Cost against one GPU: DDP: one all-reduce of the trainable gradients per optimizer step (overlapped
with backward), every rank holding a whole model, gradients and optimizer state. FSDP: weights,
gradients and optimizer state are 1/N per rank plus the gathered units in flight; each unit's weights
are all-gathered in forward and again in backward and its gradients reduce-scattered (about 1.5x
DDP's traffic); a checkpoint or state gathers everything through rank 0's host memory. Both: one
all-reduce of a scalar for the loss and one for the stop flag per step, a barrier after caching and
around class-image generation. See docs/multi-gpu.md for what composes and what is refused.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Iterator, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from vramfit.config.rules import process_problems
from vramfit.config.schema import RunConfig
from vramfit.data.fingerprint import digest
from vramfit.train.state import ResumeError


def launched_world() -> int:
    """Processes of this run as the launcher (torchrun / accelerate launch) announced them."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def composition_problems(cfg: RunConfig, world: int) -> list[str]:
    """What this config cannot do on `world` processes; empty when it composes (always for 1).
    The rules are config/rules.py's PROCESS_RULES."""
    return process_problems(cfg, world)


def micro_batch_generator(seed: int, index: int) -> torch.Generator:
    """The generator of global micro-batch `index`: the same on any rank and any world size."""
    return torch.Generator().manual_seed(int(digest("micro-batch noise", seed, index)[:15], 16))


class DataParallel:
    """This process's place among the ranks; `DataParallel()` is the plain single-process run."""

    def __init__(self, accelerator=None, sharded: bool = False):
        self.accelerator = accelerator
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.world = accelerator.num_processes if accelerator is not None else 1
        self.sharded = sharded  # train.distributed = "fsdp"
        self.model: Optional[torch.nn.Module] = None  # the DDP-wrapped denoiser once wrap() ran
        self.fsdp_root: Optional[torch.nn.Module] = None  # the sharded denoiser (wrapped in place)
        self._pairs: list = []  # FSDP: (sharded parameter, its local shard as the optimizer sees it)
        self._step_done = False

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
        """Wrap the placed denoiser in DDP, or shard it (FSDP); nothing for one process."""
        if self.world <= 1:
            return
        if self.sharded:
            self.fsdp_root = shard_denoiser(module, self.accelerator.device, self.world)
            return

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
        if self.fsdp_root is not None:
            if self._step_done:
                self._drop_stale_gradients()
            self._step_done = last
            return nullcontext() if last else _fsdp_no_sync(self.fsdp_root)
        if last or self.model is None:
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

    # ---- whole weights for rank 0's files (FSDP gathers them; every rank must take part) ----------
    def whole_bundle(self, bundle):
        """The bundle with a whole denoiser on rank 0 (None on the others). With FSDP this gathers
        every weight to rank 0's host memory into an unsharded copy; otherwise it is the bundle."""
        if self.fsdp_root is None:
            return bundle if self.main else None
        state = _gather(bundle.denoiser.state_dict(), self.main)
        if not self.main:
            return None
        module = bundle.denoiser
        with torch.device("meta"):
            whole = type(module).from_config(module.config)
        whole.load_state_dict(state, assign=True)
        return replace(bundle, denoiser=whole)

    # ---- FSDP: the optimizer steps each rank's shards ---------------------------------------------
    def trainable(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The tensors the optimizer steps. Under FSDP: each rank's shard of every parameter, as a
        Parameter sharing the shard's storage, so vramfit's per-parameter optimizers run unchanged
        on plain tensors and their state is sharded too; `attach` hands them their gradients."""
        params = [p for p in module.parameters() if p.requires_grad]
        if self.fsdp_root is None:
            return params
        self._pairs = [(p, torch.nn.Parameter(p.to_local())) for p in params]
        return [local for _, local in self._pairs]

    def attach(self, optimizer) -> None:
        """Under FSDP: right before each optimizer step (after clipping, which needs the sharded
        DTensor gradients for the global norm), each shard takes its DTensor gradient's local part."""
        if self.fsdp_root is not None:
            optimizer.register_step_pre_hook(lambda *_: self._gradients_to_shards())

    def _gradients_to_shards(self) -> None:
        for p, local in self._pairs:
            local.grad = None if p.grad is None else p.grad.to_local()
            p.grad = None

    def _drop_stale_gradients(self) -> None:
        # A skipped (non-finite) step leaves DTensor gradients that must not reach the next one.
        for p, _ in self._pairs:
            p.grad = None

    def whole_state(self, model: torch.nn.Module, optimizer):
        """(model, optimizer) as a training state saves them: under FSDP, views of the weights and
        of the optimizer state gathered whole on rank 0 (every rank takes part), so the state is
        the one a single process writes and resumes on any world size; else the objects themselves."""
        if self.fsdp_root is None:
            return model, optimizer
        weights = _gather({n: p for n, p in model.named_parameters() if p.requires_grad}, self.main)
        saved = optimizer.state_dict()
        saved["state"] = {i: _gather({k: self._as_dtensor(i, v) for k, v in state.items()}, self.main)
                          for i, state in sorted(saved["state"].items())}
        return _Weights(weights), _Saved(saved)

    def _as_dtensor(self, index: int, value):
        p, local = self._pairs[index]
        if torch.is_tensor(value) and value.shape == local.shape and value.dim():
            return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return value

    def loadable(self, model: torch.nn.Module):
        """What load_state copies weights into: under FSDP each parameter takes its own shard."""
        return model if self.fsdp_root is None else _ShardTargets(model)

    def shard_optimizer_state(self, optimizer) -> None:
        """After loading a whole optimizer state under FSDP: each state tensor shaped like its whole
        parameter keeps this rank's shard of it."""
        if self.fsdp_root is None:
            return
        for i, (p, local) in enumerate(self._pairs):
            state = optimizer.state.get(local, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.dim():
                    state[key] = _shard_of(value, p).to(local.dtype if value.is_floating_point() else value.dtype)

    def report_name(self, name: str) -> str:
        """Rank 0's memory report keeps the plain name; rank r > 0 writes <name>.memory.rank<r>.json."""
        return f"{name}.memory.json" if self.main else f"{name}.memory.rank{self.rank}.json"

    def close(self) -> None:
        if self.world > 1:
            self.barrier()
            self.accelerator.end_training()


def shard_denoiser(module: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """Shard the denoiser's weights over `world` ranks in place (torch's FSDP2 `fully_shard`): each
    element of its top-level block lists (SDXL: down/up blocks; SD3: transformer blocks) is one unit,
    gathered for its forward and backward and freed after; the rest (embeddings, mid block, heads)
    is the root unit. Parameters become DTensors holding 1/world of each tensor."""
    mesh = init_device_mesh(device.type, (world,))
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _gather(tensors: dict, keep: bool) -> dict:
    """Whole copies (on the CPU) of a dict's DTensors, in key order on every rank (each gather is a
    collective); other values as they are. Only a rank with `keep` holds the result."""
    out = {}
    for key in sorted(tensors, key=str):
        value = tensors[key]
        if isinstance(value, DTensor):
            value = value.full_tensor().detach().cpu()
        if keep:
            out[key] = value.detach().cpu() if torch.is_tensor(value) else value
    return out


class _Weights:
    """Gathered weights as a module's named_parameters(), for save_state and assert_finite."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def named_parameters(self):
        return ((n, torch.nn.Parameter(t, requires_grad=True)) for n, t in self.weights.items())


class _Saved:
    """A gathered optimizer state as an optimizer's state_dict(), for save_state."""

    def __init__(self, saved: dict):
        self.saved = saved

    def state_dict(self) -> dict:
        return self.saved


class _ShardTargets:
    """A sharded module's parameters as load_state copies into them: a whole tensor goes in as
    this rank's shard."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def named_parameters(self):
        return ((n, _ShardTarget(p)) for n, p in self.module.named_parameters())


class _ShardTarget:
    def __init__(self, param):
        self.param, self.requires_grad = param, param.requires_grad

    def copy_(self, whole: torch.Tensor) -> None:
        self.param.to_local().copy_(_shard_of(whole, self.param))


def _shard_of(whole: torch.Tensor, like) -> torch.Tensor:
    """This rank's shard of a whole tensor, sharded as the DTensor `like` is (no communication)."""
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


@contextmanager
def _fsdp_no_sync(root):
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def start(cfg: RunConfig) -> DataParallel:
    """The ranks of this run: a plain DataParallel() unless launched on several processes, where
    accelerate sets up the process group (NCCL on GPUs, gloo on CPUs). What does not compose on
    several processes was refused before, when the config was resolved (fit/resolve.py)."""
    if launched_world() <= 1:
        return DataParallel()
    cpu = cfg.train.device == "cpu" or not torch.cuda.is_available()
    # Rank 0 alone converts or downloads the model and generates class images while the others
    # wait in a collective; NCCL's default 10-minute timeout would end such a wait, so allow hours.
    wait = InitProcessGroupKwargs(backend="gloo" if cpu else "nccl", timeout=timedelta(hours=6))
    # accelerate's own mixed precision stays off: train.precision already decides the dtypes.
    return DataParallel(Accelerator(cpu=cpu, mixed_precision="no", kwargs_handlers=[wait]),
                        sharded=cfg.train.distributed == "fsdp")


def resume_configs(saved: dict, current: dict, world: int, path) -> tuple[dict, dict]:
    """Saved and current config dicts made comparable across world sizes. A state continues
    exactly when an optimizer step consumes as many micro-batches as before (world x grad_accum):
    then the same groups, noise and averaged gradients follow. Otherwise a ResumeError says so."""
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
