"""Which settings refuse which, and why: one table, read wherever a config is judged.

The config's validation (config/schema.py) refuses what RULES refuse for one process; the
multi-process check (train/distributed.py, launch.py) adds PROCESS_RULES for several; the planner
(fit/planner.py) tries only combinations both allow; the start-up hints (HINTS) say what a
setting costs where a faster combination exists. Every rule is a pure function of the config
values (and of the number of processes): no torch, no environment, so it holds on any machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

# Optimizers whose state is small enough to live beside streamed weights on the GPU (optim/: the
# class attribute compact_state; tests/test_rules.py checks the two agree).
COMPACT_STATE_OPTIMIZERS = frozenset({"adafactor"})
# Optimizers that step all parameters at once (optim/wrapped.py), and why they cannot step one at a time.
WHOLE_STEP_OPTIMIZERS = {
    "prodigy": "Prodigy's step size is one estimate from the gradients of all parameters together",
    "schedulefree_adamw": "schedule-free's averaging weights advance once per step of all parameters",
    "came": "pytorch-optimizer's CAME steps all parameters in one call",
    "custom": "a torch.optim-style class steps all parameters in one call",
}


@dataclass(frozen=True)
class Rule:
    """`key` is refused when `check(cfg)` (or `check(cfg, world)`) returns the reason."""

    key: str
    check: Callable[..., Optional[str]]


def streamed_step_on_device(cfg: Any) -> bool:
    """Whether the run steps its streamed weights on the device inside backward (memory/offload/grads.py):
    a streamed full fine-tune with the step in backward and an optimizer of compact state."""
    t = cfg.train
    return (cfg.memory.stream_weights and t.mode == "full" and t.optimizer_in_backward
            and t.optimizer in COMPACT_STATE_OPTIMIZERS)


def streamed_sums_on_device(cfg: Any) -> bool:
    """Whether the gradients of earlier micro-batches of streamed weights that step on the device
    are summed on the device (memory.streamed_grad_sums = "device", memory/offload/grads.py)."""
    return (streamed_step_on_device(cfg) and cfg.train.grad_accum > 1
            and cfg.memory.streamed_grad_sums == "device")


def streamed_step_in_cpu_memory(cfg: Any) -> bool:
    """Whether the run is a full fine-tune whose streamed weights step in CPU memory (after backward:
    a step CUDA graphs cannot record, bound by the host's optimizer pass)."""
    return cfg.memory.stream_weights and cfg.train.mode == "full" and not streamed_step_on_device(cfg)


def graph_clashes(cfg: Any) -> list[str]:
    """The settings beside which train.cuda_graphs cannot record (train/graphs.py says why)."""
    return [name for name, on in (
        ("memory.stream_weights in a full fine-tune that steps streamed weights in CPU memory (only "
         "train.optimizer_in_backward with Adafactor steps them on the GPU, inside the recording)",
         streamed_step_in_cpu_memory(cfg)),
        ("train.optimizer_in_backward with train.grad_accum > 1",
         cfg.train.optimizer_in_backward and cfg.train.grad_accum > 1),
        ("lora.dropout", cfg.train.mode == "lora" and cfg.lora.dropout > 0),
        (f"{TRAINED_ENCODERS_KEY.get(cfg.text_encoder_training)} (the trained text encoders run before the "
         "recorded denoiser, with the host's tokenizing between)", cfg.text_encoder_training is not None)) if on]


# the setting that trains the text encoders, by RunConfig.text_encoder_training
TRAINED_ENCODERS_KEY = {"lora": "lora.text_encoder_rank", "full": "train.text_encoders = 'full'"}


def _compile(cfg: Any) -> Optional[str]:
    moving = [k for k in ("stream_weights", "offload_activations") if getattr(cfg.memory, k)]
    if cfg.train.compile and moving:
        return (f"cannot be used with memory.{' and memory.'.join(moving)}: their hooks move weights and saved "
                "tensors between devices around each block, which a compiled block cannot contain; turn one of "
                "them off")
    return None


def _graphs(cfg: Any) -> Optional[str]:
    clash = graph_clashes(cfg) if cfg.train.cuda_graphs is True else []
    if clash:
        return (f"cannot be used with {' and '.join(clash)}: a recorded forward and backward replay the same "
                "weights at the same places, and the same gradient-hook work at every call, with no host work "
                "between their kernels, which these settings need (moving weights, hooks that act differently "
                "from one micro-batch to the next, dropout masks); turn one of them off")
    return None


def _samples(cfg: Any) -> Optional[str]:
    if not ((cfg.sample.every_steps or cfg.sample.every_epochs) and cfg.memory.stream_weights):
        return None
    if cfg.text_encoder_training is not None:  # its captions are encoded live: cache.text is turned off
        return (f"cannot be used with memory.stream_weights and {TRAINED_ENCODERS_KEY[cfg.text_encoder_training]}: "
                "a grid of a streamed denoiser takes its prompts encoded in the caption phase, which trained "
                "text encoders have not; render the grids after training with vramfit generate, or turn "
                "streaming off")
    if not (cfg.cache.text and cfg.cache.latents):
        return ("with memory.stream_weights needs cache.text and cache.latents: a grid of a streamed denoiser "
                "takes its prompts encoded in the caption phase and streams the denoiser as training does, "
                "with only the VAE placed whole (train/samples.py); cache both, render the grids after "
                "training with vramfit generate, or turn streaming off")
    return None


def _ema_device(cfg: Any) -> Optional[str]:
    if cfg.ema.enabled and cfg.ema.device == "gpu" and cfg.memory.stream_weights and cfg.train.mode == "full":
        return ("\"gpu\" cannot be used with memory.stream_weights in a full fine-tune: the trained "
                "weights live in CPU memory there, and an EMA of them on the GPU would hold their whole size "
                "on the device that streaming keeps them off; set ema.device = \"cpu\"")
    return None


def _resident_blocks(cfg: Any) -> Optional[str]:
    if cfg.memory.resident_blocks and not cfg.memory.stream_weights:  # 0: nothing kept, as without streaming
        return ("applies to memory.stream_weights = true (how many blocks stay on the GPU while the rest "
                "stream), which is off; set memory.stream_weights = true, or leave it out")
    return None


def _steps(cfg: Any) -> Optional[str]:
    if cfg.train.epochs is not None and "steps" in cfg.train.model_fields_set:
        return "given beside train.epochs, which derives it; use one of them"
    return None


def _every(section: str) -> Callable[[Any], Optional[str]]:
    def check(cfg: Any) -> Optional[str]:
        s = getattr(cfg, section)
        return f"given beside {section}.every_steps; use one" if s.every_epochs and s.every_steps else None
    return check


def _zero_snr(cfg: Any) -> Optional[str]:
    t = cfg.train
    if t.zero_terminal_snr is True and t.prediction_type == "epsilon":
        return ("needs train.prediction_type = \"v_prediction\": at the last timestep of a zero-SNR "
                "schedule the input is pure noise, which an epsilon model reproduces without learning the "
                "image; set train.prediction_type = \"v_prediction\" or train.zero_terminal_snr = false")
    return None


def _debiased(cfg: Any) -> Optional[str]:
    t = cfg.train
    if t.debiased_estimation and t.min_snr_gamma > 0:
        return ("given beside train.min_snr_gamma: both weight the loss by the timestep's SNR, and "
                "together the weights multiply; use one of them")
    return None


def _snr_beside_cosmap(cfg: Any) -> Optional[str]:
    t = cfg.train
    on = [k for k, v in (("train.min_snr_gamma", t.min_snr_gamma > 0),
                         ("train.debiased_estimation", t.debiased_estimation)) if v]
    if on and t.weighting_scheme == "cosmap":
        return (f"'cosmap' weights the loss by timestep itself, and {' and '.join(on)} would multiply "
                "it; use another weighting_scheme or leave the SNR weighting out")
    return None


def _default(cfg: Any, key: str) -> Any:
    return type(cfg.train).model_fields[key].default


def _huber(key: str) -> Callable[[Any], Optional[str]]:
    def check(cfg: Any) -> Optional[str]:
        t = cfg.train
        if t.loss == "mse" and getattr(t, key) != _default(cfg, key):
            return "applies to train.loss = \"huber\" or \"smooth_l1\"; set train.loss, or leave it out"
        return None
    return check


def _adapter(key: str) -> Callable[[Any], Optional[str]]:
    """lora.* settings that only one adapter type, or only a given conv_rank, reads."""
    def check(cfg: Any) -> Optional[str]:
        lora = cfg.lora
        if key == "lora.conv_alpha" and lora.conv_alpha is not None and lora.conv_rank is None:
            return "given without lora.conv_rank, which it scales; set lora.conv_rank or leave it out"
        if key == "lora.lokr_factor" and lora.lokr_factor != -1 and lora.type != "lokr":
            return f"is for lora.type = 'lokr' (this run's is {lora.type!r}); leave it out"
        if key == "lora.dropout" and lora.dropout > 0 and lora.type in ("lokr", "loha"):
            return (f"has no {lora.type} counterpart in peft (it drops a LoRA branch's input); use "
                    "lora.type = 'lora' or 'dora', or set it to 0")
        if key == "lora.type" and lora.type == "dora" and lora.base_quantization != "none":
            return (f"'dora' cannot train over lora.base_quantization = {lora.base_quantization!r}: peft's "
                    "DoRA reads the frozen weight itself each step (its row norms), which a quantized base "
                    "does not give it; use lora.type = 'lora' or base_quantization = 'none'")
        if (key == "lora.type" and lora.type in ("lokr", "loha") and cfg.train.mode == "lora"
                and "lora" in (cfg.save.formats or ())):
            return (f"{lora.type!r} has no diffusers layout, which save.formats' 'lora' asks for (diffusers "
                    "loads LoRA and DoRA only); save it as 'lora_kohya' (ComfyUI and A1111 read it)")
        return None
    return check


def _shift(cfg: Any) -> Optional[str]:
    t = cfg.train
    if t.flow_shift is not None and t.flow_shift_mode == "resolution":
        return ("is a fixed shift, while train.flow_shift_mode = \"resolution\" shifts by the image's "
                "size; set train.flow_shift_mode = \"fixed\" (or \"auto\"), or leave train.flow_shift out")
    return None


def _whole_step(cfg: Any) -> Optional[str]:
    why = WHOLE_STEP_OPTIMIZERS.get(cfg.train.optimizer)
    if why and cfg.train.optimizer_in_backward:
        return (f"cannot be used with train.optimizer = {cfg.train.optimizer!r}: {why}, so no parameter "
                "can step alone inside backward; set it to false, or use adamw, adamw8bit, adafactor or lion")
    return None


def _whole_step_streamed(cfg: Any) -> Optional[str]:
    why = WHOLE_STEP_OPTIMIZERS.get(cfg.train.optimizer)
    if why and cfg.memory.stream_weights and cfg.train.mode == "full":
        return (f"cannot be used in a full fine-tune with train.optimizer = {cfg.train.optimizer!r}: {why}, "
                "while streamed weights step in CPU memory apart from the GPU's; turn streaming off, or use "
                "adamw, adamw8bit, adafactor or lion")
    return None


def _grad_sums(cfg: Any) -> Optional[str]:
    if cfg.memory.streamed_grad_sums != "device" or streamed_step_on_device(cfg):
        return None
    t = cfg.train
    missing = [what for what, off in (
        ("memory.stream_weights = true", not cfg.memory.stream_weights),
        ("train.mode = \"full\"", t.mode != "full"),
        ("train.optimizer_in_backward = true", not t.optimizer_in_backward),
        ("train.optimizer = \"adafactor\"", t.optimizer not in COMPACT_STATE_OPTIMIZERS)) if off]
    return ("\"device\" sums the gradients of streamed weights that step on the GPU, which needs "
            f"{' and '.join(missing)}; set {'it' if len(missing) == 1 else 'them'}, or leave "
            "memory.streamed_grad_sums out")


def _text_encoders(cfg: Any) -> Optional[str]:
    """What lora.text_encoder_rank (a LoRA trained on the text encoders) cannot be used with."""
    if not cfg.lora.text_encoder_rank:
        return None
    return _trained_encoder_clashes(cfg)


def _full_text_encoders(cfg: Any) -> Optional[str]:
    """What train.text_encoders = "full" (every weight of the CLIP encoders trained) cannot be used with."""
    if cfg.train.text_encoders != "full":
        return None
    if cfg.train.mode != "full":
        return ("'full' is for a full fine-tune (train.mode = 'full'); a LoRA run trains the text encoders "
                "with a LoRA of their own: set lora.text_encoder_rank instead, or train.text_encoders = "
                "'frozen'")
    return _trained_encoder_clashes(cfg)


def _trained_encoder_clashes(cfg: Any) -> Optional[str]:
    """What trained text encoders (a LoRA on them or all their weights) cannot be used with."""
    t = cfg.train
    clash = [(key, reason) for key, reason, on in (
        ("train.optimizer_in_backward", "the text encoders' gradients are complete only after the "
         "denoiser's backward has passed through them, outside its gradient hooks; set it to false",
         t.optimizer_in_backward),
        ("memory.stream_encoders", "a streamed encoder's weights leave the GPU layer by layer, while the "
         "trained ones must stay there until backward; set it to false", cfg.memory.stream_encoders)) if on]
    if not clash:
        return None
    return "cannot be used with " + "; nor with ".join(f"{k}: {r}" for k, r in clash)


RULES = (Rule("train.optimizer_in_backward", _whole_step),
         Rule("lora.text_encoder_rank", _text_encoders), Rule("train.text_encoders", _full_text_encoders),
         Rule("memory.stream_weights", _whole_step_streamed),
         Rule("memory.streamed_grad_sums", _grad_sums),
         Rule("train.compile", _compile), Rule("train.cuda_graphs", _graphs),
         Rule("sample.every_steps", _samples), Rule("train.steps", _steps),
         Rule("save.every_epochs", _every("save")), Rule("sample.every_epochs", _every("sample")),
         # the training objective's settings (prediction type, loss weightings, loss, shift)
         Rule("train.zero_terminal_snr", _zero_snr), Rule("train.debiased_estimation", _debiased),
         Rule("train.weighting_scheme", _snr_beside_cosmap), Rule("train.huber_c", _huber("huber_c")),
         Rule("train.huber_schedule", _huber("huber_schedule")), Rule("train.flow_shift", _shift),
         Rule("ema.device", _ema_device),
         Rule("memory.resident_blocks", _resident_blocks),
         # lora.* settings that need another (adapter types, conv ranks)
         *(Rule(k, _adapter(k)) for k in ("lora.type", "lora.conv_alpha", "lora.lokr_factor", "lora.dropout")))


def config_problems(cfg: Any) -> list[tuple[str, str]]:
    """(key, why) of every rule the config breaks on one process."""
    return [(rule.key, why) for rule in RULES if (why := rule.check(cfg))]


# ---- several processes (`vramfit train --gpus N`, accelerate launch) --------------------------------

def _in_backward(cfg: Any, where: str) -> Optional[str]:
    if cfg.train.optimizer_in_backward:
        return (f"does not compose {where}: each parameter would step in its gradient hook before DDP has "
                "averaged that gradient across ranks, so the ranks would drift apart; set it to false")
    return None


def _rounded_sums(cfg: Any, where: str) -> Optional[str]:
    t = cfg.train
    if t.mode == "full" and t.precision == "full_bf16" and t.stochastic_rounding and t.grad_accum > 1:
        return (f"= {t.grad_accum} with full_bf16 weights and stochastic_rounding: bf16 gradient sums rounded "
                f"stochastically (a gradient hook) do not compose {where}, as DDP reads each gradient in that "
                "hook's place; use train.grad_accum = 1 (the processes multiply the batch already), "
                "train.stochastic_rounding = false or train.precision = 'mixed_bf16'")
    return None


def _graphs_written(cfg: Any, where: str) -> Optional[str]:
    t = cfg.train
    if t.cuda_graphs is True and "cuda_graphs" in t.model_fields_set:  # "auto" is off for several processes
        return (f"not {where} yet: DDP averages gradients from hooks inside backward, which a recorded backward "
                "replays without; set it to false")
    return None


def _streamed(cfg: Any, where: str) -> Optional[str]:
    if cfg.memory.stream_weights:
        return (f"does not compose {where}: streamed weights and their gradients live in host memory, where "
                "DDP's GPU all-reduce cannot reach them; set it to false (each GPU then holds the whole denoiser)")
    return None


def _fsdp(key: str, check: Callable[[Any], bool], why: str) -> Rule:
    return Rule(key, lambda cfg, where: why.format(where=where, t=cfg.train)
                if cfg.train.distributed == "fsdp" and check(cfg) else None)


PROCESS_RULES = (
    Rule("lora.text_encoder_rank", lambda cfg, where: None if not cfg.lora.text_encoder_rank else (
        f"not {where} yet: DDP averages the denoiser's gradients only, so each rank's text encoders would "
        "drift apart; train on one GPU, or leave it out")),
    Rule("train.text_encoders", lambda cfg, where: None if not (
        cfg.train.mode == "full" and cfg.train.text_encoders == "full") else (
        f"'full' not {where} yet: DDP averages the denoiser's gradients only, so each rank's text encoders "
        "would drift apart; train on one GPU, or set it to 'frozen'")),
    _fsdp("train.distributed", lambda c: c.train.mode == "lora",
          "'fsdp' shards a full fine-tune; a LoRA's trainable weights are small, so train it with 'ddp'"),
    _fsdp("train.optimizer", lambda c: c.train.optimizer != "adamw",
          "{t.optimizer!r} does not compose with 'fsdp' {where}: under FSDP each rank steps its shard of every tensor, which is "
          "exact for AdamW (element by element) but not for Adafactor's per-row and per-column statistics or "
          "8-bit blocks; use 'adamw' or train.distributed = 'ddp'"),
    _fsdp("train.compile", lambda c: c.train.compile,
          "not with 'fsdp', whose hooks gather each block's weights around the very calls that compilation "
          "replaces; set it to false or use 'ddp'"),
    _fsdp("memory.offload_activations", lambda c: c.memory.offload_activations,
          "under 'fsdp' the tensors saved for backward include the gathered weights, which would be copied to "
          "host memory and back every step; set it to false or use 'ddp'"),
    _fsdp("sample.every_steps", lambda c: bool(c.sample.every_steps or c.sample.every_epochs),
          "sample grids need the whole denoiser on one GPU, which 'fsdp' never holds; render from the saved "
          "checkpoints with `vramfit generate`, or use 'ddp'"),
    _fsdp("ema.enabled", lambda c: c.ema.enabled,
          "an EMA of the trained weights is not kept under 'fsdp', where no rank holds them whole; use 'ddp' "
          "or set it to false"),
    Rule("train.optimizer_in_backward", _in_backward),
    Rule("train.grad_accum", _rounded_sums),
    Rule("train.cuda_graphs", _graphs_written),
    Rule("memory.stream_weights", _streamed),
)


def process_problems(cfg: Any, world: int) -> list[str]:
    """What the config cannot do on `world` processes, as "key: why" lines; empty for one."""
    if world <= 1:
        return []
    where = f"with {world} processes (data-parallel)"
    return [f"{rule.key}: {why}" if not why.startswith("=") else f"{rule.key} {why}"
            for rule in PROCESS_RULES if (why := rule.check(cfg, where))]


# ---- hints: allowed, but slower than it need be ----------------------------------------------------

def streamed_step_hint(cfg: Any) -> Optional[str]:
    """What to change, when a full fine-tune's streamed weights step in CPU memory (a step bound by
    the host's optimizer pass over every streamed weight), or None."""
    if not streamed_step_in_cpu_memory(cfg):
        return None
    needed = []
    if cfg.train.optimizer not in COMPACT_STATE_OPTIMIZERS:
        needed.append(f"train.optimizer = \"adafactor\" (the state of {cfg.train.optimizer!r} is as large as the "
                      "weights and stays in CPU memory)")
    if not cfg.train.optimizer_in_backward:
        needed.append("train.optimizer_in_backward = true (one micro-batch a step; clipping per tensor)")
    return ("memory.stream_weights: the streamed weights step in CPU memory after every backward, which "
            "sets the pace of each step (SD3-M at 1024 on an H200 host: 17.6 s a step). They step on the "
            "GPU inside backward, recorded with CUDA graphs (0.23 s a step), with " + " and ".join(needed))


HINTS = (streamed_step_hint,)


def start_hints(cfg: Any) -> list[str]:
    """The hints that apply to the config."""
    return [hint for rule in HINTS if (hint := rule(cfg))]
