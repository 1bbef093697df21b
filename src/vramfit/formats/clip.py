"""CLIP text-encoder keys: single-file conventions <-> transformers models.

Two single-file conventions exist for SDXL's text encoders:

* CLIP-L (``conditioner.embedders.0.transformer.``) already uses transformers key names, always
  with the ``text_model.`` wrapper and usually with ``text_model.embeddings.position_ids``.
  transformers >= 5.6 flattened ``CLIPTextModel`` (no ``text_model.`` wrapper; ``position_ids`` is a
  non-persistent buffer), while ``CLIPTextModelWithProjection`` kept the wrapper. The functions
  here translate between the file convention and whatever the installed class expects, by looking
  at the model's own state-dict keys rather than at the transformers version.
* OpenCLIP ViT-bigG (``conditioner.embedders.1.model.``) uses OpenCLIP names: fused q/k/v
  ``in_proj`` tensors, bare ``positional_embedding`` and a bare ``text_projection`` stored
  transposed relative to ``nn.Linear`` (as diffusers and ComfyUI treat it).

Keys are given without the single-file prefix. Only the fused attention tensors (split / joined)
and the projection (transposed) are new tensors; the rest are passed through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from vramfit.formats.keys import UnmappedKeysError

_WRAP = "text_model."
_POSITION_IDS = "embeddings.position_ids"
_POSITION_EMB = "embeddings.position_embedding.weight"
# OpenCLIP top-level names -> HF names below ``text_model.``
_OPENCLIP_TOP = {
    "token_embedding.weight": "embeddings.token_embedding.weight",
    "positional_embedding": _POSITION_EMB,
    "ln_final.weight": "final_layer_norm.weight",
    "ln_final.bias": "final_layer_norm.bias",
}
# OpenCLIP residual-block module -> HF encoder-layer module (the fused in_proj is handled apart)
_OPENCLIP_LAYER = {
    "attn.out_proj": "self_attn.out_proj",
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_RESBLOCK_RE = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)$")
_IN_PROJ_RE = re.compile(r"^transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _bare(key: str) -> str:
    return key.removeprefix(_WRAP)


def _wrapped(bare_key: str) -> str:
    # text_projection sits beside text_model in CLIPTextModelWithProjection, not inside it
    return bare_key if bare_key.startswith("text_projection.") else _WRAP + bare_key


def _position_ids(sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
    emb = next((t for k, t in sd.items() if _bare(k) == _POSITION_EMB), None)
    if emb is None:
        raise ValueError(f"CLIP state dict has no {_WRAP + _POSITION_EMB!r}; cannot build position_ids")
    return torch.arange(emb.shape[0], dtype=torch.long, device=emb.device).unsqueeze(0)


def clip_config_from_keys(
    sd: Mapping[str, torch.Tensor],
    *,
    hidden_act: str,
    with_projection: bool,
    bos_token_id: int = 49406,
    eos_token_id: int = 49407,
    pad_token_id: int = 1,
    layer_norm_eps: float = 1e-5,
) -> dict:
    """``CLIPTextConfig`` kwargs read from HF-style CLIP text keys (``text_model.`` optional).

    ``hidden_act`` is not in the weights: CLIP-L uses ``"quick_gelu"``, OpenCLIP bigG ``"gelu"``.
    Heads follow the 64-channels-per-head convention of both encoders.
    """
    bare = {_bare(k): t for k, t in sd.items()}

    def need(key: str) -> torch.Tensor:
        if key not in bare:
            raise ValueError(f"not a CLIP text-model state dict: missing key {_WRAP + key!r}")
        return bare[key]

    token = need("embeddings.token_embedding.weight")
    hidden = int(token.shape[1])
    layers = {int(m.group(1)) for k in bare if (m := _HF_LAYER_RE.match(k))}
    if not layers or layers != set(range(len(layers))):
        raise ValueError(f"CLIP encoder layer numbering is not contiguous from 0: {sorted(layers)}")
    if with_projection and "text_projection.weight" not in bare:
        raise ValueError("with_projection=True but the state dict has no 'text_projection.weight'")
    return {
        "vocab_size": int(token.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(need("encoder.layers.0.mlp.fc1.weight").shape[0]),
        "num_hidden_layers": len(layers),
        "num_attention_heads": max(1, hidden // 64),
        "max_position_embeddings": int(need(_POSITION_EMB).shape[0]),
        "projection_dim": int(bare["text_projection.weight"].shape[0]) if with_projection else hidden,
        "hidden_act": hidden_act,
        "layer_norm_eps": layer_norm_eps,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }


def normalize_hf_clip_keys(sd: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename HF CLIP keys (with or without ``text_model.``) to what ``model.load_state_dict`` wants.

    The wrapper is added or removed according to the model's own keys, and ``position_ids`` is
    dropped when the model does not persist it or built when it does and ``sd`` lacks it.
    """
    expected = model.state_dict().keys()
    wrapped = any(k.startswith(_WRAP) for k in expected)
    out = {(_wrapped(_bare(k)) if wrapped else _bare(k)): t for k, t in sd.items()}
    pid = _WRAP + _POSITION_IDS if wrapped else _POSITION_IDS
    if pid not in expected:
        out.pop(pid, None)
    elif pid not in out:
        out[pid] = _position_ids(sd)
    return out


def to_sgm_clip_keys(state_dict_of_model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIP state dict -> single-file keys: always ``text_model.``-prefixed and
    carrying ``text_model.embeddings.position_ids`` (int64), as SDXL files and loaders expect."""
    out = {_wrapped(_bare(k)): t for k, t in state_dict_of_model.items()}
    pid = _WRAP + _POSITION_IDS
    if pid not in out:
        out[pid] = _position_ids(state_dict_of_model)
    return out


def _split_in_proj(layer: str, kind: str, fused: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    if fused.shape[0] % 3:
        raise ValueError(f"in_proj_{kind} of resblock {layer} has {fused.shape[0]} rows, not a multiple of 3")
    for name, part in zip("qkv", fused.chunk(3, dim=0)):
        # clone: row views of one storage would make safetensors refuse to save the dict
        out[f"{_WRAP}encoder.layers.{layer}.self_attn.{name}_proj.{kind}"] = part.clone()


def openclip_to_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenCLIP text tower (bigG, prefix stripped) -> ``CLIPTextModelWithProjection`` keys.

    ``logit_scale`` (the contrastive temperature) has no HF text-model counterpart and is dropped;
    pass it back to :func:`hf_to_openclip` when writing a single file. Unknown keys raise.
    """
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, t in sd.items():
        if key == "logit_scale":
            continue
        if key == "text_projection":  # x @ P in OpenCLIP; nn.Linear computes x @ W.T
            out["text_projection.weight"] = t.T.contiguous()
        elif key in _OPENCLIP_TOP:
            out[_WRAP + _OPENCLIP_TOP[key]] = t
        elif m := _IN_PROJ_RE.match(key):
            _split_in_proj(m.group(1), m.group(2), t, out)
        elif (m := _RESBLOCK_RE.match(key)) and m.group(2) in _OPENCLIP_LAYER:
            layer, module, leaf = m.groups()
            out[f"{_WRAP}encoder.layers.{layer}.{_OPENCLIP_LAYER[module]}.{leaf}"] = t
        else:
            unknown.append(key)
    if unknown:
        raise UnmappedKeysError("OpenCLIP -> HF CLIP", unknown, [])
    return out


def hf_to_openclip(
    sd: Mapping[str, torch.Tensor], *, logit_scale: torch.Tensor | float | None = None
) -> dict[str, torch.Tensor]:
    """``CLIPTextModelWithProjection`` keys (``text_model.`` optional) -> OpenCLIP text tower keys.

    ``position_ids`` is dropped (OpenCLIP has none). ``logit_scale``, when given, is written back
    as a 0-dim tensor so a re-saved single file keeps the key set of the original.
    """
    top = {hf: oc for oc, hf in _OPENCLIP_TOP.items()}
    layer_map = {hf: oc for oc, hf in _OPENCLIP_LAYER.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, t in sd.items():
        bare = _bare(key)
        m = _HF_LAYER_RE.match(bare)
        if bare == _POSITION_IDS:
            continue
        if bare == "text_projection.weight":
            out["text_projection"] = t.T.contiguous()
        elif bare in top:
            out[top[bare]] = t
        elif m and (qm := re.fullmatch(r"self_attn\.([qkv])_proj", m.group(2))):
            qkv.setdefault((m.group(1), m.group(3)), {})[qm.group(1)] = t
        elif m and m.group(2) in layer_map:
            out[f"transformer.resblocks.{m.group(1)}.{layer_map[m.group(2)]}.{m.group(3)}"] = t
        else:
            unknown.append(key)
    missing = [f"{_WRAP}encoder.layers.{i}.self_attn.{x}_proj.{kind}"
               for (i, kind), parts in qkv.items() for x in "qkv" if x not in parts]
    if unknown or missing:
        raise UnmappedKeysError("HF CLIP -> OpenCLIP", unknown, missing)
    for (layer, kind), parts in qkv.items():
        out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat([parts[x] for x in "qkv"], dim=0)
    if logit_scale is not None:
        out["logit_scale"] = logit_scale if torch.is_tensor(logit_scale) else torch.tensor(float(logit_scale))
    return out
