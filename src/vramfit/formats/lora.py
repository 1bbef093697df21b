"""LoRA file formats: peft state dicts <-> the files diffusers, ComfyUI and A1111 load.

Three layouts are written or read (keys shown for one module):

* **peft** (what ``peft.utils.get_peft_model_state_dict(denoiser)`` returns; the in-memory form
  every function here takes and gives): ``<diffusers module>.lora_A.weight`` [r, in] and
  ``<diffusers module>.lora_B.weight`` [out, r]. No alpha: peft keeps it in its ``LoraConfig``
  and scales by ``lora_alpha / r``.
* **diffusers** (:func:`to_diffusers`): the peft keys behind the denoiser's pipeline component name,
  ``unet.<module>.lora_A.weight`` (SDXL, SSD-1B) or ``transformer.<module>.lora_A.weight`` (SD3).
  ``StableDiffusionXLPipeline`` / ``StableDiffusion3Pipeline.load_lora_weights`` take these keys as
  they are (no conversion step), and ComfyUI accepts the SD3 one. The format has no place for
  alpha: diffusers (without its own ``lora_adapter_metadata`` JSON) and ComfyUI (without
  ``.alpha`` tensors) both use scale 1.0. So :func:`to_diffusers` folds ``alpha / r`` into
  ``lora_B`` when alpha differs from the rank, and the file means the same thing to every loader
  regardless of metadata.
* **kohya**, the A1111 / ComfyUI / kohya-ss format: ``lora_unet_<module path, "." -> "_">``
  ``.lora_down.weight`` / ``.lora_up.weight`` and ``.alpha`` (a float32 scalar). Which module
  paths a family's kohya files name is the family's own key map (models/<family>/: the SDXL
  family's SGM names); the generic parts (:func:`kohya_name`, :func:`kohya_modules`,
  :func:`from_kohya`, text encoders' names) are here. Tensors are passed through unchanged
  (kohya's forward scales by ``alpha / r`` as peft does).

What a family's LoRA looks like (its denoiser's component name, module roots, kohya names, what
its LoRA is said to be for) each family tells through :class:`LoraFamily`; the readers take the
registry's families (models/registry.py). :func:`load_lora` reads any of these formats (plus the
older diffusers ``.lora.down.weight`` / ``.processor.to_q_lora`` spellings and kohya files with
diffusers-path names as written by diffusers' ``convert_state_dict_to_kohya``) and returns peft
keys, per-module alphas and a guess of the model family. :func:`lora_config_kwargs` turns those
into ``LoraConfig`` arguments. :func:`describe_lora` is what ``vramfit inspect`` says of a LoRA
file (from its header and alphas); :func:`lora_file_name` names the files a run writes (its
family's primary format plain).
"""
from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Protocol, Union

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vramfit.formats.safetensors_io import read_header, save_atomic

Alpha = Union[float, int, Mapping[str, float], None]

# The names diffusers' pipelines give their denoiser, before its keys in diffusers LoRA files.
DENOISER_COMPONENTS = ("unet", "transformer")
KOHYA_UNET = "lora_unet_"
KOHYA_TE = {"lora_te_": "text_encoder", "lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2",
            "lora_te3_": "text_encoder_3"}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# The CLIP text encoders' linears a text-encoder LoRA adapts (attention and MLP), as kohya's do
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers' own LoraConfig JSON in __metadata__

_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.weight)?$")  # peft's DoRA
_DORA_SCALE = re.compile(r"^(?P<module>.+)\.dora_scale$")  # ComfyUI's DoRA (to_diffusers' comfy_dora)
# kohya text-encoder module names (HF CLIP / T5 paths with "." -> "_").
_KOHYA_CLIP = re.compile(
    r"^text_model_encoder_layers_(\d+)_(self_attn_(?:q|k|v|out)_proj|mlp_fc[12])$")


class LoraFamily(Protocol):
    """What the LoRA readers ask of a model family (each family's folder answers, models/<family>/)."""

    name: str
    display_name: str  # in messages: "SDXL-family", "SD3"
    denoiser_component: str  # one of DENOISER_COMPONENTS
    lora_roots: tuple[str, ...]  # the denoiser's module roots (peft names), to tell raw peft files apart
    kohya_roots: tuple[str, ...]  # the same in kohya files, after KOHYA_UNET ("." -> "_")

    def kohya_names(self, config: Optional[Mapping]) -> Optional[dict[str, str]]:
        """{kohya module name: diffusers module path} of the denoiser `config` (None: of every
        layout the family ships); None when the family's kohya files are not read by renaming:
        a family whose kohya modules fuse several of its own (a fused qkv) then has
        ``read_kohya(tensors, config) -> (peft state, {module: alpha})`` instead, or none."""
        ...

    def lora_target(self, modules: dict[str, dict], kohya: bool) -> str:
        """What describe_lora says a LoRA of these denoiser modules ({module: {"rank", "ndim",
        "width"}}, kohya or peft names) is for."""
        ...


def _owns(family: LoraFamily, module: str) -> bool:
    """Whether `module` (peft or kohya name) is one of `family`'s denoiser modules by its root."""
    return module.startswith(family.lora_roots) or module.startswith(
        tuple(KOHYA_UNET + r for r in family.kohya_roots))


def _kohya_reader(families: Iterable[LoraFamily], modules) -> LoraFamily:
    """The family of a kohya file's denoiser modules: the first that owns one of them, else the
    first whose kohya files are read."""
    families = list(families)
    owner = next((f for f in families if any(_owns(f, m) for m in modules)), None)
    return owner or next(f for f in families if f.kohya_names(None) is not None)


def _tensor_summary(keys) -> str:
    keys = sorted(keys)
    return f"{len(keys)} key(s), e.g. {keys[0]!r}" if keys else "no keys"


# ----------------------------------------------------------------------------- peft state helpers
def peft_modules(state: Mapping[str, torch.Tensor], what: str) -> dict[str, dict[str, torch.Tensor]]:
    """Group ``<module>.lora_A.weight`` / ``lora_B.weight`` pairs by module; check shapes."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for key, t in state.items():
        m = _PEFT_KEY.match(key)
        if not m:
            bad.append(key)
            continue
        modules.setdefault(m["module"], {})[m["ab"]] = t
    if bad:
        raise ValueError(f"{what}: not a peft LoRA state dict (expected only <module>.lora_A.weight and "
                         f"<module>.lora_B.weight; DoRA, LoRA biases and embeddings are not supported); "
                         f"{len(bad)} other key(s), e.g. {sorted(bad)[0]!r}")
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            have = "lora_A" if "A" in pair else "lora_B"
            raise ValueError(f"{what}: module {module!r} has only {have}")
        a, b = pair["A"], pair["B"]
        if a.ndim < 2 or b.ndim < 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{what}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, which do not share a rank")
    return modules


# peft's tensor names of the other adapter types (formats/lora.py passes them on under the same
# names, which are LyCORIS's: ComfyUI and A1111 read them in kohya files), and DoRA's magnitudes.
LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
DORA_PARTS = ("lora_magnitude_vector", "dora_scale")  # peft's [out...]; ComfyUI's [out, 1...] (train/lora.py)
_OTHER_PART = re.compile(r"^(?P<module>.+)\.(?P<part>" + "|".join(LOHA_PARTS + LOKR_PARTS + DORA_PARTS)
                         + ")$")


def split_adapter_state(state: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(the peft LoRA pairs, {module: {part: tensor}} of DoRA's magnitudes and LoHa's and LoKr's
    factors): what the exporters pass on besides lora_A / lora_B."""
    pairs, other = {}, {}
    for key, t in state.items():
        m = None if _PEFT_KEY.match(key) else _OTHER_PART.match(key)
        if m:
            other.setdefault(m["module"], {})[m["part"]] = t
        else:
            pairs[key] = t
    return pairs, other


def lycoris_rank(parts: Mapping[str, torch.Tensor]) -> Optional[int]:
    """The rank a LoHa / LoKr module's alpha is divided by, as ComfyUI and A1111 read it: LoHa's
    hada_w1_b rows; LoKr's low-rank factor's (lokr_w2_b, else lokr_w1_b); None for a LoKr with no
    low-rank factor (its scale is in its tensors; loaders apply none)."""
    for key in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b"):
        if key in parts:
            return int(parts[key].shape[0])
    return None


def kohya_lycoris(name: str, parts: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """One LoHa / LoKr module in a kohya file: its factors under their LyCORIS names beside
    ``<name>.alpha`` (none where :func:`lycoris_rank` is None)."""
    kind = [p for p in (LOHA_PARTS, LOKR_PARTS) if set(parts) & set(p)]
    need = LOHA_PARTS if kind and kind[0] is LOHA_PARTS else ()
    if len(kind) != 1 or set(parts) - set(kind[0]) or not set(need) <= set(parts):
        raise ValueError(f"module {name!r}: not one LoHa or LoKr adapter ({sorted(parts)})")
    out = {f"{name}.{k}": v for k, v in parts.items()}
    if lycoris_rank(parts) is not None:
        out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def lycoris_delta(parts: Mapping[str, torch.Tensor], alpha: Optional[float], shape) -> torch.Tensor:
    """The weight change (fp32, in `shape`) of one LoHa / LoKr module of a kohya file, as ComfyUI
    and A1111 compute it: LoHa (w1_a @ w1_b) * (w2_a @ w2_b); LoKr kron(w1, w2), each side from
    its low-rank factors where it has them (a 4-D w2 takes w1 as a 1x1 kernel); times alpha / rank
    (:func:`lycoris_rank`; 1 where the file has no alpha or the module no rank)."""
    f = {k: v.float() for k, v in parts.items()}
    if "hada_w1_a" in f:
        diff = (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"])
    else:
        w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
        w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        diff = torch.kron(w1, w2)
    rank = lycoris_rank(parts)
    scale = alpha / rank if alpha is not None and rank else 1.0
    return (diff * scale).reshape(shape)


def lycoris_to_lora(raw: Mapping[str, torch.Tensor], names: Mapping[str, str],
                    shapes: Mapping[str, tuple], component: str) -> dict[str, torch.Tensor]:
    """A kohya file's LoHa / LoKr modules as an exact LoRA in diffusers keys, for loaders that
    read LoRA only (diffusers): each module's whole update ΔW as lora_B over an identity
    lora_A (rank = the module's inputs times its kernel), so scaling the adapter scales ΔW
    as ComfyUI's strength does. Plain LoRA modules of the file are kept as they are (alpha
    folded). `names`: {kohya name: module}; `shapes`: {module: weight shape}. Large (a
    full-rank copy of every adapted weight): meant for previews."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        name, _, part = key.partition(".")
        groups.setdefault(name, {})[part] = t
    te = sorted(n for n in groups if not n.startswith(KOHYA_UNET))
    unknown = sorted(n for n in groups if n.startswith(KOHYA_UNET) and n not in names)
    if te or unknown:
        raise ValueError(f"LoHa/LoKr module {(te or unknown)[0]!r} is not a module of this "
                         f"{'denoiser' if unknown else 'reader'} (text-encoder LoHa/LoKr are not read)")
    out, plain = {}, {}
    for name, parts in groups.items():
        alpha = float(parts["alpha"].item()) if "alpha" in parts else None
        factors = {k: v for k, v in parts.items() if k != "alpha"}
        if set(factors) & {*LOHA_PARTS, *LOKR_PARTS}:
            module, shape = names[name], tuple(shapes[names[name]])
            delta = lycoris_delta(factors, alpha, shape).reshape(shape[0], -1)
            inputs = delta.shape[1]
            eye = torch.eye(inputs).reshape(inputs, *shape[1:])
            out[f"{component}.{module}.lora_A.weight"] = eye
            kernel = [1] * (len(shape) - 2)  # a conv's lora_B is 1x1
            out[f"{component}.{module}.lora_B.weight"] = delta.reshape(shape[0], inputs, *kernel)
        else:
            plain.update({f"{name}.{k}": v for k, v in parts.items()})
    if plain:
        what = "lycoris_to_lora"
        state, alphas = from_kohya(kohya_modules(plain, what), names.__getitem__, what)
        out.update(to_diffusers(state, component, alphas))
    return out


def alpha_for(alpha: Alpha, module: str, rank: int) -> float:
    if alpha is None:
        return float(rank)
    if isinstance(alpha, Mapping):
        if module not in alpha:
            raise ValueError(f"no alpha given for LoRA module {module!r}")
        return float(alpha[module])
    return float(alpha)


def lora_ranks(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """{module: rank} of a peft-style state dict."""
    return {m: int(p["A"].shape[0]) for m, p in peft_modules(state, "LoRA state").items()}


# ----------------------------------------------------------------------------- diffusers format
def to_diffusers(peft_state: Mapping[str, torch.Tensor], component: str, alpha: Alpha = None,
                 comfy_dora: bool = False) -> dict:
    """The diffusers file layout of a denoiser LoRA: the denoiser's pipeline component name
    (``unet.``, ``transformer.``: the family's `denoiser_component`) before the peft keys.
    A DoRA module carries peft's ``lora_magnitude_vector`` (diffusers reads it); with
    ``comfy_dora`` also ComfyUI's ``dora_scale`` from the state (train/lora.py `lora_state`), for
    families whose ComfyUI LoRA is this file (SD3, Flux.1): ComfyUI reads DoRA from that key only,
    and diffusers drops it with a warning.

    ``alpha`` is the ``lora_alpha`` the LoRA was trained with (a number, or {module: alpha}); when
    it differs from a module's rank, ``lora_B`` is multiplied by ``alpha / rank`` so that loaders
    that assume scale 1.0 (diffusers without its metadata JSON, ComfyUI) apply it at its trained
    strength. ``None`` means alpha == rank (the diffusers scripts' default), and tensors are passed
    through unchanged.
    """
    if component not in DENOISER_COMPONENTS:
        raise ValueError(f"LoRA denoiser component {component!r}: expected one of "
                         f"{sorted(DENOISER_COMPONENTS)}")
    prefix = component
    peft_state, other = split_adapter_state(peft_state)
    lycoris = sorted(m for m, parts in other.items() if set(parts) - set(DORA_PARTS))
    if lycoris:
        raise ValueError(f"to_diffusers: LoHa / LoKr modules (e.g. {lycoris[0]!r}) have no layout that "
                         "diffusers loads; save them as lora_kohya (ComfyUI and A1111 read them there)")
    modules = peft_modules(peft_state, "to_diffusers")
    clash = [m for m in modules if m.split(".", 1)[0] in (*DENOISER_COMPONENTS, *TEXT_ENCODERS)]
    if clash:
        raise ValueError(f"to_diffusers: keys already carry a component prefix (e.g. {clash[0]!r}); "
                         "pass the bare peft state of the denoiser")
    out = {}
    for module, pair in modules.items():
        a, b = pair["A"], pair["B"]
        rank = int(a.shape[0])
        scale = alpha_for(alpha, module, rank) / rank
        if scale != 1.0:
            b = (b.to(torch.float32) * scale).to(b.dtype)
        out[f"{prefix}.{module}.lora_A.weight"] = a
        out[f"{prefix}.{module}.lora_B.weight"] = b
        if "lora_magnitude_vector" in other.get(module, {}):  # DoRA, as diffusers reads it into peft
            magnitude = other[module]["lora_magnitude_vector"]
            if magnitude.numel() != b.shape[0]:
                raise ValueError(f"to_diffusers: module {module!r} has a lora_magnitude_vector of "
                                 f"{tuple(magnitude.shape)}, not one value per output ({b.shape[0]})")
            out[f"{prefix}.{module}.lora_magnitude_vector"] = magnitude
            scale = other[module].get("dora_scale")
            if comfy_dora and scale is None:
                raise ValueError(f"to_diffusers: DoRA module {module!r} has no dora_scale, which ComfyUI reads; "
                                 "pass the state train/lora.py lora_state makes")
            if comfy_dora:
                out[f"{prefix}.{module}.dora_scale"] = scale
    return out


def text_encoder_lora(states: list[Mapping[str, torch.Tensor]], alpha: float, kohya: bool) -> dict:
    """The trained text encoders' LoRA (`states`: peft state with HF module paths, the pipeline's
    encoders in order) in a LoRA file beside the denoiser's: kohya's `lora_te1_` / `lora_te2_`
    names with `.alpha` (A1111, ComfyUI), or diffusers' `text_encoder.` / `text_encoder_2.`
    prefixes with alpha / rank folded into lora_B (load_lora_weights reads them at scale 1)."""
    out = {}
    for i, state in enumerate(states):
        for module, pair in peft_modules(state, "text_encoder_lora").items():
            a, b = pair["A"], pair["B"]
            # CLIPTextModel's module paths as files name them (recent transformers drop `text_model.`)
            module = module if module.startswith("text_model.") else "text_model." + module
            rank = int(a.shape[0])
            if kohya:
                name = f"lora_te{i + 1}_{module.replace('.', '_')}"
                out.update({f"{name}.lora_down.weight": a, f"{name}.lora_up.weight": b,
                            f"{name}.alpha": torch.tensor(float(alpha), dtype=torch.float32)})
            else:
                out[f"{TEXT_ENCODERS[i]}.{module}.lora_A.weight"] = a
                out[f"{TEXT_ENCODERS[i]}.{module}.lora_B.weight"] = b * (float(alpha) / rank)
    return out


# ----------------------------------------------------------------------------- kohya format
def kohya_name(module: str) -> str:
    """The kohya name of a denoiser module path (SGM or diffusers): ``lora_unet_`` + "." -> "_"."""
    return KOHYA_UNET + module.replace(".", "_")


def kohya_modules(state: Mapping[str, torch.Tensor], what: str) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for key, t in state.items():
        name, _, suffix = key.partition(".")
        if suffix not in ("lora_down.weight", "lora_up.weight", "alpha"):
            bad.append(key)
            continue
        modules.setdefault(name, {})[suffix.split(".")[0]] = t
    if bad:
        raise ValueError(f"{what}: key(s) that are not kohya LoRA (.lora_down.weight / .lora_up.weight / "
                         f".alpha; LoHa, LoKr and DoRA are not supported): {_tensor_summary(bad)}")
    for name, parts in modules.items():
        if "lora_down" not in parts or "lora_up" not in parts:
            raise ValueError(f"{what}: kohya module {name!r} lacks lora_down or lora_up")
    return modules


def from_kohya(modules, rename, what: str) -> tuple[dict, dict[str, float]]:
    state, alphas = {}, {}
    for name, parts in modules.items():
        module = rename(name)
        down, up = parts["lora_down"], parts["lora_up"]
        rank = int(down.shape[0])
        state[f"{module}.lora_A.weight"] = down
        state[f"{module}.lora_B.weight"] = up
        alphas[module] = float(parts["alpha"].item()) if "alpha" in parts else float(rank)
    peft_modules(state, what)  # shape checks
    return state, alphas


def _kohya_te_module(name: str, prefix: str) -> str:
    body = name[len(prefix):]
    m = _KOHYA_CLIP.match(body)
    if m:
        return f"text_model.encoder.layers.{m[1]}.{m[2].replace('self_attn_', 'self_attn.').replace('mlp_', 'mlp.')}"
    if body == "text_projection":
        return body
    raise ValueError(f"kohya text-encoder module {name!r} is not a CLIP attention or MLP layer")


def kohya_text_encoders_to_diffusers(tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """The kohya text-encoder modules of a LoRA file (`lora_te1_...`) as diffusers keys
    (`text_encoder.<module>.lora_A/B.weight`) with each module's alpha / rank folded into lora_B,
    for a pipeline whose own kohya reader takes the denoiser's keys only."""
    out = {}
    for pre, comp in KOHYA_TE.items():
        part = {k: v for k, v in tensors.items() if k.startswith(pre)}
        if not part:
            continue
        state, alphas = from_kohya(kohya_modules(part, what), lambda n, pre=pre: _kohya_te_module(n, pre), what)
        for key, t in state.items():
            if key.endswith(".lora_B.weight"):
                module = key[:-len(".lora_B.weight")]
                t = (t.to(torch.float32) * (alphas[module] / t.shape[1])).to(t.dtype)
            out[f"{comp}.{key}"] = t
    return out


# ----------------------------------------------------------------------------- files
def lora_scale_metadata(rank: int, alpha: float, fmt: str = "kohya") -> dict[str, str]:
    """safetensors metadata for a saved LoRA. Informational only: no loader needs it for the scale
    (kohya files carry ``.alpha`` tensors; diffusers files have alpha/rank folded into lora_B).

    ``ss_network_dim`` / ``ss_network_alpha`` are the kohya-ss names A1111 and ComfyUI front ends
    display. The diffusers key ``lora_adapter_metadata`` is deliberately not written: diffusers would
    build its LoraConfig from it alone."""
    if fmt not in ("kohya", "diffusers"):
        raise ValueError(f"LoRA format {fmt!r}: expected 'kohya' or 'diffusers'")
    meta = {"vramfit.lora.format": fmt, "vramfit.lora.rank": str(int(rank)),
            "vramfit.lora.alpha": repr(float(alpha))}
    if fmt == "kohya":
        meta.update({"ss_network_module": "networks.lora", "ss_network_dim": str(int(rank)),
                     "ss_network_alpha": repr(float(alpha))})
    else:
        meta["vramfit.lora.scale_in_weights"] = "true" if float(alpha) != float(rank) else "false"
    return meta


def save_lora(path: Union[str, Path], state: Mapping[str, torch.Tensor],
              metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a LoRA safetensors file atomically (the old file or the whole new one, never half)."""
    meta = dict(metadata or {})
    bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"safetensors metadata must map str to str; bad entry {bad[0]!r}")
    if not state:
        raise ValueError(f"{path}: refusing to save an empty LoRA")
    tensors, seen = {}, set()
    for k, v in state.items():  # safetensors refuses tensors that share storage: copy repeats
        v = v.detach()
        ptr = v.untyped_storage().data_ptr()
        tensors[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    save_atomic(tensors, Path(path), metadata=meta or None)


# File name endings of the save.formats LoRA entries other than a family's primary one, whose file
# is plain <name>.safetensors (what people drop into ComfyUI's or A1111's LoRA folder).
LORA_FILE_SUFFIXES = {"lora": "-diffusers.safetensors", "lora_kohya": "-kohya.safetensors"}


def lora_file_name(name: str, fmt: str, primary: str) -> str:
    """``<name>.safetensors`` for the family's primary LoRA format, else ``<name>-diffusers`` /
    ``<name>-kohya`` ``.safetensors`` (one extension, so every loader lists it)."""
    if fmt not in LORA_FILE_SUFFIXES:
        raise ValueError(f"LoRA format {fmt!r}: expected one of {sorted(LORA_FILE_SUFFIXES)}")
    return f"{name}.safetensors" if fmt == primary else name + LORA_FILE_SUFFIXES[fmt]


@dataclass
class LoadedLora:
    """A LoRA read by :func:`load_lora`. Unpacks as ``state, alphas, family``.

    ``state``: the denoiser's LoRA with peft keys (no component prefix); ``alphas``: {module: alpha}
    to apply with scale alpha/rank; ``family``: "sdxl", "sd3" or None when the file holds no
    denoiser LoRA; ``format``: "diffusers", "peft" or "kohya"; ``text_encoders``: {"text_encoder" |
    "text_encoder_2" | "text_encoder_3": peft state with HF module paths}; their alphas alike.
    """

    state: dict[str, torch.Tensor]
    alphas: dict[str, float]
    family: Optional[str]
    format: str
    text_encoders: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    text_encoder_alphas: dict[str, dict[str, float]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    # load_lora(adapters=True): {denoiser module: {part: tensor}} of DoRA magnitudes (beside the
    # module's pair in `state`) and LoHa / LoKr modules (their factors and kohya `alpha`)
    adapters: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __iter__(self) -> Iterator:
        return iter((self.state, self.alphas, self.family))


def detect_format(keys, families: Iterable[LoraFamily]) -> str:
    """'kohya', 'diffusers', 'peft' or 'unknown' from tensor names alone (a raw peft file by the
    module roots of the `families`' denoisers)."""
    keys = list(keys)
    if not keys:
        return "unknown"
    if all(k.startswith((KOHYA_UNET, *KOHYA_TE)) for k in keys):
        return "kohya"
    components = (*DENOISER_COMPONENTS, *TEXT_ENCODERS)
    if all(k.split(".", 1)[0] in components and ("lora" in k or _DORA_SCALE.match(k)) for k in keys):
        return "diffusers"  # (ComfyUI's DoRA dora_scale beside peft's magnitude: to_diffusers' comfy_dora)
    roots = tuple(root for family in families for root in family.lora_roots)
    if all(_PEFT_KEY.match(k) and k.startswith(roots) for k in keys):
        return "peft"
    return "unknown"


_LEGACY = [  # older diffusers spellings -> peft
    (re.compile(r"\.processor\.(to_[qkv])_lora\.(down|up)\.weight$"), r".\1.lora.\2.weight"),
    (re.compile(r"\.processor\.to_out_lora\.(down|up)\.weight$"), r".to_out.0.lora.\1.weight"),
    (re.compile(r"\.(?:lora|lora_linear_layer)\.down\.weight$"), ".lora_A.weight"),
    (re.compile(r"\.(?:lora|lora_linear_layer)\.up\.weight$"), ".lora_B.weight"),
]


def _to_peft_key(key: str) -> str:
    for pattern, repl in _LEGACY:
        key = pattern.sub(repl, key)
    return key


def _guess_family(modules, path, families: Iterable[LoraFamily]) -> LoraFamily:
    """The family all of whose denoiser's roots the LoRA's `modules` start with; a LoRA of a
    family vramfit does not know is refused, by name where its modules tell it."""
    families = list(families)
    for family in families:
        if all(m.startswith(family.lora_roots) for m in modules):
            return family
    if any(m.startswith("single_transformer_blocks.") for m in modules):
        known = " and ".join(f.display_name for f in families)
        raise ValueError(f"{path}: a FLUX LoRA (e.g. {sorted(modules)[0]!r}); only {known} "
                         "LoRAs are supported")
    raise ValueError(f"{path}: LoRA modules of no known denoiser, e.g. {sorted(modules)[0]!r}")


def _diffusers_alphas(meta: Mapping[str, str], prefix: Optional[str], ranks: Mapping[str, int]
                      ) -> dict[str, float]:
    """Alphas as diffusers would apply them: from its ``lora_adapter_metadata`` JSON when present
    (``lora_alpha`` and exact-name ``alpha_pattern`` entries), else alpha = rank."""
    raw = meta.get(DIFFUSERS_METADATA_KEY)
    cfg = {}
    if raw:
        data = json.loads(raw)
        cut = f"{prefix}." if prefix else ""
        cfg = {k[len(cut):]: v for k, v in data.items() if k.startswith(cut)} if cut else data
    out = {}
    for module, rank in ranks.items():
        pattern = cfg.get("alpha_pattern") or {}
        hit = [v for p, v in pattern.items() if module == p.lstrip("^") or module.endswith("." + p)]
        if hit:
            out[module] = float(hit[0])
        elif "lora_alpha" in cfg:
            out[module] = float(cfg["lora_alpha"])
        else:
            out[module] = float(rank)
    return out


def _kohya_adapter_parts(tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, dict]]:
    """(the plain LoRA keys of a kohya file's part, {kohya name: {part: tensor}} of its LoHa / LoKr
    modules, alpha included, and of its DoRA modules' dora_scale)."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.partition(".")
        groups.setdefault(name, {})[part] = t
    plain, other = {}, {}
    for name, parts in groups.items():
        if set(parts) & {*LOHA_PARTS, *LOKR_PARTS}:
            other[name] = parts
            continue
        if "dora_scale" in parts:
            other[name] = {"dora_scale": parts.pop("dora_scale")}
        plain.update({f"{name}.{part}": t for part, t in parts.items()})
    return plain, other


def load_lora(path: Union[str, Path], families: Iterable[LoraFamily],
              unet_config: Optional[Mapping] = None, adapters: bool = False) -> LoadedLora:
    """Read a LoRA in diffusers, raw peft or kohya layout into peft keys, as one of `families`
    (the registry's, models/registry.py) names its denoiser's modules.

    ``unet_config`` maps kohya names of the denoiser of that config; without it every layout the
    family ships is tried. Raises ValueError naming the file and an example key for anything else.
    ``adapters``: read the denoiser's DoRA magnitudes and LoHa / LoKr modules too (into
    ``LoadedLora.adapters``; a kohya file's for families whose kohya names are a renaming),
    where otherwise they are refused.
    """
    path = Path(path)
    families = list(families)
    _, meta = read_header(path)  # CheckpointError (a ValueError) for non-safetensors / truncated files
    raw = load_file(str(path), device="cpu")
    fmt = detect_format(raw, families)
    if fmt == "unknown":
        example = sorted(raw)[0] if raw else None
        raise ValueError(
            f"{path}: not a LoRA file in a format vramfit reads (diffusers 'unet.'/'transformer.' + "
            f"lora_A/lora_B, peft, or kohya 'lora_unet_' + lora_down/lora_up); "
            + (f"example key {example!r}" if example else "it holds no tensors"))
    te_state: dict[str, dict] = {}
    te_alphas: dict[str, dict] = {}
    if fmt == "kohya":
        unet_part = {k: v for k, v in raw.items() if k.startswith(KOHYA_UNET)}
        family = _kohya_reader(families, unet_part)
        names = family.kohya_names(unet_config)
        other: dict[str, dict] = {}
        if adapters:
            unet_part, other = _kohya_adapter_parts(unet_part)
            if other and names is None:
                raise ValueError(f"{path}: DoRA / LoHa / LoKr modules (e.g. {sorted(other)[0]!r}) in a kohya "
                                 f"{family.display_name} file, whose module names are not read one by one; "
                                 f"save it in the diffusers layout ({family.denoiser_component}.* keys)")
        read = getattr(family, "read_kohya", None)  # where a kohya module is several of the family's
        if names is None and read is None:
            title = family.display_name
            raise ValueError(f"{path}: a kohya {title} LoRA (e.g. {sorted(unet_part)[0]!r}) is not "
                             f"supported; save {title} LoRAs in the diffusers layout "
                             f"({family.denoiser_component}.* lora_A/lora_B)")
        modules = kohya_modules(unet_part, str(path))
        unknown = sorted(n for n in {*modules, *other} if n not in names) if names is not None else []
        if unknown:
            hint = "" if unet_config is not None else "; pass the UNet config of the model it was trained for"
            raise ValueError(f"{path}: {len(unknown)} kohya UNet module(s) not in the {family.display_name} "
                             f"layout, e.g. {unknown[0]!r}{hint}")
        if names is not None:
            state, alphas = from_kohya(modules, names.__getitem__, str(path))
        else:
            try:
                state, alphas = read(unet_part, unet_config)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        for pre, comp in KOHYA_TE.items():  # no prefix here is a prefix of another
            part = {k: v for k, v in raw.items() if k.startswith(pre)}
            if part:
                try:
                    s, a = from_kohya(kohya_modules(part, str(path)),
                                       lambda n, pre=pre: _kohya_te_module(n, pre), str(path))
                except ValueError as exc:
                    raise ValueError(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from None
                te_state.setdefault(comp, {}).update(s)
                te_alphas.setdefault(comp, {}).update(a)
        extra = {names[n]: parts for n, parts in other.items()}
        return LoadedLora(state, alphas, family.name if state or extra else None, fmt, te_state, te_alphas,
                          dict(meta), extra)

    parts: dict[Optional[str], dict] = {}
    extra: dict[str, dict] = {}
    for key, t in raw.items():
        comp, rest = key.split(".", 1) if fmt == "diffusers" else (None, key)
        magnitude = _MAGNITUDE.match(rest) if adapters and comp not in TEXT_ENCODERS else None
        if magnitude:  # DoRA, as peft and diffusers name it
            extra.setdefault(magnitude["module"], {})["lora_magnitude_vector"] = t
            continue
        scale = _DORA_SCALE.match(rest) if comp not in TEXT_ENCODERS else None
        if scale:  # DoRA, as ComfyUI reads it (peft's magnitude beside it is what vramfit applies)
            if adapters:
                extra.setdefault(scale["module"], {})["dora_scale"] = t
            continue
        parts.setdefault(comp, {})[_to_peft_key(rest)] = t
    denoisers = [c for c in parts if c in DENOISER_COMPONENTS or c is None]
    if len(denoisers) > 1:
        raise ValueError(f"{path}: LoRA for both a UNet and a transformer ({denoisers})")
    state, alphas, family = {}, {}, None
    for comp, part in parts.items():
        try:
            ranks = lora_ranks(part)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        comp_alphas = _diffusers_alphas(meta, comp, ranks)
        if comp in TEXT_ENCODERS:
            te_state[comp], te_alphas[comp] = part, comp_alphas
            continue
        state, alphas = part, comp_alphas
        owner = _guess_family(ranks, path, families)
        family = owner.name
        if comp is not None and owner.denoiser_component != comp:
            raise ValueError(f"{path}: {comp}.* keys with modules of a {family} model "
                             f"(e.g. {sorted(ranks)[0]!r})")
    return LoadedLora(state, alphas, family, fmt, te_state, te_alphas, dict(meta), extra)


def lora_config_kwargs(state: Mapping[str, torch.Tensor], alphas: Mapping[str, float]) -> dict:
    """``peft.LoraConfig`` arguments that rebuild a loaded LoRA exactly: ``r``/``lora_alpha`` from
    the most common values, ``rank_pattern``/``alpha_pattern`` for modules that differ, and the
    exact module paths as ``target_modules``."""
    ranks = lora_ranks(state)
    if not ranks:
        raise ValueError("lora_config_kwargs: the LoRA has no modules")
    r = collections.Counter(ranks.values()).most_common(1)[0][0]
    alpha = collections.Counter(alphas[m] for m in ranks).most_common(1)[0][0]
    return {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(ranks),
        # peft matches pattern keys as regexes against a dotted suffix of the module path
        "rank_pattern": {re.escape(m): k for m, k in ranks.items() if k != r},
        "alpha_pattern": {re.escape(m): alphas[m] for m in ranks if alphas[m] != alpha},
    }


# ----------------------------------------------------------------------------- inspection
_ATTN_KIND = re.compile(r"(attn\d?)[._](to_[qkv]|to_out[._]0|add_[qkv]_proj|to_add_out)$")
_FF_KIND = re.compile(r"(ff(?:_context)?)[._]net[._](0[._]proj|2)$")


def module_kind(module: str, ndim: int) -> str:
    """'attn1.to_q', 'ff.net.2', 'conv', ... for a LoRA module (dotted or kohya underscored name)."""
    if m := _ATTN_KIND.search(module):
        return f"{m[1]}.{m[2].replace('_0', '.0')}"
    if m := _FF_KIND.search(module):
        return f"{m[1]}.net.{m[2].replace('_', '.')}"
    if ndim == 4:
        return "conv"
    for name in ("proj_in", "proj_out"):
        if module.endswith(name):
            return name
    return "other"


def _numbers_first(value) -> tuple:
    """Sort key of ranks and alphas: numbers in order, then "full" (a LoKr module with no rank)."""
    return (isinstance(value, str), 0 if isinstance(value, str) else value)


def describe_lora(path: Union[str, Path], families: Iterable[LoraFamily]) -> Optional[dict]:
    """What `vramfit inspect` says about a LoRA file, from its keys, shapes and alphas (no model
    needed): format, rank and alpha, the modules it adapts by kind, and the denoiser it is for
    (which of `families`, the registry's, and what that family says of it). None when the file is
    not a LoRA in a format vramfit reads."""
    path = Path(path)
    families = list(families)
    header, meta = read_header(path)
    fmt = detect_format(header, families)
    if fmt == "unknown":
        return None
    modules: dict[str, dict] = {}  # "component:module" -> {"rank", "ndim", "width" (inputs), "alpha"}
    alpha_keys = {}
    for key, info in header.items():
        if fmt == "kohya":
            name, _, part = key.partition(".")
            comp = next((c for p, c in KOHYA_TE.items() if name.startswith(p)), "denoiser")
            entry = modules.setdefault(f"{comp}:{name}", {})
            if part == "alpha":
                alpha_keys[key] = entry
            elif part == "lora_down.weight":
                shape = info["shape"]
                entry.update(rank=int(shape[0]), ndim=len(shape), width=int(shape[1]))
            elif part in LOHA_PARTS + LOKR_PARTS:  # LyCORIS: rank of its low-rank factor, "full" without
                entry.setdefault("rank", "full")
                entry.setdefault("ndim", 2)
                entry["adapter"] = "loha" if part in LOHA_PARTS else "lokr"
                shape = info["shape"]
                if part in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b"):
                    entry["rank"] = int(shape[0])
                if part == "hada_w1_b":
                    entry["width"] = int(shape[1])
                if part == "lokr_w2" and len(shape) == 4:
                    entry["ndim"] = 4
                if part in ("lokr_w1", "lokr_w1_b", "lokr_w2", "lokr_w2_b"):  # kron: inputs multiply
                    entry[part[:7]] = int(shape[1])
            elif part == "dora_scale":
                entry["adapter"] = "dora"
            continue
        comp, rest = key.split(".", 1) if fmt == "diffusers" else ("denoiser", key)
        comp = "denoiser" if comp in DENOISER_COMPONENTS else comp
        if (m := _PEFT_KEY.match(_to_peft_key(rest))) and m["ab"] == "A":
            shape = info["shape"]
            modules[f"{comp}:{m['module']}"] = {"rank": int(shape[0]), "ndim": len(shape),
                                                "width": int(shape[1])}
    for entry in modules.values():
        if "lokr_w1" in entry and "lokr_w2" in entry:
            entry["width"] = entry.pop("lokr_w1") * entry.pop("lokr_w2")
    if alpha_keys:
        with safe_open(str(path), framework="pt") as fh:
            for key, entry in alpha_keys.items():
                entry["alpha"] = float(fh.get_tensor(key).item())
    unet = {m.split(":", 1)[1]: e for m, e in modules.items() if m.startswith("denoiser:") and "rank" in e}
    ranks = sorted({e["rank"] for e in modules.values() if "rank" in e}, key=_numbers_first)
    out = {"format": fmt, "rank": ranks[0] if len(ranks) == 1 else ranks}
    kinds = sorted({e.get("adapter", "lora") for e in modules.values() if "rank" in e})
    if fmt != "kohya" and any(k.endswith(".lora_magnitude_vector") for k in header):
        kinds = ["dora"]
    if kinds != ["lora"]:  # LoHa, LoKr, DoRA (by the tensors a module holds)
        out["adapter"] = kinds[0] if len(kinds) == 1 else kinds
    roots = {k.split(".", 1)[0] for k in header} if fmt == "diffusers" else set()
    prefix = next((r for r in roots if r in DENOISER_COMPONENTS), None)
    if fmt == "kohya":
        alphas = sorted({e.get("alpha", e["rank"]) for e in modules.values() if "rank" in e},
                        key=_numbers_first)
        out["alpha"] = alphas[0] if len(alphas) == 1 else alphas
    else:  # no alpha tensors: diffusers and ComfyUI apply scale 1 unless diffusers' metadata says otherwise
        applied = _diffusers_alphas(meta, prefix, {m: e["rank"] for m, e in unet.items()})
        alphas = sorted(set(applied.values()))
        out["alpha"] = alphas[0] if len(alphas) == 1 else alphas
        trained = meta.get("vramfit.lora_alpha")
        if trained and float(trained) != float(meta.get("vramfit.lora_rank", 0)):
            out["alpha"] = f"{out['alpha']} (trained with alpha {trained}, folded into lora_B)"
    kinds = collections.Counter(module_kind(m, e["ndim"]) for m, e in unet.items())
    out["targets"] = {"modules": len(unet), "kinds": dict(sorted(kinds.items()))}
    if unet:
        # the family most of whose denoiser's modules these are; where none is, the file's
        # component's (diffusers) or the family that reads kohya files
        family = max(families, key=lambda f: sum(_owns(f, m) for m in unet))
        if not any(_owns(family, m) for m in unet):
            family = next((f for f in families if f.denoiser_component == prefix), None) or \
                _kohya_reader(families, unet)
        out["for"] = family.lora_target(unet, fmt == "kohya")
    else:
        out["for"] = "text encoders only"
    te = sorted({m.split(":", 1)[0] for m in modules if not m.startswith("denoiser:")})
    if te:
        out["text_encoders"] = {c: sum(1 for m in modules if m.startswith(c + ":")) for c in te}
    return out
