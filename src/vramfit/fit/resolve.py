"""One resolution step: the user's config and an explicit environment become the run's config.

The schema (config/schema.py) is pure data: it validates what was written and leaves automatic
values as written ("auto"). Everything that depends on the machine happens here, once, from an
Environment (the device the run trains on, the processes launched, the GPU's and the host's
memory): train.cuda_graphs "auto" is decided, the settings the several processes refuse are
checked (config/rules.py), memory.vram_budget's plan is applied (fit/planner.py), and an unset
memory.streamed_grad_sums is decided after it (`with_grad_sums`). The fit
probe's adjustment, which needs the loaded model, is vramfit/run.py's `probed_config`, applied
once before caching. Downstream code receives the resolved config and never reassigns it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from vramfit.config import ConfigError
from vramfit.config.rules import graph_clashes, process_problems, streamed_sums_on_device
from vramfit.config.schema import RunConfig
from vramfit.fit.model_facts import ModelFacts, read_facts
from vramfit.fit.planner import (MARGIN, budget_of, check_host_budget, fit_to_budget, predict,
                                 resident_problem, with_values)
from vramfit.memory.accounting import pick_device
from vramfit.train.distributed import launched_world


@dataclass(frozen=True)
class Environment:
    """What the run's automatic values depend on, read once (`Environment.detect`) or given (tests)."""

    device: torch.device
    world: int = 1  # processes launched (torchrun / accelerate launch)
    gpu_bytes: Optional[int] = None  # the training GPU's memory

    @classmethod
    def detect(cls, cfg: RunConfig) -> "Environment":
        device = pick_device(cfg.train.device)
        gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        return cls(device, launched_world(), gpu)


def graphs_by_default(cfg: RunConfig, env: Environment) -> bool:
    """train.cuda_graphs = "auto": on for a run that trains on a GPU in one process (several: DDP
    averages gradients from hooks a replay skips), beside nothing that refuses them."""
    return env.device.type == "cuda" and env.world <= 1 and not graph_clashes(cfg)


def _automatic(section, update: dict):
    """`section` with `update` applied, the updated keys left out of those the user set
    (model_fields_set): the planner stays free to choose them."""
    out = section.model_copy(update=update)
    object.__setattr__(out, "__pydantic_fields_set__", section.model_fields_set - set(update))
    return out


def with_automatic_values(cfg: RunConfig, env: Environment) -> RunConfig:
    """`cfg` with its automatic values decided: train.cuda_graphs "auto" for `env`, and cache.text
    off where the text encoders train (lora.text_encoder_rank, train.text_encoders = "full": every
    caption is encoded anew each step; an explicit cache.text = true is refused by the schema)."""
    if cfg.text_encoder_training and cfg.cache.text:
        cfg = cfg.model_copy(update={"cache": _automatic(cfg.cache, {"text": False})})
    if cfg.train.cuda_graphs != "auto":
        return cfg
    return cfg.model_copy(update={"train": _automatic(cfg.train, {"cuda_graphs": graphs_by_default(cfg, env)})})


def resident_by_default(cfg: RunConfig) -> RunConfig:
    """memory.resident_blocks left out beside memory.stream_weights, after the budget's plan (which
    sets it when there is a budget): 0, every block streamed, as if written (the fit probe's
    suggestion, fit/probe.py, must not add resident blocks to a step it measured too large without)."""
    if not cfg.memory.stream_weights or cfg.memory.resident_blocks is not None:
        return cfg
    return cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"resident_blocks": 0})})


def resolve(cfg: RunConfig, env: Environment, cache_root: Optional[Path] = None) -> RunConfig:
    """The run's config for `env`: automatic values, the multi-process check, the budget's plan
    (which chooses memory.resident_blocks; without a budget it is 0), and memory.host_budget checked
    where no plan chose for it."""
    cfg = with_automatic_values(cfg, env)
    problems = process_problems(cfg, env.world)
    if problems:
        raise ConfigError(problems, f"config for {env.world} processes")
    cfg = with_grad_sums(resident_by_default(fit_to_budget(cfg, cache_root)), env, cache_root)
    check_resident(cfg, cache_root)
    check_host_budget(cfg, env.device.type == "cuda", cache_root)
    return cfg


def check_resident(cfg: RunConfig, cache_root: Optional[Path] = None) -> None:
    """memory.resident_blocks more than the model's stream blocks (which memory.stream_unit_mib, the
    training precision and a quantized base decide: fit/planner.py `block_count`): a ConfigError
    before any weight loads, read from the model's headers (a budget's plan has checked it already)."""
    if cfg.memory.stream_weights and cfg.memory.resident_blocks and budget_of(cfg) is None:
        problem = resident_problem(read_facts(cfg, cache_root), cfg)
        if problem:
            raise ConfigError([problem])


def with_grad_sums(cfg: RunConfig, env: Environment, cache_root: Optional[Path] = None,
                   facts: Optional[ModelFacts] = None) -> RunConfig:
    """memory.streamed_grad_sums unset where it applies (streamed weights that step on the device with
    accumulation, config/rules.py `streamed_sums_on_device`): "device" where the planner predicts the
    training phase with the sums fits in memory.vram_budget, or without one in the GPU's memory (each
    less the planner's margin; no limit known, as on the CPU: it fits); else "home". Where it does not
    apply it stays unset. `facts`: the model's (read from model.path when not given)."""
    on_device = with_values(cfg, {"memory.streamed_grad_sums": "device"})
    if cfg.memory.streamed_grad_sums is not None or not streamed_sums_on_device(on_device):
        return cfg
    budget = budget_of(cfg)
    limit = budget or env.gpu_bytes
    facts = facts or (None if limit is None else read_facts(on_device, cache_root))
    train = None if limit is None else next(
        p for p in predict(facts, on_device).phases if p.name == "train")
    usable = None if limit is None else int(limit * (1 - MARGIN))
    chosen = "device" if train is None or train.peak <= usable else "home"
    where = "" if train is None else (
        f": the train phase with them is predicted at {train.peak / 2**30:.2f} GiB, "
        f"{'within' if chosen == 'device' else 'over'} the {usable / 2**30:.2f} GiB usable of "
        + ("memory.vram_budget" if budget else "the GPU"))
    logging.getLogger("vramfit").info(
        "memory.streamed_grad_sums (unset): %s, the streamed weights' gradient sums of earlier "
        "micro-batches %s%s", chosen, "on the device" if chosen == "device" else "in CPU memory", where)
    return cfg.model_copy(update={"memory": _automatic(cfg.memory, {"streamed_grad_sums": chosen})})
