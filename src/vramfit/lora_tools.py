"""`vramfit lora merge | extract | resize`: LoRA files and checkpoints made from one another.

* merge: adds each adapter's scaled weight change to the denoiser's weights (LoRA, LoHa, LoKr; a
  DoRA's with its magnitudes, as peft merges it) and a text-encoder LoRA's to the CLIP encoders, and
  saves the checkpoint in its own layout through the family (a single file in, a single file out).
* extract: the best LoRA of a given rank (truncated SVD, per layer) of the difference between a
  fine-tuned checkpoint and its base, written in the family's LoRA formats: the denoiser's linears
  and convolutions (as peft's LoRA of a Conv2d and kohya's conv LoRA: down [r, in, kh, kw], up
  [out, r, 1, 1]) and the CLIP text encoders' attention and MLP linears (the text-encoder LoRA
  training writes). Every layer that differs is accounted for: one no LoRA file of the family
  carries is left out by name, with its share of the difference's energy, so the kept share it
  reports is of the whole difference.
* resize: each layer's product re-factored at a lower rank the same way, key names kept, so a file
  of any format and family stays that format.

The arithmetic is a matrix product and an SVD per layer (torch.linalg, on the GPU where there is
one). peft merges only adapters it has injected into a loaded model and neither extracts nor
resizes, so the tools work on the weights directly.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Optional, Sequence

import torch
from safetensors.torch import load_file

from vramfit.config.schema import ModelConfig
from vramfit.formats.lora import (
    DIFFUSERS_METADATA_KEY, DORA_PARTS, LOHA_PARTS, LOKR_PARTS, LORA_FILE_SUFFIXES, TEXT_ENCODER_TARGETS,
    TEXT_ENCODERS, load_lora, lora_scale_metadata, lycoris_delta, peft_modules, save_lora, text_encoder_lora,
)
from vramfit.formats.safetensors_io import read_header
from vramfit.generate import generate_device
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sources import resolve_source, write_tokenizers

log = logging.getLogger("vramfit")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Down/up key endings of the LoRA layouts a file may hold (kohya and diffusers/peft).
_PAIRS = ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight"))
# Tensors of adapters that are not a plain low-rank product (DoRA, LoKr, LoHa).
_NOT_LORA = ("dora_scale", "lora_magnitude_vector", "lokr_w1", "hada_w1")


def load_model(path: str, tokenizers: Optional[str] = None, t5: bool = True):
    """(family, bundle) of a checkpoint as `vramfit train` would load it; `t5=False`: its T5 not
    read (the tools change the denoiser and the CLIP encoders only, and a save carries the source's
    T5 over), which spares host memory the size of T5-XXL."""
    source = resolve_source(ModelConfig(path=path, tokenizers=tokenizers))
    family = detect_family(source)
    return family, family.load(source, **({"t5_precision": "none"} if family.has_t5 and not t5 else {}))


def _refuse_non_lora(path, keys, tool: str) -> None:
    """Refuse a file holding DoRA, LoKr or LoHa tensors where a tool re-factors low-rank products:
    theirs are none (a DoRA's magnitude rescales each output row of the merged weight)."""
    odd = sorted(k for k in keys if any(part in k for part in _NOT_LORA))
    if odd:
        raise ValueError(f"{path}: holds adapter tensors that are not a plain LoRA (e.g. {odd[0]!r}: DoRA, "
                         f"LoKr or LoHa); {tool} takes LoRA files only")


def _adaptable(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The layers a LoRA adapts, by name: linears and 2-D convolutions."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


# ---- merge --------------------------------------------------------------------------------------

def _rows(weight: torch.Tensor) -> torch.Tensor:
    """Each output row's (channel's) L2 norm: peft's DoRA weight norm (all dims but the output)."""
    return weight.reshape(weight.shape[0], -1).norm(dim=1)


def _delta(name: str, weight: torch.Tensor, pairs: dict, alphas: dict, parts: dict) -> torch.Tensor:
    """One module's weight change at scale 1 (fp32, the weight's shape): alpha/r * B @ A of a pair,
    or a LoHa / LoKr module's as ComfyUI and A1111 compute it (formats/lora.py lycoris_delta)."""
    if name in pairs:
        down, up = pairs[name]["A"].float(), pairs[name]["B"].float()
        rank = down.shape[0]
        return (up.flatten(1) @ down.flatten(1) * (alphas.get(name, rank) / rank)).reshape(weight.shape)
    alpha = float(parts["alpha"].item()) if "alpha" in parts else None
    factors = {k: v for k, v in parts.items() if k != "alpha"}
    return lycoris_delta(factors, alpha, weight.shape)


def _magnitude(parts: dict, base: torch.Tensor, delta: torch.Tensor, what: str) -> Optional[torch.Tensor]:
    """A DoRA module's trained magnitude per output row (fp32), or None for another module: peft's
    lora_magnitude_vector, or recovered from a kohya dora_scale (ComfyUI's m * (|W| + eps) / |W + dW|,
    train/lora.py) against the unmerged `base` and the file's own change `delta`."""
    if "lora_magnitude_vector" in parts:
        magnitude = parts["lora_magnitude_vector"].float().reshape(-1)
    elif "dora_scale" in parts:
        scale = parts["dora_scale"]
        if scale.dim() < 2 or scale.shape[0] != base.shape[0] or scale[0].numel() != 1:
            raise ValueError(f"{what}: a dora_scale of shape {tuple(scale.shape)}, not one value per output "
                             f"row of its {tuple(base.shape)} weight (ComfyUI's output axis, which vramfit "
                             "writes); merge takes no other DoRA layout")
        rows = _rows(base)
        magnitude = scale.float().reshape(-1) * _rows(base + delta) / (rows + torch.finfo(torch.float32).eps)
    else:
        return None
    if magnitude.numel() != base.shape[0]:
        raise ValueError(f"{what}: a DoRA magnitude of {magnitude.numel()} values for a layer with "
                         f"{base.shape[0]} outputs; is it a LoRA for another model?")
    return magnitude


def add_products(model: torch.nn.Module, state: dict, alphas: dict, scale: float, what: str,
                 adapters: Optional[dict] = None, unmerged: Optional[dict] = None,
                 keep: Collection[str] = ()) -> int:
    """Merge an adapter at `scale` into `model`'s weights; returns the number of modules. `state`:
    peft-key LoRA pairs (W += scale * alpha/r * B @ A); `adapters`: LoadedLora.adapters, LoHa / LoKr
    modules (W += scale * their change) and DoRA magnitudes m of pairs, merged as peft merges a DoRA
    whose scale was multiplied by `scale`: W' = m * (W + s dW) / |W0 + s dW| per output row, W0 the
    weight before any file of this merge (`unmerged` holds it for modules an earlier file changed;
    the modules in `keep` have theirs stored there before they change). So for DoRA a scale scales
    the direction's change only: the rows keep the trained magnitudes, and scale 0 is the base
    with each row rescaled to its magnitude, not the base. Every module must be in `model` (a LoRA
    for another layout is refused, nothing changed)."""
    adapters, unmerged = adapters or {}, {} if unmerged is None else unmerged
    modules = dict(model.named_modules())
    pairs = peft_modules(state, what)
    names = sorted({*pairs, *adapters})
    missing = [n for n in names if n not in modules or not hasattr(modules[n], "weight")]
    if missing:
        raise ValueError(f"{what}: {len(missing)} LoRA module(s) are not layers of this model, e.g. "
                         f"{missing[0]!r}; is it a LoRA for another model?")
    orphans = [n for n in names if n not in pairs and not set(adapters[n]) & {*LOHA_PARTS, *LOKR_PARTS}]
    if orphans:
        raise ValueError(f"{what}: module {orphans[0]!r} has a DoRA magnitude but no lora_A / lora_B "
                         "(lora_down / lora_up); the file is incomplete")
    for name in names:
        weight = modules[name].weight
        with torch.no_grad():
            if name in keep and name not in unmerged:
                unmerged[name] = weight.detach().clone()
            current = weight.detach().float()
            try:
                delta = _delta(name, current, pairs, alphas, adapters.get(name, {})).to(current.device)
            except (KeyError, RuntimeError) as exc:
                raise ValueError(f"{what}: module {name!r}: its tensors do not make a change of its "
                                 f"{tuple(weight.shape)} weight ({exc}); is it a LoRA for another "
                                 "model?") from None
            base = unmerged[name].float() if name in unmerged else current
            magnitude = _magnitude(adapters.get(name, {}), base, delta, f"{what}: module {name!r}")
            if magnitude is None:
                merged = current + scale * delta
            else:
                factor = magnitude.to(current.device) / _rows(base + scale * delta)
                merged = factor.reshape(-1, *[1] * (current.dim() - 1)) * (current + scale * delta)
            weight.copy_(merged.to(weight.dtype))
    return len(names)


def _encoder_state(lora, component: str, encoder: torch.nn.Module) -> tuple[dict, dict]:
    """A text encoder's LoRA (state, alphas) under `encoder`'s own module names: files name CLIP's
    modules `text_model.<...>`, which CLIPTextModel of recent transformers drops."""
    names = {n for n, _ in encoder.named_modules()}

    def own(module: str) -> str:
        if module in names:
            return module
        short = module.removeprefix("text_model.")
        return short if short in names else "text_model." + short

    state, alphas = lora.text_encoders[component], lora.text_encoder_alphas.get(component, {})
    renamed = {}
    for key, t in state.items():
        module, _, part = key.rpartition(".lora_")
        renamed[f"{own(module)}.lora_{part}"] = t
    return renamed, {own(m): a for m, a in alphas.items()}


def _model_type(encoder) -> str:
    return str(getattr(getattr(encoder, "config", None), "model_type", ""))


def _check_encoders(bundle, lora, path, model_path: str) -> None:
    """Refuse a text-encoder LoRA for an encoder that is not one of the model's leading CLIP
    encoders: the saved file carries merged encoders only where training writes trained ones."""
    for component in sorted(lora.text_encoders):
        index = TEXT_ENCODERS.index(component)
        leading = bundle.text_encoders[:index + 1]
        if len(leading) <= index or not all(_model_type(e).startswith("clip") for e in leading):
            # a T5 is not read here (load_model t5=False): past the CLIPs the model has no CLIP encoder
            has = f"a {_model_type(leading[index])} encoder" if len(leading) > index else "no CLIP encoder"
            raise ValueError(f"{path}: a LoRA of {component} (text encoder {index + 1}), but {model_path} "
                             f"has {has} there; merge writes merged CLIP text encoders only. Merge a LoRA "
                             "without it")


def _merge_encoders(bundle, lora, scale: float, path) -> int:
    """Merge a file's text-encoder LoRA into the bundle's CLIP encoders (TEXT_ENCODERS order) and
    mark them for saving as train.text_encoders = "full" marks trained ones (models/parts.py
    trained_encoder_states writes the leading bundle.extra["text_encoders_trained"])."""
    count = 0
    for component in sorted(lora.text_encoders):
        index = TEXT_ENCODERS.index(component)
        encoder = bundle.text_encoders[index]
        state, alphas = _encoder_state(lora, component, encoder)
        count += add_products(encoder, state, alphas, scale, f"{path} ({component})")
        trained = int(bundle.extra.get("text_encoders_trained") or 0)
        bundle.extra["text_encoders_trained"] = max(index + 1, trained)
        bundle.extra["text_encoder_training"] = "full"
    return count


def _read_lora(path: Path, model_path: str, family, bundle):
    """A LoRA file as merge reads it (DoRA, LoHa and LoKr modules too), checked against the model."""
    try:
        lora = load_lora(path, FAMILIES.values(), unet_config=dict(bundle.denoiser.config), adapters=True)
    except ValueError as exc:
        raise ValueError(f"{path}: not a LoRA vramfit can merge into {model_path} (a {family.display_name} "
                         f"checkpoint, layout {bundle.layout}): {exc}") from None
    if lora.family not in (None, bundle.family):
        raise ValueError(f"{path}: a {FAMILIES[lora.family].display_name} LoRA, but {model_path} is a "
                         f"{family.display_name} checkpoint")
    _check_encoders(bundle, lora, path, model_path)
    return lora


def merge(model_path: str, loras: Sequence[tuple[Path, float]], out: Path, dtype: str = "bf16",
          tokenizers: Optional[str] = None) -> dict:
    """Merge `loras` ((file, scale), ...): LoRA, DoRA, LoHa and LoKr files, text-encoder LoRAs
    included, into the checkpoint at `model_path`; save it to `out`. Every file is read and checked
    before any weight changes; merged text encoders are written into the saved file. A DoRA's scale
    scales its direction's change, not its magnitudes (add_products)."""
    if Path(out).resolve() == Path(model_path).expanduser().resolve():
        raise ValueError(f"{out}: the output would overwrite the input checkpoint; give another path")
    family, bundle = load_model(model_path, tokenizers, t5=False)
    read = [(path, scale, _read_lora(path, model_path, family, bundle)) for path, scale in loras]
    # DoRA's norms are of the weights before this merge: kept for modules an earlier file changes
    last_dora = {m: i for i, (_, _, lora) in enumerate(read) for m, parts in lora.adapters.items()
                 if set(parts) & set(DORA_PARTS)}
    unmerged: dict[str, torch.Tensor] = {}
    merged = {}
    for i, (path, scale, lora) in enumerate(read):
        keep = {m for m, last in last_dora.items() if last > i}
        merged[str(path)] = add_products(bundle.denoiser, lora.state, lora.alphas, scale, str(path),
                                         lora.adapters, unmerged, keep)
        merged[str(path)] += _merge_encoders(bundle, lora, scale, path)
    unmerged.clear()
    meta = {"vramfit.merged_loras": json.dumps([[str(p), s] for p, s in loras])}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    family.save_single_file(bundle, Path(out), DTYPES[dtype], meta)
    write_tokenizers(bundle.source, bundle.tokenizers, Path(out))  # generate and train need no setting
    return {"model": str(out), "layers": merged}


# ---- extract ------------------------------------------------------------------------------------

@dataclass
class Extracted:
    """The LoRA of one model's difference from its base (extract_state)."""

    state: dict  # peft keys, the model's own module names
    unchanged: int  # layers whose weights do not differ (or by no more than min_change)
    energy: dict  # {layer: its difference's energy (squared Frobenius norm)}, every layer that differs
    kept: dict  # {layer: the energy its LoRA keeps}, the layers in `state`
    left_out: dict  # {layer: why no LoRA here carries it}, layers that differ but are not in `state`

    @property
    def layers(self) -> int:
        return len(self.kept)


def low_rank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], kept energy share) of the best rank-`rank` approximation B @ A."""
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    total = float((s * s).sum())
    kept = float((s[:r] * s[:r]).sum()) / total if total > 0 else 1.0
    return (root[:, None] * vh[:r]).contiguous(), (u[:, :r] * root[None, :]).contiguous(), kept


def _factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, kept energy share) of one layer's difference at rank `rank`: a convolution's
    [out, in, kh, kw] is factored as the [out, in*kh*kw] matrix it multiplies by, giving down
    [r, in, kh, kw] and up [out, r, 1, 1] (peft's LoRA of a Conv2d, kohya's conv LoRA; a 1x1
    convolution is a linear's SVD). Zero-padded to `rank` where the layer is narrower, so every
    module has rank `rank` and alpha = rank means scale 1 in each format (they write one alpha)."""
    down, up, kept = low_rank(delta.flatten(1), rank)
    pad = rank - down.shape[0]
    if pad:
        down = torch.cat([down, down.new_zeros(pad, down.shape[1])])
        up = torch.cat([up, up.new_zeros(up.shape[0], pad)], dim=1)
    kernel = [1] * (delta.dim() - 2)
    return down.reshape(rank, *delta.shape[1:]), up.reshape(delta.shape[0], rank, *kernel).contiguous(), kept


def extract_state(base: torch.nn.Module, tuned: torch.nn.Module, rank: int, device: torch.device,
                  min_change: float = 0.0,
                  why_not: Optional[Callable[[str, torch.nn.Module], Optional[str]]] = None) -> Extracted:
    """A rank-`rank` LoRA (peft keys) of every linear and 2-D convolution whose weights differ
    between the two (_factors). `why_not(name, layer)`: why no LoRA file here carries that layer,
    None where one does; a grouped convolution is carried by none. Layers left out are named in
    the result with their energy. A layer not in both models with one shape is an error."""
    base_layers, tuned_layers = _adaptable(base), _adaptable(tuned)
    odd = sorted(n for n in {*base_layers, *tuned_layers} if n not in base_layers or n not in tuned_layers
                 or base_layers[n].weight.shape != tuned_layers[n].weight.shape)
    if odd:
        raise ValueError(f"layer {odd[0]!r} differs in shape between the two checkpoints: they are not the "
                         "same architecture")
    got = Extracted({}, 0, {}, {}, {})
    for name, layer in tuned_layers.items():
        other = base_layers[name]
        delta = layer.weight.detach().to(device, torch.float32) - other.weight.detach().to(device, torch.float32)
        size = float(delta.norm())
        if size <= min_change * max(float(other.weight.detach().float().norm()), 1e-12) or size == 0.0:
            got.unchanged += 1
            continue
        got.energy[name] = size * size
        if isinstance(layer, torch.nn.Conv2d) and layer.groups != 1:
            why = "a grouped convolution, which no LoRA layout carries"
        else:
            why = why_not(name, layer) if why_not is not None else None
        if why is not None:
            got.left_out[name] = why
            continue
        down, up, kept = _factors(delta, rank)
        got.state[f"{name}.lora_A.weight"], got.state[f"{name}.lora_B.weight"] = down.cpu(), up.cpu()
        got.kept[name] = kept * size * size
    return got


def _conv_refusal(family, formats: Sequence[str], config: dict, rank: int):
    """why_not of extract_state for the denoiser: a convolution that one of `formats` of `family`
    cannot write (its lora_tensors refuses a LoRA of that module), None for any other layer."""
    def why_not(name: str, layer: torch.nn.Module) -> Optional[str]:
        if not isinstance(layer, torch.nn.Conv2d):
            return None
        out_ch, in_ch, *kernel = layer.weight.shape
        probe = {f"{name}.lora_A.weight": torch.zeros(rank, in_ch, *kernel),
                 f"{name}.lora_B.weight": torch.zeros(out_ch, rank, *[1] * len(kernel))}
        for fmt in formats:
            try:
                family.lora_tensors(fmt, probe, config, rank)
            except ValueError as exc:
                return f"{fmt} files of a {family.display_name} model carry no LoRA of this convolution ({exc})"
        return None
    return why_not


def _encoder_refusal(name: str, layer: torch.nn.Module) -> Optional[str]:
    """why_not of extract_state for a CLIP text encoder: text-encoder LoRA files name its attention
    and MLP linears only (the layers training's text-encoder LoRA adapts, train/lora.py)."""
    if name.rsplit(".", 1)[-1] in TEXT_ENCODER_TARGETS:
        return None
    return (f"not an attention or MLP linear ({'/'.join(TEXT_ENCODER_TARGETS)}), the text-encoder layers "
            "LoRA files name")


def _clip_count(bundle) -> int:
    """How many of the bundle's leading text encoders are CLIP (those a text-encoder LoRA is of)."""
    count = 0
    for encoder in bundle.text_encoders:
        if encoder is None or not _model_type(encoder).startswith("clip"):
            break
        count += 1
    return count


def extract(base_path: str, tuned_path: str, rank: int, out: Path, formats: Sequence[str] = (),
            device: str = "auto", dtype: str = "bf16", min_change: float = 0.0,
            tokenizers: Optional[str] = None) -> dict:
    """Write the LoRA of rank `rank` that takes `base_path` closest to `tuned_path` (per layer): of
    the denoiser's linears and convolutions and, where they differ, of the CLIP text encoders'
    attention and MLP linears (kohya lora_te1_ / lora_te2_, diffusers text_encoder(_2).). The kept
    energy is a share of every layer that differs; those no file carries are in "left_out"."""
    dev = generate_device(device)  # a device this machine lacks is named before anything loads
    family, base = load_model(base_path, tokenizers, t5=False)
    tuned_family, tuned = load_model(tuned_path, tokenizers, t5=False)
    if tuned_family.name != family.name:
        raise ValueError(f"{tuned_path} is a {tuned_family.display_name} checkpoint and {base_path} a "
                         f"{family.display_name} one: extract needs two checkpoints of the same model")
    chosen = list(formats) or [family.lora_formats[0]]
    bad = [f for f in chosen if f not in family.lora_formats]
    if bad:
        raise ValueError(f"--format {bad[0]}: {family.display_name} LoRAs are written as "
                         f"{' or '.join(family.lora_formats)}")
    config = dict(base.denoiser.config)
    got = extract_state(base.denoiser, tuned.denoiser, rank, dev, min_change,
                        _conv_refusal(family, chosen, config, rank))
    clips = min(_clip_count(base), _clip_count(tuned))
    encoders = [extract_state(base.text_encoders[i], tuned.text_encoders[i], rank, dev, min_change,
                              _encoder_refusal) for i in range(clips)]
    parts = [("", got)] + [(f"{TEXT_ENCODERS[i]}.", e) for i, e in enumerate(encoders)]
    energy = {p + n: e for p, part in parts for n, e in part.energy.items()}
    if not energy:
        raise ValueError(f"{tuned_path}: no linear layer or convolution of the denoiser or the CLIP text "
                         f"encoders differs from {base_path}; nothing to extract")
    total = sum(energy.values())
    kept = sum(e for _, part in parts for e in part.kept.values()) / total
    left_out = {p + n: {"energy": part.energy[n] / total, "why": why}
                for p, part in parts for n, why in part.left_out.items()}
    if left_out:  # the kept share above counts them as lost
        share = sum(v["energy"] for v in left_out.values())
        largest = max(left_out, key=lambda n: left_out[n]["energy"])
        log.warning("extract: %d layer(s) that differ are left out, %.1f%% of the difference's energy "
                    "(the largest, %s: %s)", len(left_out), 100 * share, largest, left_out[largest]["why"])
    if not any(part.state for _, part in parts):
        raise ValueError(f"{tuned_path}: only layers no {family.display_name} LoRA file carries differ from "
                         f"{base_path} (e.g. {next(iter(left_out))}); nothing to extract")
    convs = sum(1 for n in got.kept if got.state[f"{n}.lora_A.weight"].dim() == 4)
    te_layers = sum(e.layers for e in encoders)
    log.info("extract: %d linear layer(s) and %d convolution(s) of the denoiser, %d text-encoder layer(s)",
             got.layers - convs, convs, te_layers)
    state = {k: v.to(DTYPES[dtype]) for k, v in got.state.items()}
    te_states = [{k: v.to(DTYPES[dtype]) for k, v in e.state.items()} for e in encoders]
    meta = {"vramfit.extracted_from": json.dumps([str(base_path), str(tuned_path)]),
            "vramfit.extract_kept_energy": f"{kept:.6f}", "ss_base_model_version": family.base_model_version}
    if left_out:
        meta["vramfit.extract_left_out"] = json.dumps({n: round(v["energy"], 6) for n, v in left_out.items()})
    if te_layers:
        meta.update({"vramfit.text_encoder_rank": str(rank), "vramfit.text_encoder_alpha": str(rank)})
    paths = []
    for fmt in chosen:
        path = Path(out) if fmt == chosen[0] else _beside(Path(out), fmt)
        tensors = family.lora_tensors(fmt, state, config, rank) if state else {}
        tensors.update(text_encoder_lora(te_states, rank, kohya=fmt == "lora_kohya"))
        style = "kohya" if fmt == "lora_kohya" else "diffusers"
        scale = lora_scale_metadata(rank, rank, style)
        if style == "kohya" and convs:  # kohya's conv_dim / conv_alpha, as its trainer and extractor write
            scale["ss_network_args"] = json.dumps({"conv_dim": str(rank), "conv_alpha": str(rank)})
        save_lora(path, tensors, {**meta, **scale})
        paths.append(str(path))
    unchanged = got.unchanged + sum(e.unchanged for e in encoders)
    return {"files": paths, "layers": got.layers + te_layers, "unchanged_layers": unchanged, "kept_energy": kept,
            "conv_layers": convs, "text_encoder_layers": te_layers, "left_out": left_out}


def _beside(primary: Path, fmt: str) -> Path:
    """Where a second format goes beside the primary file: <stem>-kohya / -diffusers.safetensors."""
    return primary.with_name(primary.stem + LORA_FILE_SUFFIXES[fmt])


# ---- resize -------------------------------------------------------------------------------------

def _scale(raw: dict, meta: dict, down_key: str, suffix: str, rank: int) -> float:
    """alpha / r of one module: its `.alpha` tensor (kohya), diffusers' own metadata, else 1
    (diffusers files with the scale folded into lora_B, as vramfit writes them)."""
    alpha_key = down_key[: -len(suffix)] + ".alpha"
    if alpha_key in raw:
        return float(raw[alpha_key]) / rank
    if DIFFUSERS_METADATA_KEY in meta:
        config = json.loads(meta[DIFFUSERS_METADATA_KEY])
        config = next(iter(config.values())) if "lora_alpha" not in config and config else config
        return float(config.get("lora_alpha", rank)) / float(config.get("r", rank))
    return 1.0


def resize(path: Path, rank: int, out: Path, device: str = "auto") -> dict:
    """Every layer of the LoRA at `path` re-factored at rank `rank` (layers already at or below it
    are kept), keys and format unchanged; the scale is folded in (alpha = the new rank)."""
    dev = generate_device(device)  # named before anything is read
    path, out = Path(path), Path(out)
    if out.resolve() == path.resolve():
        raise ValueError(f"{out}: the output would overwrite the input LoRA; give another path")
    _, meta = read_header(path)
    raw = load_file(str(path))
    _refuse_non_lora(path, raw, "resize")
    result, layers, shrunk, worst = {}, 0, 0, 1.0
    for key in sorted(raw):
        pair = next(((d, u) for d, u in _PAIRS if key.endswith(d)), None)
        if pair is None:
            continue
        down_suffix, up_suffix = pair
        up_key = key[: -len(down_suffix)] + up_suffix
        if up_key not in raw:
            raise ValueError(f"{path}: {key} has no {up_key}")
        down, up = raw[key], raw[up_key]
        old = down.shape[0]
        scale = _scale(raw, meta, key, down_suffix, old)
        layers += 1
        if old <= rank:
            new_down, new_up = down, up * scale if scale != 1.0 else up
        else:
            delta = up.to(dev, torch.float32).flatten(1) @ down.to(dev, torch.float32).flatten(1) * scale
            a, b, kept = low_rank(delta, rank)
            worst = min(worst, kept)
            shrunk += 1
            new_down = a.reshape(rank, *down.shape[1:]).to(down.dtype).cpu()
            new_up = b.reshape(up.shape[0], rank, *up.shape[2:]).to(up.dtype).cpu()
        result[key], result[up_key] = new_down.contiguous(), new_up.to(up.dtype).contiguous()
        alpha_key = key[: -len(down_suffix)] + ".alpha"
        if alpha_key in raw:
            result[alpha_key] = torch.tensor(float(new_down.shape[0]), dtype=raw[alpha_key].dtype)
    if not layers:
        raise ValueError(f"{path}: no LoRA layers found (no lora_down/lora_up or lora_A/lora_B keys)")
    result.update({k: v for k, v in raw.items() if k not in result and not k.endswith(".alpha")})
    meta = {k: v for k, v in meta.items() if k != DIFFUSERS_METADATA_KEY}
    meta.update({"ss_network_dim": str(rank), "ss_network_alpha": repr(float(rank)),
                 "vramfit.lora.rank": str(rank), "vramfit.lora.alpha": repr(float(rank)),
                 "vramfit.resized_from": str(path)})
    for key in ("vramfit.lora_rank", "vramfit.lora_alpha"):  # what a training run wrote
        if key in meta:
            meta[key] = str(rank)
    args = _network_args(meta.get("ss_network_args"))
    if args and "conv_dim" in args and int(float(args["conv_dim"])) > rank:  # convolutions resized too
        args.update(conv_dim=str(rank), conv_alpha=str(rank))
        meta["ss_network_args"] = json.dumps(args)
    save_lora(out, result, meta)
    return {"file": str(out), "layers": layers, "resized_layers": shrunk, "least_kept_energy": worst}


def _network_args(text: Optional[str]) -> Optional[dict]:
    """kohya's ss_network_args (a JSON object) as a dict; None where absent or not an object."""
    try:
        args = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None
