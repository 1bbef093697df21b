"""`vramfit lora merge | extract | resize`: LoRA files and checkpoints made from one another.

* merge: adds each adapter's scaled weight change to the denoiser's weights (LoRA, LoHa, LoKr; a
  DoRA's with its magnitudes, as peft merges it) and a text-encoder LoRA's to the CLIP encoders, and
  saves the checkpoint in its own layout through the family (a single file in, a single file out).
* extract: the best LoRA of a given rank (truncated SVD, per linear layer) of the difference between
  a fine-tuned checkpoint and its base, written in the family's LoRA formats.
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
from typing import Collection, Optional, Sequence

import torch
from safetensors.torch import load_file

from vramfit.config.schema import ModelConfig
from vramfit.formats.lora import (
    DIFFUSERS_METADATA_KEY, DORA_PARTS, LOHA_PARTS, LOKR_PARTS, LORA_FILE_SUFFIXES, TEXT_ENCODERS, load_lora,
    lora_scale_metadata, lycoris_delta, peft_modules, save_lora,
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


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


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
    state: dict  # peft keys
    layers: int
    unchanged: int
    kept: float  # share of the difference's energy (squared Frobenius norm) the LoRA keeps


def low_rank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], kept energy share) of the best rank-`rank` approximation B @ A."""
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    total = float((s * s).sum())
    kept = float((s[:r] * s[:r]).sum()) / total if total > 0 else 1.0
    return (root[:, None] * vh[:r]).contiguous(), (u[:, :r] * root[None, :]).contiguous(), kept


def extract_state(base: torch.nn.Module, tuned: torch.nn.Module, rank: int, device: torch.device,
                  min_change: float = 0.0) -> Extracted:
    """A rank-`rank` LoRA (peft keys) of every linear layer whose weights differ between the two."""
    base_layers, state, unchanged = _linears(base), {}, 0
    energy_total = energy_kept = 0.0
    for name, layer in _linears(tuned).items():
        other = base_layers.get(name)
        if other is None or other.weight.shape != layer.weight.shape:
            raise ValueError(f"layer {name!r} differs in shape between the two checkpoints: they are not the "
                             "same architecture")
        delta = layer.weight.detach().to(device, torch.float32) - other.weight.detach().to(device, torch.float32)
        size = float(delta.norm())
        if size <= min_change * max(float(other.weight.detach().float().norm()), 1e-12) or size == 0.0:
            unchanged += 1
            continue
        down, up, kept = low_rank(delta, rank)
        state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"] = down.cpu(), up.cpu()
        energy_total += size * size
        energy_kept += kept * size * size
    return Extracted(state, len(state) // 2, unchanged, energy_kept / energy_total if energy_total else 1.0)


def extract(base_path: str, tuned_path: str, rank: int, out: Path, formats: Sequence[str] = (),
            device: str = "auto", dtype: str = "bf16", min_change: float = 0.0,
            tokenizers: Optional[str] = None) -> dict:
    """Write the LoRA of rank `rank` that takes `base_path` closest to `tuned_path` (per layer)."""
    dev = generate_device(device)  # a device this machine lacks is named before anything loads
    family, base = load_model(base_path, tokenizers, t5=False)
    tuned_family, tuned = load_model(tuned_path, tokenizers, t5=False)
    if tuned_family.name != family.name:
        raise ValueError(f"{tuned_path} is a {tuned_family.display_name} checkpoint and {base_path} a "
                         f"{family.display_name} one: extract needs two checkpoints of the same model")
    got = extract_state(base.denoiser, tuned.denoiser, rank, dev, min_change)
    if not got.state:
        raise ValueError(f"{tuned_path}: no linear layer of the denoiser differs from {base_path}; nothing to "
                         "extract")
    state = {k: v.to(DTYPES[dtype]) for k, v in got.state.items()}
    chosen = list(formats) or [family.lora_formats[0]]
    bad = [f for f in chosen if f not in family.lora_formats]
    if bad:
        raise ValueError(f"--format {bad[0]}: {family.display_name} LoRAs are written as "
                         f"{' or '.join(family.lora_formats)}")
    meta = {"vramfit.extracted_from": json.dumps([str(base_path), str(tuned_path)]),
            "vramfit.extract_kept_energy": f"{got.kept:.6f}", "ss_base_model_version": family.base_model_version}
    paths = []
    for fmt in chosen:
        path = Path(out) if fmt == chosen[0] else _beside(Path(out), fmt)
        tensors = family.lora_tensors(fmt, state, dict(base.denoiser.config), rank)
        style = "kohya" if fmt == "lora_kohya" else "diffusers"
        save_lora(path, tensors, {**meta, **lora_scale_metadata(rank, rank, style)})
        paths.append(str(path))
    return {"files": paths, "layers": got.layers, "unchanged_layers": got.unchanged, "kept_energy": got.kept}


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
