"""The pieces a training run is composed of (vramfit/run.py composes them): load, scan, cache,
place the denoiser, save checkpoints and states, stop on signals.

Each phase is measured (memory/accounting.py). Only the denoiser is on the device while
training when both caches are on: the VAE and the text encoders are freed after caching and
read again from the source when a checkpoint is written.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import psutil
import torch

from vramfit import __version__
from vramfit.config.load import ConfigError, default_cache_root, dump_config
from vramfit.config.schema import LoraSettings, RunConfig
from vramfit.data.cache import DiskCache
from vramfit.data.datasets import combined, scan_datasets
from vramfit.data.scan import ScanResult
from vramfit.formats import lora as lora_formats
from vramfit.formats.lora import LORA_FILE_SUFFIXES
from vramfit.formats.safetensors_io import clean_temps, discard, writing
from vramfit.memory.accounting import MemoryReport, MemoryTracker
from vramfit.memory.checkpointing import checkpointing_function
from vramfit.memory.lora_compute import lora_in_base_dtype
from vramfit.memory.offload import stream_weights
from vramfit.memory.quantize import cast_all_but_linears, stored_precision
from vramfit.models.adapter import Family, ModelBundle, t5_tokens
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.generate import native_size
from vramfit.models.sources import resolve_source, write_tokenizers
from vramfit.train import distributed, prior
from vramfit.train.compile import compile_blocks
from vramfit.train.data import PLAIN, DTYPES, Record, TrainingData, free_device_memory, make_records, record_of
from vramfit.train.engine import NonFiniteLoss
from vramfit.train.loop import LoopResult, StopFlag
from vramfit.train.lora import (apply_lora, lora_state, quantize_frozen_base, text_encoder_states,
                                trained_weights)
from vramfit.train.samples import SampleInputs, encode_sample_prompts
from vramfit.train.state import (Progress, ResumeError, check_compatible, find_state, kept_note, load_state,
                                 read_meta)

log = logging.getLogger("vramfit")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class RunResult:
    output_dir: Path
    checkpoints: list[Path]
    report: MemoryReport
    loop: LoopResult
    scan: ScanResult
    cache_stats: dict
    rank: int = 0  # of a multi-process run (train/distributed.py); rank 0 wrote the files


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.cache.dir).expanduser() if cfg.cache.dir else default_cache_root()


class Interrupted(KeyboardInterrupt):
    """A stop signal that ended a phase of the run. args: (signal name, what the run did and kept,
    as the CLI prints it after "stopped by SIGINT ")."""


def signal_name(exc: KeyboardInterrupt) -> str:
    # the CLI's handler (cli.py stop_signals) and the ones below pass the signal's name
    return exc.args[0] if exc.args else "SIGINT"


@contextmanager
def stopped_as(what: str | Callable[[], str]):
    """A stop signal inside (a KeyboardInterrupt: the CLI raises one for SIGTERM too) becomes
    Interrupted saying `what` (or `what()`, at that moment); one from further in passes as it is.
    Also a decorator."""
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt as exc:
        raise Interrupted(signal_name(exc), what if isinstance(what, str) else what()) from None


def _handle(handler) -> dict:
    """Install `handler` for SIGINT and SIGTERM; returns the previous ones ({} off the main thread,
    where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore(previous: dict) -> None:
    for s, h in previous.items():
        signal.signal(s, h)


@contextmanager
def stop_on_signals(flag: StopFlag):
    """First SIGINT/SIGTERM: finish the current step, save state, exit. A second one: stop now."""
    def handler(signum, frame):
        if flag.requested:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        flag.requested = signal.Signals(signum).name
        log.warning("%s received: stopping after this step and saving the training state "
                    "(send it again to stop at once)", flag.requested)

    previous = _handle(handler)
    try:
        yield
    finally:
        _restore(previous)


@contextmanager
def held_signals(what: str, folders: tuple[Path, ...] = (), flag: Optional[StopFlag] = None,
                 resumable: Optional[Path] = None):
    """Saves: a SIGINT/SIGTERM waits until the block is done (a save is short; a torn one is worth
    nothing), then reaches the handler outside it (the loop's stop flag, or the CLI's stop). A second
    one (counting the one that set `flag`) stops at once: the files from before are kept, and this
    process's temporaries in `folders` are removed; where output folder `resumable` holds a saved
    training state, the message says to continue from it. Nested blocks hold as the outermost does."""
    held: list[int] = []

    def hold(signum, frame):
        name = signal.Signals(signum).name
        if held or (flag is not None and flag.requested):
            raise Interrupted(name, f"a second time while {what}: it was left unfinished, and the files "
                              f"from before it are kept as they were{_resume_note(resumable)}")
        held.append(signum)
        log.warning("%s received while %s: finishing that first (send it again to stop at once)", name, what)

    hold.holding = True
    if getattr(signal.getsignal(signal.SIGINT), "holding", False):
        yield
        return
    previous = _handle(hold)
    try:
        yield
    except BaseException:
        for folder in folders:
            clean_temps(folder, own=True)
        raise
    finally:
        _restore(previous)
    if held:
        with stopped_as(f"while {what}: that was finished first"):
            signal.raise_signal(held[0])


def _resume_note(output_dir: Optional[Path]) -> str:
    """The end of a stop message naming the saved state in `output_dir` to resume; "" without one."""
    if output_dir is None:
        return ""
    try:
        last = find_state(output_dir, "latest")
    except ResumeError:  # none saved yet
        return ""
    return (f"; the last saved training state, {last.name} ({last}), is kept: continue from it with "
            "--resume latest")


def cpu_threads(setting: int | str) -> int:
    """train.cpu_threads: a number, or "auto": OMP_NUM_THREADS where it is set, else half the
    physical cores, 1 to 4. A small model's steps on the CPU gain little from more threads and,
    on a busy machine, lose much to threads that wait for each other."""
    if setting != "auto":
        return int(setting)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(4, (psutil.cpu_count(logical=False) or os.cpu_count() or 1) // 2))


def use_cpu_threads(setting: int | str, device: torch.device) -> None:
    """Set torch's intra-op threads (cpu_threads) for work on the CPU; a GPU run keeps torch's own."""
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(setting))


def use_attention_kernels(device: torch.device) -> None:
    """On CUDA, leave cuDNN's fused attention out of scaled_dot_product_attention's choices (flash and
    memory-efficient attention serve every shape vramfit runs). Under torch 2.11 with CUDA 13 on an
    H100 cuDNN's kernel reads outside its buffers (Xid 31: an illegal address) for Flux.1's attention
    (24 heads of 128 over 4,608 tokens at 1024x1024), in diffusers' own training recipe too: a known
    defect of torch's cuDNN attention on some shapes (pytorch/pytorch#134001, #190321), whose
    mitigation upstream is this switch."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


class Prepared(NamedTuple):
    """A run's model and data once loaded and scanned (`load_data`), before the cache is filled."""

    family: Family
    bundle: ModelBundle
    data: TrainingData
    scan: ScanResult  # every dataset's, together


def prepare(cfg: RunConfig, tracker: MemoryTracker, device: torch.device, progress: bool,
            ranks: Optional[distributed.DataParallel] = None) -> Prepared:
    """Load the model, scan the data and fill the cache (`load_data`, then `fill_cache`)."""
    loaded = load_data(cfg, tracker, device, progress, ranks)
    fill_cache(cfg, loaded, tracker, device, progress, ranks)
    return loaded


@stopped_as("while preparing the cache: nothing was cached yet; run the same command again")
def load_data(cfg: RunConfig, tracker: MemoryTracker, device: torch.device, progress: bool,
              ranks: Optional[distributed.DataParallel] = None) -> Prepared:
    """Scan the datasets, load the model and make the records with their cache keys (class images
    generated first where missing). A stop signal ends it with Interrupted, saying what is kept."""
    ranks = ranks or distributed.DataParallel()
    use_cpu_threads(cfg.train.cpu_threads, device)
    use_attention_kernels(device)
    progress = progress and cfg.logging.progress  # bars: neither --no-progress nor logging.progress = false
    with stopped_as("while scanning the dataset: nothing was written; run the same command again"):
        datasets = scan_datasets(cfg)
    with tracker.phase("load"), stopped_as("while loading the model: nothing was cached yet; run the same "
                                           "command again"):
        with ranks.main_first():  # one rank downloads or converts; the others find it done
            source = resolve_source(cfg.model, cache_root(cfg))
        family = detect_family(source, cfg.model.family)
        problems = family.config_problems(cfg) + prior.sampling_problems(cfg, family)
        if problems:
            raise ConfigError(problems, f"config for this {family.name} model")
        # a single file's T5 is stored as model.t5_precision asks while it loads (models/parts.py)
        stored = {"t5_precision": cfg.model.t5_precision} if family.has_t5 else {}
        bundle = family.load(source, **stored)
        bundle.extra["max_sequence_length"] = t5_tokens(family, cfg, bundle.denoiser.config)
        bundle.extra["t5_precision"] = cfg.model.t5_precision
        bundle.extra["stream_encoders"] = cfg.memory.stream_encoders  # not in cache keys: same embeddings
        # The VAE runs in the precision asked for whatever the file stores (SDXL's overflows in
        # fp16); half-precision text encoders are kept on GPUs but widened for the CPU, which
        # lacks fast fp16. T5 is then stored as model.t5_precision asks.
        bundle.vae.to(DTYPES[cfg.cache.vae_dtype])
        if device.type == "cpu":
            for enc in bundle.text_encoders:
                if stored_precision(enc) is None:  # a T5 stored as it loaded stays so (fp32 would widen it)
                    enc.to(torch.float32)
        # Cache keys name the encoders as loaded (T5's precision is part of the text key).
        # While the CLIP encoders train, the outputs of those that never do (T5) are cached.
        frozen = cfg.text_encoder_training is not None and not cfg.cache.text
        identities = {part: family.encoder_identity(bundle, part)
                      for part, cached in (("vae", cfg.cache.latents), ("text", cfg.cache.text),
                                           ("frozen text", frozen)) if cached}
        family.prepare_encoders(bundle)
    records = make_records(datasets, cfg.train.seed)
    generated = 0
    if cfg.prior.class_prompt:
        with tracker.phase("class_images"), stopped_as(lambda: _class_images_note(cfg)):
            records, generated = _with_class_records(cfg, family, bundle, records, device, progress, ranks)
    data = TrainingData(family, bundle, records, cfg.cache, DiskCache(cache_root(cfg) / "entries"), device,
                        seed=cfg.train.seed, prior_weight=cfg.prior.loss_weight, identities=identities,
                        share=ranks.share, frozen_text=frozen)
    data.stats["class_images_generated"] = generated
    data.stats["captions_truncated"] = data.warn_long_captions(family.caption_tokenizers(source, cfg))
    data.assign_keys()
    return Prepared(family, bundle, data, combined(datasets))


@stopped_as("while preparing the cache: what is cached is kept; run the same command again to continue")
def fill_cache(cfg: RunConfig, loaded: Prepared, tracker: MemoryTracker, device: torch.device, progress: bool,
               ranks: Optional[distributed.DataParallel] = None) -> Optional[SampleInputs]:
    """Encode what is not cached yet (over several ranks each its share), and the sample prompts
    where grids are on (returned, with the VAE: train/samples.py), then free the encoders the
    training does not need."""
    ranks = ranks or distributed.DataParallel()
    progress = progress and cfg.logging.progress
    data, bundle = loaded.data, loaded.bundle
    with tracker.phase("cache_latents"), stopped_as(lambda: _cache_note(data, "latents")):
        if cfg.cache.latents:
            data.cache_latents(progress)
    with tracker.phase("cache_text"), stopped_as(lambda: _cache_note(data, "text")):
        if data.text_part is not None:  # every encoder's outputs, or (encoders training) T5's
            data.cache_text(progress)
        sample_inputs = encode_sample_prompts(cfg, bundle, device) if ranks.main else None
    ranks.barrier()  # every rank's share is written before any rank reads the cache
    if cfg.cache.latents or data.text_part is not None:
        size = data.cache_size()
        data.stats.update(size)
        text = "text" if data.text_part == "text" else "frozen-encoder text"
        log.info("cache: %s", ", ".join(f"{size[f'{k}_entries']} {name} entries ({size[f'{k}_bytes'] / 2**20:.1f} MiB)"
                                        for k, name, on in (("latents", "latent", cfg.cache.latents),
                                                            ("text", text, data.text_part is not None)) if on))
    if cfg.cache.latents and cfg.cache.text:
        bundle.drop_encoders()
    elif data.text_part == "frozen text":  # T5's outputs cached while the CLIPs train: nothing reads it now
        loaded.family.release_frozen_encoders(bundle)
        bundle.extra["frozen_encoders_cached"] = True
    if not cfg.cache.latents:  # live latents: the VAE stays on the device for the whole run
        bundle.vae.to(device)  # (encode_text moves each text encoder in and out itself)
    free_device_memory(device)
    return sample_inputs


def _with_class_records(cfg: RunConfig, family, bundle, records: list[Record], device: torch.device,
                        progress: bool, ranks: distributed.DataParallel) -> tuple[list[Record], int]:
    """Instance records plus one record per class image (generated first where missing, by rank 0)."""
    with ranks.main_first():
        trained = [r.bucket for r in records if not r.validation and not r.prior]
        folder, slots, generated = prior.ensure_class_images(cfg, family, bundle, trained,
                                                              device, progress)
    free_device_memory(device)
    extra = [record_of(item, PLAIN, -1, [], cfg.train.seed, prior=True, bucket=bucket)
             for item, bucket in prior.class_items(cfg, folder, slots)]
    log.info("prior preservation: %d class images (%d generated now), loss weight %g", len(extra),
             generated, cfg.prior.loss_weight)
    return records + extra, generated


def _class_images_note(cfg: RunConfig) -> str:
    folder = prior.class_dir(cfg)
    done = len(list(folder.glob(prior.SLOT_NAME.replace("{:05d}", "*")))) if folder.is_dir() else 0
    return (f"while generating class images: {done} of {cfg.prior.num_images} are in {folder} and kept; "
            "run the same command again to generate the rest")


def _cache_note(data: TrainingData, kind: str) -> str:
    what = "latents" if kind == "latents" else "text embeddings"
    return (f"while caching {what}: {data.written(kind)} of {len(data.pending[kind])} entries cached "
            f"and kept ({data.stats[f'{kind}_reused']} were cached before); run the same command again "
            "to continue")


def place_denoiser(bundle, cfg: RunConfig, device: torch.device):
    """Cast, adapt and place the denoiser; returns the WeightStreamer when memory.stream_weights
    or offload_activations is on (else None)."""
    unet, family = bundle.denoiser, FAMILIES[bundle.family]
    # A quantized base's linears stay as loaded, each reaching the device alone to be cast and
    # quantized there (the rest is cast where it lies); streamed blocks never go to the device whole
    # (stream_weights moves the rest there).
    quantized = cfg.train.mode == "lora" and cfg.lora.base_quantization != "none"
    dtype = torch.bfloat16 if cfg.train.precision == "full_bf16" else torch.float32
    if quantized:
        cast_all_but_linears(unet, dtype)
    else:
        unet.to(None if cfg.memory.stream_weights else device, dtype)
    unet.requires_grad_(True)
    if cfg.train.mode == "lora":
        targets = apply_lora(unet, cfg.lora, linear_dtype=dtype if quantized else None)
        log.info("LoRA rank %d on %d modules", cfg.lora.rank, len(targets))
        if cfg.train.precision == "full_bf16":  # fp32 adapters multiplied in bf16, as under autocast
            lora_in_base_dtype(unet)
        quantize_frozen_base(unet, cfg.lora, device, dtype)
    if cfg.train.gradient_checkpointing is not False:  # every block, or a share of them

        unet.enable_gradient_checkpointing(checkpointing_function(cfg.train.gradient_checkpointing,
                                                                  graph_safe=cfg.train.cuda_graphs is True))
    else:
        unet.disable_gradient_checkpointing()
    if cfg.train.compile:
        log.info("compiling %d repeated blocks of the denoiser (the first step of each bucket shape "
                 "compiles them)", compile_blocks(unet, family.repeated_blocks))
    streamer = stream_weights(unet, device, cfg.memory, blocks=family.block_containers,
                              stream_trainable=cfg.train.mode == "full",
                              checkpointed=cfg.train.gradient_checkpointing is not False)
    if streamer is not None and cfg.memory.stream_weights:
        stats = streamer.stats
        log.info("streaming %.1f MiB of block weights in %d units; %d of %d stream blocks resident "
                 "(memory.resident_blocks)", streamer.streamed_bytes() / 2**20, len(streamer.units),
                 stats.resident_blocks, stats.blocks)
    return streamer


def assert_finite(model: torch.nn.Module) -> None:
    """Refuse to write a checkpoint that holds NaN or inf (it would poison every later use)."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise NonFiniteLoss(f"parameter {name} holds NaN or inf; nothing was saved")


def save_checkpoint(family, bundle, cfg: RunConfig, step: Optional[int],
                    lora_meta: Optional[dict] = None, suffix: str = "") -> list[Path]:
    """Write the formats asked for; `step` None means the final save. `lora_meta`: what a LoRA file
    says of the run besides (the dataset's tag frequencies). `suffix` follows save.name in every
    file's name ("-ema": the EMA weights, swapped into the denoiser by the caller)."""
    assert_finite(bundle.denoiser)
    out = cfg.output_dir
    base = cfg.save.name + suffix
    name = base if step is None else f"{base}-step{step:06d}"
    dtype = SAVE_DTYPES[cfg.save.dtype]
    meta = {"vramfit.version": package_version(), "vramfit.config": dump_config(cfg),
            "vramfit.step": str(step if step is not None else cfg.train.steps),
            "vramfit.base_model": bundle.source.label, "vramfit.family": bundle.family,
            "vramfit.layout": bundle.layout}
    paths = []
    formats = cfg.save_formats
    if cfg.train.mode == "lora":
        paths = save_lora_files(bundle, cfg, name, formats, {**meta, **(lora_meta or {})})
    if "single_file" in formats:
        path = out / f"{name}.safetensors"
        # the base's own size, which generate renders at by default (a tiny base's is small)
        width, height = native_size(bundle)
        family.save_single_file(bundle, path, dtype, {**meta, "modelspec.resolution": f"{width}x{height}"})
        write_tokenizers(bundle.source, bundle.tokenizers, path)  # generate and train need no setting
        paths.append(path)
    if "diffusers" in formats:
        folder = out / f"{name}-diffusers"
        family.save_diffusers(bundle, folder, dtype)
        paths.append(folder)
    if step is not None:
        for ending in (".safetensors", "-diffusers", *LORA_FILE_SUFFIXES.values()):
            _prune_intermediate(out, f"{base}-step", ending, cfg.save.keep_last, step)
    return paths


def save_lora_files(bundle, cfg: RunConfig, name: str, formats: list[str], meta: dict) -> list[Path]:
    """The LoRA files of `formats` that the family writes (its lora_formats, primary first): the
    primary one as <name>.safetensors, the others as <name>-diffusers / -kohya.safetensors."""
    family = FAMILIES[bundle.family]
    own = family.lora_formats
    state = lora_state(bundle.denoiser)
    alpha = cfg.lora.alpha or cfg.lora.rank
    te_alpha = cfg.lora.text_encoder_alpha or cfg.lora.text_encoder_rank
    if cfg.lora.text_encoder_rank:
        meta = {**meta, "vramfit.text_encoder_rank": str(cfg.lora.text_encoder_rank),
                "vramfit.text_encoder_alpha": str(te_alpha)}
    meta = {**meta, "vramfit.lora_rank": str(cfg.lora.rank), "vramfit.lora_alpha": str(alpha),
            "ss_base_model_version": family.base_model_version}
    paths = []
    for fmt in [f for f in own if f in formats]:
        path = cfg.output_dir / lora_formats.lora_file_name(name, fmt, own[0])
        tensors = family.lora_tensors(fmt, state, dict(bundle.denoiser.config), alpha)
        tensors.update(lora_formats.text_encoder_lora(text_encoder_states(bundle), te_alpha,
                                                      kohya=fmt == "lora_kohya"))
        scale = lora_formats.lora_scale_metadata(cfg.lora.rank, alpha, "kohya" if fmt == "lora_kohya" else "diffusers")
        if fmt == "lora_kohya":
            scale.update(network_metadata(cfg.lora))
        lora_formats.save_lora(path, tensors, {**meta, **scale})
        paths.append(path)
    return paths


def network_metadata(lora: LoraSettings) -> dict[str, str]:
    """ss_network_module and ss_network_args as kohya's trainer writes them for this adapter: LoKr,
    LoHa and DoRA train through LyCORIS there ("lycoris.kohya" with algo=..., DoRA as algo=lora
    with dora_wd), LoRA through networks.lora; the args' values are the strings of its command line."""
    args: dict[str, str] = {}
    module = "networks.lora"
    if lora.type != "lora":
        module = "lycoris.kohya"
        args["algo"] = "lora" if lora.type == "dora" else lora.type
    if lora.type == "dora":
        args["dora_wd"] = "True"
    if lora.type == "lokr":
        args["factor"] = str(lora.lokr_factor)
    if lora.conv_rank:
        args["conv_dim"] = str(lora.conv_rank)
        args["conv_alpha"] = str(lora.conv_alpha or lora.conv_rank)
    return {"ss_network_module": module, **({"ss_network_args": json.dumps(args)} if args else {})}


def save_on_main(ranks: distributed.DataParallel, family, bundle, cfg: RunConfig,
                  step: Optional[int], lora_meta: Optional[dict] = None, suffix: str = "") -> list[Path]:
    """save_checkpoint on rank 0, with the whole denoiser (FSDP gathers it: every rank takes part)."""
    whole = ranks.whole_bundle(bundle)
    if whole is None:
        return []
    name = cfg.save.name + suffix if step is None else f"{cfg.save.name}{suffix}-step{step:06d}"
    with writing(f"the checkpoint {name}", cfg.output_dir,  # a full disk: say what is kept
                 lambda: f"Nothing was left under its name. {kept_note(cfg.output_dir)}"):
        return save_checkpoint(family, whole, cfg, step, lora_meta, suffix)


def _prune_intermediate(out: Path, prefix: str, suffix: str, keep: int, newest: int) -> None:
    """Keep the newest `keep` intermediate saves up to step `newest`, the one just written; later
    steps are an earlier run's (as train/state.py prune leaves them), not older than this one."""
    steps = {p: p.name[len(prefix):-len(suffix)] for p in out.glob(f"{prefix}*{suffix}")}
    found = sorted(p for p, s in steps.items() if s.isdigit() and int(s) <= newest)
    for old in found[:-keep]:
        discard(old)  # renamed away first: a kill mid-delete leaves no half folder under its name


def resume_progress(cfg: RunConfig, resume: Optional[str], bundle, optimizer, schedule,
                     generator: torch.Generator, ranks: distributed.DataParallel) -> Progress:
    if not resume:
        return Progress()
    path = find_state(cfg.output_dir, resume)
    check_resumable(cfg, str(path), ranks.world)
    progress = load_state(path, ranks.loadable(trained_weights(bundle)), optimizer, schedule, generator)
    ranks.shard_optimizer_state(optimizer)  # FSDP: each rank keeps its shard of the whole state
    log.info("resumed from %s at step %d (epoch %d)", path, progress.step, progress.epoch)
    return progress


def check_resumable(cfg: RunConfig, resume: Optional[str], world: int = 1) -> None:
    """Fail before any weight loads when --resume cannot work."""
    if resume:
        path = find_state(cfg.output_dir, resume)
        meta = read_meta(path)
        saved, now = distributed.resume_configs(meta["config"], cfg.model_dump(mode="json"), world, path)
        check_compatible(saved, now, path)
        step, steps = meta["progress"]["step"], cfg.train.steps
        # at train.steps exactly, a run whose final save failed (a full disk) resumes to write it
        finals = (".safetensors", "-diffusers", *LORA_FILE_SUFFIXES.values())
        saved_final = any((cfg.output_dir / f"{cfg.save.name}{s}").exists() for s in finals)
        if step > steps or (step == steps and saved_final):
            raise ResumeError(f"--resume: the state is at step {step} and train.steps is {steps}: nothing "
                              "to train; raise train.steps to continue the run")


def package_version() -> str:
    return __version__
