"""One training run: the budget plan and the fit probe (fit/) around the pieces of train/setup.py
(load, scan, cache, train, save, report), each phase measured. The composition lives above both
layers, so train/ never imports the planner or the probe."""
from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import diffusers
import torch
import transformers

from vramfit.config.load import dump_config
from vramfit.config.rules import graph_clashes, start_hints, streamed_sums_on_device
from vramfit.config.schema import RunConfig, ValidationConfig
from vramfit.data.scan import ScanResult
from vramfit.fit import probe
from vramfit.fit.planner import budget_of, setting, with_values
from vramfit.fit.resolve import Environment, resolve
from vramfit.fit.spill import SpillWatch
from vramfit.formats.lora import LORA_FILE_SUFFIXES
from vramfit.formats.safetensors_io import clean_stale_temps, write_text_atomic
from vramfit.memory.accounting import MemoryTracker
from vramfit.memory.ema import EMA
from vramfit.models.adapter import Family, ModelBundle
from vramfit.optim.build import build_optimizer, build_schedule
from vramfit.train import distributed, graphs
from vramfit.train.data import free_device_memory, tag_frequency
from vramfit.train.logs import RunLogger
from vramfit.train.lora import place_text_encoders, trained_weights
from vramfit.train.engine import StepEngine
from vramfit.train.loop import LoopHooks, LoopResult, StopFlag, run_loop
from vramfit.train.epochs import EpochClock
from vramfit.train.samples import SampleGrids
from vramfit.train.validation import Validation
from vramfit.train.setup import (Interrupted, RunResult, assert_finite, cache_root, check_resumable, held_signals,
                                 fill_cache, load_data, package_version, place_denoiser, resume_progress, save_on_main,
                                 signal_name, stop_on_signals, stopped_as)
from vramfit.train.state import EMA_FILE, Progress, ResumeError, find_state, load_ema, save_state, state_root

log = logging.getLogger("vramfit")


def probed_config(family: Family, bundle: ModelBundle, cfg: RunConfig, device: torch.device,
                  buckets: list, graphs_by: Optional[str] = None, sums_by: Optional[str] = None) -> RunConfig:
    """Run the fit probe (fit/probe.py; it raises FitProbeError when the step does not fit).
    Returns `cfg`; or, where a setting the user did not write holds more memory than its other
    value and the step does not fit, `cfg` with the other value once a second probe finds that the
    step with it does. `graphs_by`, `sums_by` name who chose the setting ("auto", the default, or
    "memory.vram_budget", the planner): CUDA graphs on (then off: the recordings' pool keeps its room
    reserved, which the probe counts), memory.streamed_grad_sums = "device" (then "home": the sums
    leave the GPU)."""
    chosen = [(fb, by) for fb, by in ((_GRAPHS_OFF, graphs_by), (_SUMS_HOME, sums_by))
              if by and setting(cfg, fb.key) != fb.value and fb.applies(cfg)]
    try:
        probe.fit_probe(family, bundle, cfg, device, buckets)
        return cfg
    except probe.FitProbeError as exc:
        if not chosen:
            raise
        failed = [str(exc).split("; nothing was cached")[0]]
    for i, (fb, by) in enumerate(chosen):
        log.warning("%s (%s): %s does not fit (%s); probing it %s", fb.key, by, fb.step, failed[-1],
                    fb.instead)
        cfg = with_values(cfg, {fb.key: fb.value})
        try:
            probe.fit_probe(family, bundle, cfg, device, buckets)
        except probe.FitProbeError as exc:  # the last one's whole message ends the error below
            failed.append(str(exc) if i + 1 == len(chosen) else str(exc).split("; nothing was cached")[0])
            continue
        log.info("%s (%s): %s, the step fits %s", fb.key, by, fb.shown, fb.instead)
        return cfg
    tried = ". ".join(f"{fb.held} ({by}): {measured}" for (fb, by), measured in zip(chosen, failed))
    raise probe.FitProbeError(f"{tried}. {chosen[-1][0].without}: {failed[-1]}")


@dataclass(frozen=True)
class _Fallback:
    """A setting's value that holds less GPU memory, tried when the probe finds the step does not fit."""

    key: str
    value: object
    shown: str  # the value, as the log says it
    step: str  # the step that did not fit
    instead: str  # how the step is probed again
    held: str  # the first measurement, in the error
    without: str  # the second one, in the error
    applies: Callable[[RunConfig], bool]


_GRAPHS_OFF = _Fallback("train.cuda_graphs", False, "off", "the recorded step", "without graphs",
                        "with CUDA graphs", "Without them", lambda cfg: True)
_SUMS_HOME = _Fallback("memory.streamed_grad_sums", "home", "home",
                       "the step with the streamed weights' gradient sums on the device",
                       "with the sums in CPU memory", 'with memory.streamed_grad_sums = "device"',
                       'With "home"', streamed_sums_on_device)


def chosen_by(user: RunConfig, run: RunConfig, key: str) -> Optional[str]:
    """Who chose `key` ("section.name") in `run` when the user's config `user` did not write it:
    "auto" (the default) or "memory.vram_budget" (the planner); None when the user set the key."""
    section, name = key.split(".")
    if name in getattr(user, section).model_fields_set:
        return None
    return "memory.vram_budget" if name in getattr(run, section).model_fields_set else "auto"


def graphs_chosen_by(user: RunConfig, run: RunConfig) -> Optional[str]:
    """Who turned CUDA graphs on in `run` when the user's config `user` did not ask for them:
    "auto" (the default) or "memory.vram_budget" (the planner); None when the user set the key."""
    return chosen_by(user, run, "train.cuda_graphs")


@stopped_as("before training began: nothing was trained, what is cached is kept; run the same command again")
def train_run(cfg: RunConfig, *, progress: bool = True, resume: Optional[str] = None,
              warn_earlier: bool = True) -> RunResult:
    """Train `cfg` (from the training state `resume` names, if any). Without `resume`, where output.dir
    holds an earlier run that this one will write over, a warning says so first (unless not
    `warn_earlier`: the demo starts over by design)."""
    user = cfg
    env = Environment.detect(cfg)
    # automatic values and memory.vram_budget's choice, before any weight loads (fit/resolve.py)
    cfg = resolve(cfg, env, cache_root(cfg))
    graphs_by = graphs_chosen_by(user, cfg)
    if graphs_by == "auto":
        clash = graph_clashes(cfg)
        log.info("train.cuda_graphs (auto): %s", "on" if cfg.train.cuda_graphs else
                 f"off beside {' and '.join(clash)}" if clash else "off (no GPU, or several processes)")
    ranks = distributed.start(cfg)  # one process unless launched on several
    device = ranks.device or env.device
    if cfg.train.cuda_graphs is True:  # before any weight loads
        graphs.check_device(device)
    if cfg.train.epochs is None:  # with train.epochs the steps are known once the data is read
        check_resumable(cfg, resume, ranks.world)
    torch.manual_seed(cfg.train.seed)
    out = cfg.output_dir
    earlier = _earlier_run(out, cfg.save.name) if ranks.main and warn_earlier and not resume else []
    if earlier:
        log.warning("output.dir %s holds an earlier run (%s): this run writes over them; --resume latest "
                    "continues that run instead (with a larger train.steps where it had finished)", out,
                    ", ".join(earlier))
    out.mkdir(parents=True, exist_ok=True)
    if ranks.main:
        clean_stale_temps([out, state_root(out)])  # left by killed runs (the cache cleans its own)
        write_text_atomic(out / "config.toml", dump_config(cfg))
    progress = progress and ranks.main and cfg.logging.progress
    tracker = MemoryTracker(device)
    planned = cfg

    loaded = load_data(cfg, tracker, device, progress, ranks)
    family, bundle, data, scanned = loaded
    if not ranks.sharded:  # the fit probe measures a step of the largest bucket before anything is cached
        with stopped_as("while measuring a training step (memory.fit_probe): nothing was cached yet; run the "
                        "same command again"):
            cfg = probed_config(family, bundle, cfg, device, [r.bucket for r in data.records], graphs_by,
                                chosen_by(user, cfg, "memory.streamed_grad_sums"))
    clock = EpochClock(data, cfg.train.batch_size, cfg.train.grad_accum * ranks.world)
    if cfg.train.epochs is not None:  # the steps of the epochs, checked against the state before caching
        cfg = _steps_of_epochs(cfg, clock)
        check_resumable(cfg, resume, ranks.world)
    sample_inputs = fill_cache(cfg, loaded, tracker, device, progress, ranks)
    if cfg is not planned and ranks.main:  # the probe changed a setting the user did not write
        write_text_atomic(out / "config.toml", dump_config(cfg))
    # peft draws the LoRA init from torch's global generator; seed it here, after whatever the
    # preparation drew (class images), so the same config starts from the same adapter.
    torch.manual_seed(cfg.train.seed)
    streamer = place_denoiser(bundle, cfg, device)
    encoder_params = place_text_encoders(bundle, cfg, device)  # [] while the text encoders stay frozen
    for hint in start_hints(cfg):
        log.warning("%s", hint)
    ranks.wrap(bundle.denoiser)  # DDP, or FSDP sharding its parameters before the optimizer sees them
    optimizer = build_optimizer(ranks.trainable(bundle.denoiser), cfg.train)
    ranks.attach(optimizer)
    if encoder_params:  # a group of their own, which the schedule scales as it does the denoiser's
        te_lr = cfg.train.text_encoder_lr if cfg.train.text_encoder_lr is not None else cfg.train.lr
        optimizer.add_param_group({"params": encoder_params, "lr": te_lr})
        log.info("text encoders: learning rate %g (train.text_encoder_lr%s)", te_lr,
                 "" if cfg.train.text_encoder_lr is not None else " not given: train.lr")
    schedule = build_schedule(optimizer, cfg.train)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    state = resume_progress(cfg, resume, bundle, optimizer, schedule, generator, ranks)
    ema = _ema_of(cfg, bundle, state)  # None without [ema]
    start = state.step
    if resume and start == cfg.train.steps:  # check_resumable lets this through only without a final save
        log.info("the training state is at train.steps (%d): nothing to train; writing the final checkpoint",
                 start)
    saved: list[Path] = []

    def averaged(call: Callable) -> Callable:
        """`call` with the weights to sample, validate and save in the model (a schedule-free
        optimizer's average, optim/wrapped.py; the trained ones otherwise), the trained ones after."""
        def run(*args, **kwargs):
            with optimizer.averaged():
                return call(*args, **kwargs)
        return run

    config_json = distributed.stamp(cfg.model_dump(mode="json"), ranks)

    def write_state(p: Progress) -> None:
        # FSDP gathers: every rank takes part; trained text encoders are saved beside the denoiser
        model, opt = ranks.whole_state(trained_weights(bundle), optimizer)
        if ranks.main:  # DDP keeps every rank's weights and optimizer state identical
            assert_finite(model)
            save_state(out, model, opt, schedule, generator, p, config_json, cfg.save.keep_last,
                       ema.state_dict() if ema is not None else None)

    def save_checkpoints(step: Optional[int]) -> list[Path]:
        """The trained weights' files and, with [ema], the EMA's as <save.name>-ema (swapped in)."""
        paths = save_on_main(ranks, family, bundle, cfg, step, lora_meta)
        if ema is not None:
            with ema.swapped():
                paths += save_on_main(ranks, family, bundle, cfg, step, lora_meta, suffix="-ema")
        return paths

    lora_meta = {"ss_tag_frequency": json.dumps(tag_frequency(data.records))}
    flag = StopFlag()
    hooks = LoopHooks(save_every=cfg.save.every_steps, state_every=cfg.save.state_every_steps or cfg.save.every_steps,
                      save_at=clock.due(cfg.save.every_epochs) if cfg.save.every_epochs else None,
                      on_save=_held("saving a checkpoint", (out,), flag,
                                    lambda p: saved.extend(averaged(save_checkpoints)(p.step)), out),
                      on_state=_held("saving the training state", (state_root(out),), flag, write_state, out))
    logger = RunLogger(cfg, out, progress, device, start, world=ranks.world, main=ranks.main)
    engine = StepEngine(family, bundle, optimizer, cfg.train, device, streamer=streamer, ranks=ranks)
    grids = SampleGrids(cfg, family, bundle, device, out / "samples",
                        clock.due(cfg.sample.every_epochs) if cfg.sample.every_epochs else None,
                        release=engine.release_for_sampling, inputs=sample_inputs,
                        weights=ema.swapped if ema is not None and cfg.ema.sample_with_ema else None)
    grids.render = averaged(grids.render)  # every grid, the ones `maybe` finds due and the final one
    validation = Validation(family, ranks.forward_bundle(bundle), data, cfg, device, engine.dtype)
    if validation.enabled:
        log.info("validation: %d held-out images at %d timesteps, %s", validation.images, cfg.validation.timesteps,
                 f"every {cfg.validation.every_steps} steps and at the end" if cfg.validation.every_steps
                 else "at the end")
    elif cfg.validation != ValidationConfig():
        log.warning("[validation] is set but no image is held out: give a dataset validation = true, or "
                    "data.validation_share; no validation loss is computed")

    spill = SpillWatch.for_device(device, budget_of(cfg))  # None on the CPU

    def on_step(step: int, loss: float, lr: float) -> None:
        state.losses.append(loss)  # the whole run's, kept in the training state across resumes
        logger.step(step, loss, lr)
        if spill is not None:
            spill.step_done()
        if validation.due(step):
            started = time.perf_counter()
            value = averaged(validation.loss)()
            if value is not None:
                state.validation.append([step, value])
                logger.validation(step, value, time.perf_counter() - started)
        if ranks.main:
            grids.maybe(step, state)

    hooks.on_step = on_step
    hooks.on_update = ema.maybe_update if ema is not None else None
    second = stopped_as(lambda: _second_stop_note(out, state))  # a second signal stops the loop at once
    with tracker.phase("train") as phase, second, stop_on_signals(flag):
        result = run_loop(engine, data, schedule, cfg.train, state, hooks, flag, shuffle=cfg.data.shuffle)
        phase.steps = len(result.losses)
        phase.step_seconds = result.median_step
        phase.set_images_per_step(logger.images_per_step)
    stopped = None
    rendering = grids.enabled and ranks.main and not result.interrupted
    try:  # a stop signal here leaves the final sample grids out; the training is saved all the same
        logger.close()
        if rendering:
            with tracker.phase("samples"):
                grids.render(state.step)
                if streamer is not None:  # the grid's streamed blocks made slots again: not through the save
                    streamer.free_slots()
    except KeyboardInterrupt as exc:
        kept = ("the training state was saved first" if result.interrupted else
                "the checkpoint and the training state were saved first")
        ended = ("while rendering the final sample grids: they were left out; " if rendering
                 else "as training ended: ")
        stopped = Interrupted(signal_name(exc), ended + kept)
    with held_signals("saving the checkpoint, the training state and the run's records",
                      (out, state_root(out)), flag, resumable=out):
        with tracker.phase("save"):
            write_state(state)  # also at the end, so a finished run can be extended with more steps
            if not result.interrupted:
                saved += averaged(save_checkpoints)(None)
            if ema is not None:
                ema.close()
        saved = [p for p in saved if p.exists()]  # intermediate saves pruned since (save.keep_last) are gone
        free_device_memory(device)
        report = tracker.report
        report.write(out / ranks.report_name(cfg.save.name))
        if ranks.main:
            _write_run_json(out, cfg, ranks.world, scanned, data.stats, data.summary(), start, state, result,
                            saved, grids.paths)
        ranks.close()
    if stopped is not None:
        raise stopped
    return RunResult(out, saved, report, result, scanned, data.stats, rank=ranks.rank)


def _ema_of(cfg: RunConfig, bundle: ModelBundle, state: Progress) -> Optional[EMA]:
    """The EMA of the trained weights (memory/ema.py) with [ema], the trained text encoders' among
    them (named as the training state names them): from the resumed training state where it holds
    one, else starting at the weights as they are now."""
    e = cfg.ema
    if not e.enabled:
        return None
    params = {n: p for n, p in trained_weights(bundle).named_parameters() if p.requires_grad}
    ema = EMA(params, decay=e.decay, update_every=e.update_every, warmup=e.warmup, device=e.device,
              dtype=e.dtype, seed=cfg.train.seed)
    if state.resumed_from:
        saved = load_ema(Path(state.resumed_from))
        if saved is None:
            log.warning("ema: the training state %s holds no EMA (it was saved without [ema]); the EMA "
                        "starts at the resumed weights", state.resumed_from)
        else:
            try:
                ema.load_state_dict(saved, str(Path(state.resumed_from) / EMA_FILE))
            except ValueError as exc:
                raise ResumeError(str(exc)) from None
    log.info("ema: %.1f MiB of %s weights in %s memory, decay %g, updated every %d steps%s",
             ema.bytes() / 2**20, e.dtype, "CPU" if e.device == "cpu" else "the trained weights'", e.decay,
             e.update_every, " (warmup)" if e.warmup else "")
    return ema


def _steps_of_epochs(cfg: RunConfig, clock: EpochClock) -> RunConfig:
    """`cfg` with train.steps derived from train.epochs (and said so)."""
    epochs = cfg.train.epochs
    steps = clock.steps_for(epochs)
    if cfg.train.warmup_steps >= steps:
        raise ValueError(f"train.warmup_steps ({cfg.train.warmup_steps}) must be smaller than the {steps} steps "
                         f"that train.epochs = {epochs} takes; lower it")
    log.info("train.epochs = %d: %d micro-batches (an epoch: %d) at %d a step: train.steps = %d", epochs,
             clock.end(epochs - 1), clock.end(0), clock.per_step, steps)
    return with_values(cfg, {"train.steps": steps})


def _held(what: str, folders: tuple[Path, ...], flag: StopFlag, save: Callable[[Progress], None],
          out: Path) -> Callable[[Progress], None]:
    """`save` (a LoopHooks callback) under held_signals (a second signal names the state in `out` to
    continue from)."""
    def run(p: Progress) -> None:
        with held_signals(what, folders, flag, resumable=out):
            save(p)
    return run


def _earlier_run(out: Path, name: str) -> list[str]:
    """What of an earlier run in output.dir `out` a new run writes over: its run.json, its final
    and intermediate checkpoints under save.name `name` and their EMA's (<name>-ema), its
    training states."""
    found = ["run.json"] if (out / "run.json").is_file() else []
    for base in (name, f"{name}-ema"):
        found += [p.name for s in (".safetensors", "-diffusers", *LORA_FILE_SUFFIXES.values())
                  if (p := out / f"{base}{s}").exists()]
        steps = list(out.glob(f"{base}-step*")) if out.is_dir() else []
        if steps:
            plural = "s" if len(steps) > 1 else ""
            found.append(f"{len(steps)} intermediate checkpoint{plural} ({base}-step*)")
    states = sorted(p.name for p in state_root(out).glob("step-*") if p.is_dir())
    if states:
        found.append(f"state/ ({states[0]}{f' to {states[-1]}' if len(states) > 1 else ''})")
    return found


def _second_stop_note(out: Path, state: Progress) -> str:
    try:
        last = find_state(out, "latest")
    except ValueError:  # ResumeError: none saved yet
        return (f"a second time during training, at once: step {state.step + 1} was not finished, and no "
                "training state was saved yet; run the same command again to start training over")
    return (f"a second time during training, at once: step {state.step + 1} was not finished and is not "
            f"saved; the last saved training state, {last.name} ({last}), is kept: continue from it with "
            "--resume latest")


def _write_run_json(out: Path, cfg: RunConfig, world: int, scanned: ScanResult, cache_stats: dict,
                    datasets: list[dict], start: int, state: Progress, result: LoopResult, saved: list[Path],
                    samples: list[Path]) -> None:
    """run.json: what this run did, for the record and for the tests."""
    write_text_atomic(out / "run.json", json.dumps(
        {"versions": _versions(), "seed": cfg.train.seed, "world_size": world, "items": len(scanned.items),
         "skipped": [{"path": p.path, "reason": p.reason} for p in scanned.problems],
         "ignored": [{"path": p.path, "reason": p.reason} for p in scanned.ignored],
         "cache": cache_stats, "datasets": datasets, "start_step": start, "end_step": state.step, "epoch": state.epoch,
         "micro_batches": state.micro_batches, "resumes": state.resumes, "resumed_from": state.resumed_from,
         "interrupted": result.interrupted, "losses": state.losses,
         "nonfinite_steps_skipped": state.nonfinite_skipped, "validation": state.validation,
         "checkpoints": [str(p) for p in saved], "samples": [str(p) for p in samples]}, indent=2))


def _versions() -> dict:
    return {"vramfit": package_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
