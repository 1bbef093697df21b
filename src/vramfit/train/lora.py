"""LoRA on the denoiser through peft: which modules, which precision, which tensors to save.

The base weights stay frozen in the training precision (bf16 for full_bf16) and the LoRA
matrices train in fp32 over them, as the SD3 DreamBooth recipe does. Cost: the LoRA parameters
and their optimizer state only; the base needs no gradients or optimizer state. With
lora.base_quantization the frozen linears are stored int8/fp8/nf4 (memory/quantize.py) under
the adapter, which is unchanged: the exported LoRA has the same keys and shapes.
"""
from __future__ import annotations

import logging
import re
from typing import Optional

import torch

from vramfit.config.schema import LoraSettings, RunConfig, TrainConfig
from vramfit.formats.lora import TEXT_ENCODER_TARGETS
from vramfit.memory.quantize import quantize_base

log = logging.getLogger("vramfit")

ALL_LINEAR = "all_linear"
ADAPTER = "default"  # peft's name of the one adapter a run trains
# Module names (one path component) whose convolutions lora.conv_rank adapts, as kohya's conv_dim does
CONV_BLOCKS = ("resnets", "downsamplers", "upsamplers")
# The factor of each adapter type that a module's scale is folded into (formats carry one per module)
UP_FACTORS = ("lora_B.weight", "hada_w1_a", "lokr_w1", "lokr_w1_a")


def target_modules(denoiser: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Full names of the modules to adapt; every configured target must match something."""
    names = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    if settings.targets == [ALL_LINEAR]:
        found = [n for n in names if "transformer_blocks." in n]
    else:
        found, unmatched = [], []
        for target in settings.targets:
            hits = [n for n in names if n == target or n.endswith("." + target)]
            if not hits:
                unmatched.append(target)
            found += hits
        if unmatched:
            raise ValueError(f"lora.targets {unmatched} match no linear layer of this model "
                             f"(examples of names: {names[:3]}); or use [\"{ALL_LINEAR}\"]")
    return sorted(set(found))


def conv_modules(denoiser: torch.nn.Module) -> list[str]:
    """The convolutions kohya's conv_dim and LyCORIS adapt: those of the ResNet blocks and the
    down/upsamplers (a UNet's; a transformer's blocks have none)."""
    return sorted(n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Conv2d)
                  and any(part in n.split(".") for part in CONV_BLOCKS))


def adapter_config(settings: LoraSettings, targets: list[str], convs: list[str]):
    """The peft config of `settings.type` over `targets` (linears) and `convs` (at conv_rank)."""
    # heavy: peft (~1.7 s, pulls transformers); `vramfit plan` imports this module
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    alpha = settings.alpha or settings.rank
    conv_alpha = settings.conv_alpha or settings.conv_rank
    ranks = {re.escape(n): settings.conv_rank for n in convs if settings.conv_rank != settings.rank}
    alphas = {re.escape(n): conv_alpha for n in convs if conv_alpha != alpha}
    common = dict(r=settings.rank, target_modules=targets + convs, rank_pattern=ranks, alpha_pattern=alphas)
    if settings.type == "lokr":
        return LoKrConfig(alpha=alpha, decompose_factor=settings.lokr_factor, **common)
    if settings.type == "loha":
        return LoHaConfig(alpha=alpha, **common)
    return LoraConfig(lora_alpha=alpha, lora_dropout=settings.dropout, init_lora_weights="gaussian",
                      use_dora=settings.type == "dora", **common)


def apply_lora(denoiser: torch.nn.Module, settings: LoraSettings,
               linear_dtype: Optional[torch.dtype] = None) -> list[str]:
    """Freeze the denoiser and add a trainable fp32 adapter of settings.type (LoRA, DoRA, LoKr,
    LoHa; on the convolutions too where lora.conv_rank is set); returns the adapted modules.
    `linear_dtype`: the precision the linears are cast to later (a quantized base is cast layer by
    layer as it is quantized); the adapter is made as over linears already in it."""
    targets = target_modules(denoiser, settings)
    convs = conv_modules(denoiser) if settings.conv_rank else []
    if settings.conv_rank and not convs:
        raise ValueError("lora.conv_rank: this denoiser has no convolutions in ResNet blocks or "
                         "down/upsamplers (a transformer's blocks are all linear); leave it out")
    denoiser.requires_grad_(False)
    # peft casts a new adapter to its base layer's weight dtype, or to the layer's `compute_dtype`
    # where it has one (as bitsandbytes' layers do): name the precision those weights will have.
    pending = [m for m in denoiser.modules() if linear_dtype is not None
               and isinstance(m, torch.nn.Linear) and m.weight.dtype != linear_dtype]
    for m in pending:
        m.compute_dtype = linear_dtype
    try:
        denoiser.add_adapter(adapter_config(settings, targets, convs))
    finally:
        for m in pending:
            del m.compute_dtype
    for p in denoiser.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return targets + convs


def lora_state(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained adapter tensors in peft naming (`<module>.lora_A.weight`, `.hada_w1_a`,
    `.lokr_w1`, ...), on the CPU in fp32, ready for the exporters (formats/lora.py):

    * each module's scale is expressed against the run's alpha over the module's own rank (what
      a file's one `.alpha` per module says): a conv module trained at conv_alpha / conv_rank has
      the difference folded into its up factor, and a LoKr module with no low-rank factor (whose
      files carry no scale) has its whole scale folded into lokr_w1;
    * a DoRA module carries `<module>.dora_scale` besides peft's magnitude: the [out, 1...]
      magnitude that ComfyUI's decomposition (which divides by the frozen weight's row norms)
      turns into exactly peft's merged weight.
    """
    # heavy: peft (~1.7 s, pulls transformers); `vramfit plan` imports this module
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict

    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in get_peft_model_state_dict(denoiser).items()}
    configs = getattr(denoiser, "peft_config", {})
    if ADAPTER not in configs:
        return state
    cfg = configs[ADAPTER]
    run_alpha = float(getattr(cfg, "lora_alpha", None) or getattr(cfg, "alpha", None) or cfg.r)
    for name, layer in denoiser.named_modules():
        if not isinstance(layer, BaseTunerLayer) or ADAPTER not in getattr(layer, "scaling", {}):
            continue
        scale, rank = float(layer.scaling[ADAPTER]), int(layer.r[ADAPTER])
        up = next((f"{name}.{k}" for k in UP_FACTORS if f"{name}.{k}" in state), None)
        if f"{name}.lokr_w1" in state and f"{name}.lokr_w2" in state:
            factor = scale  # no low-rank factor: loaders apply no alpha at all
        else:
            factor = scale * rank / run_alpha
        if up is not None and factor != 1.0:
            state[up] = state[up] * factor
        magnitude = getattr(layer, "lora_magnitude_vector", None)
        if magnitude is not None and ADAPTER in magnitude:
            state[f"{name}.dora_scale"] = _comfy_dora_scale(layer)
    return state


@torch.no_grad()
def _comfy_dora_scale(layer) -> torch.Tensor:
    """m * (|W| + eps) / |W + s B A| per output row, shaped [out, 1, ...]: ComfyUI applies
    dora_scale / (|W| + eps) to W + s B A (its weight_decompose, output axis, fp32)."""
    base = layer.get_base_layer().weight.detach().float()
    merged = base + layer.get_delta_weight(ADAPTER).float()
    rows = lambda w: w.reshape(w.shape[0], -1).norm(dim=1)  # noqa: E731
    magnitude = layer.lora_magnitude_vector[ADAPTER].weight.detach().float().reshape(-1)
    scale = magnitude * (rows(base) + torch.finfo(torch.float32).eps) / rows(merged)
    return scale.reshape(base.shape[0], *[1] * (base.dim() - 1)).cpu().contiguous()


def apply_text_encoder_lora(encoder: torch.nn.Module, settings: LoraSettings) -> int:
    """Freeze a CLIP text encoder and add a trainable fp32 LoRA (lora.text_encoder_rank) on its
    attention and MLP linears; returns the number of adapted modules."""
    # heavy: peft (~1.7 s, pulls transformers); `vramfit plan` imports this module
    from peft import LoraConfig, inject_adapter_in_model

    names = [n for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)
             and n.rsplit(".", 1)[-1] in TEXT_ENCODER_TARGETS]
    if not names:
        raise ValueError(f"lora.text_encoder_rank: {type(encoder).__name__} has no "
                         f"{'/'.join(TEXT_ENCODER_TARGETS)} linears to adapt; leave it out")
    rank = settings.text_encoder_rank
    encoder.requires_grad_(False)
    # peft itself: transformers' add_adapter asks for a newer peft than diffusers does
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=settings.text_encoder_alpha or rank,
                                       init_lora_weights="gaussian", target_modules=names), encoder, ADAPTER)
    for p in encoder.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return len(names)


def place_text_encoders(bundle, cfg: RunConfig, device: torch.device) -> list[torch.nn.Parameter]:
    """Where the CLIP text encoders of `bundle` train (the leading ones; a T5 after them is never
    trained): with lora.text_encoder_rank adapt them, with train.text_encoders = "full" make every
    weight trainable in the training precision (checkpointed where the denoiser is); put them on
    `device` for the whole run (encode_text then neither moves them nor turns gradients off:
    bundle.extra "text_encoders_trained", their number, and "text_encoder_training", how) and
    return the trained parameters; [] when they stay frozen."""
    how = cfg.text_encoder_training
    if how is None:
        return []
    key = "lora.text_encoder_rank" if how == "lora" else "train.text_encoders"
    clips = _clip_encoders(bundle)
    if not clips:
        raise ValueError(f"{key}: this model has no CLIP text encoder to train; leave it out")
    modules = 0
    for encoder in clips:
        if how == "lora":
            modules += apply_text_encoder_lora(encoder, cfg.lora)
        else:
            _train_whole_encoder(encoder, cfg.train, device)
        encoder.to(device)
    bundle.extra["text_encoders_trained"] = len(clips)
    bundle.extra["text_encoder_training"] = how
    params = [p for e in clips for p in e.parameters() if p.requires_grad]
    what = (f"LoRA rank {cfg.lora.text_encoder_rank} on {modules} modules of" if how == "lora" else
            f"every weight ({cfg.train.precision}) of")
    frozen = bundle.extra.get("frozen_encoders_cached")  # train/setup.py fill_cache
    log.info("text encoders: %s %d encoders (%.2f M parameters); they encode every caption each step "
             "(cache.text is off)%s", what, len(clips), sum(p.numel() for p in params) / 1e6,
             "; T5 stays frozen: its outputs are cached" if frozen else "")
    return params


def _train_whole_encoder(encoder: torch.nn.Module, train: TrainConfig, device: torch.device) -> None:
    """train.text_encoders = "full": every weight of `encoder` trainable on `device`, in bf16 under
    full_bf16 (the optimizer writes it back with stochastic rounding, as the denoiser's) and fp32
    otherwise, each tensor widened as it moves (never the whole encoder widened in CPU memory); each
    layer recomputed in backward where the denoiser's blocks are (any share of them)."""
    encoder.to(device, torch.bfloat16 if train.precision == "full_bf16" else torch.float32)
    encoder.requires_grad_(True)
    encoder.train()  # transformers checkpoints only in training mode (CLIP's dropout is 0)
    if train.gradient_checkpointing is not False:
        # transformers >= 5 names it activation checkpointing; both take torch.utils.checkpoint's kwargs
        enable = getattr(encoder, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            encoder.gradient_checkpointing_enable({"use_reentrant": False})


def _clip_encoders(bundle) -> list[torch.nn.Module]:
    """The leading CLIP encoders of bundle.text_encoders: what lora.text_encoder_rank trains."""
    clips = []
    for encoder in bundle.text_encoders:
        if not str(getattr(getattr(encoder, "config", None), "model_type", "")).startswith("clip"):
            break
        clips.append(encoder)
    return clips


def trained_encoders(bundle) -> list[torch.nn.Module]:
    """The text encoders that train (bundle.extra "text_encoders_trained" of them, the leading ones)."""
    return list(bundle.text_encoders[:int(bundle.extra.get("text_encoders_trained") or 0)])


def trained_weights(bundle) -> torch.nn.Module:
    """What a training state holds: the denoiser, with the trained text encoders beside it."""
    if not bundle.extra.get("text_encoders_trained"):
        return bundle.denoiser
    return TrainedWeights(bundle.denoiser, trained_encoders(bundle))


def text_encoder_states(bundle) -> list[dict[str, torch.Tensor]]:
    """Each trained text encoder's adapter tensors in peft naming (lora_state); [] when none trains."""
    return [lora_state(e) for e in trained_encoders(bundle)]


@torch.no_grad()
def merge_trained_encoders(fresh: list[torch.nn.Module], trained: list[torch.nn.Module]) -> None:
    """Merge each trained text encoder's LoRA update into its fresh copy's weights, or copy a wholly
    trained encoder's weights into it (a sample grid then encodes with what the encoders learned,
    while the trained ones stay in place)."""
    # heavy: peft (~1.7 s, pulls transformers); `vramfit plan` imports this module
    from peft.tuners.tuners_utils import BaseTunerLayer

    for copy, encoder in zip(fresh, trained):
        if not any(isinstance(m, BaseTunerLayer) for m in encoder.modules()):  # train.text_encoders = "full"
            own = copy.state_dict()
            for name, value in encoder.state_dict().items():
                own[name].copy_(value)
            continue
        modules = dict(copy.named_modules())
        for name, layer in encoder.named_modules():
            if isinstance(layer, BaseTunerLayer) and ADAPTER in getattr(layer, "scaling", {}):
                weight = modules[name].weight
                weight += layer.get_delta_weight(ADAPTER).to(weight.device, weight.dtype)


class TrainedWeights(torch.nn.Module):
    """The denoiser's parameters under their own names and each trained text encoder's under
    `text_encoder_<i>.`: what a training state saves and loads (train/state.py reads
    `named_parameters`). Registers nothing, so the modules keep their owners."""

    def __init__(self, denoiser: torch.nn.Module, encoders: list[torch.nn.Module]):
        super().__init__()
        self.parts = [("", denoiser)] + [(f"text_encoder_{i}.", e) for i, e in enumerate(encoders)]

    def named_parameters(self, *args, **kwargs):
        for prefix, module in self.parts:
            for name, p in module.named_parameters():
                yield prefix + name, p


def quantize_frozen_base(denoiser: torch.nn.Module, settings: LoraSettings, device: torch.device,
                         dtype: Optional[torch.dtype] = None):
    """Store the adapted denoiser's frozen linears as settings.base_quantization asks, then move
    the whole model to `device` (each linear arrives there as stored, is cast there to `dtype`, the
    training precision, and quantized: one widened layer at a time). None when "none"."""
    if settings.base_quantization == "none":
        return None

    summary = quantize_base(denoiser, settings.base_quantization, device, dtype=dtype)
    denoiser.to(device)
    log.info("frozen base: %d linear layers stored %s (%.1f MiB -> %.1f MiB)%s", summary.layers,
             summary.method, summary.bytes_before / 2**20, summary.bytes_after / 2**20,
             f"; {len(summary.kept)} kept unquantized (shape)" if summary.kept else "")
    return summary
