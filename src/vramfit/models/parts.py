"""What the families build alike: shipped configs, models made on the meta device and given a
file's tensors with every shape checked, the CLIP text encoders and tokenizers, the VAE's
encoding, and parameter counts from headers.

SDXL-family and SD3 models share their CLIP encoders, their tokenizer folders and the way a VAE's
latent distribution is cached; a family folder takes these from here rather than from another
family's folder.
"""
from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from accelerate import init_empty_weights

from vramfit.data.fingerprint import module_fingerprint
from vramfit.formats import clip as clipfmt
from vramfit.formats.safetensors_io import (
    CheckpointError, Lazy, load_prefixed, meta_tensors, read_header, read_tensors,
)
from vramfit.memory.accounting import return_freed_host_memory
from vramfit.memory.encoder_stream import encoder_on
from vramfit.memory.quantize import mark_fp8_source, mark_stored, plain_state, quantize_encoder
from vramfit.memory.vae_tiling import set_vae_tiling
from vramfit.models.adapter import ModelBundle, Source

log = logging.getLogger("vramfit")


def shipped_config(name: str) -> dict:
    """A shipped architecture config (models/configs/<name>.json)."""
    text = resources.files("vramfit.models").joinpath("configs", f"{name}.json").read_text()
    return json.loads(text)


def build_checked(cls, config: dict, state: dict[str, torch.Tensor], what: str, path: Path,
                  file_key: Optional[Callable[[str], str]] = None,
                  fp8_scales: Optional[Mapping[str, torch.Tensor]] = None):
    """Instantiate without allocating random weights, then take the checkpoint's tensors; float8 ones
    (an fp8 save of the model), which no matmul takes, widened to bfloat16 (exact) one at a time.
    Each linear whose weight the file stored in float8_e4m3fn is marked with its scale per row so
    that an fp8 LoRA base keeps the file's codes (`mark_fp8_source`): 1 for such tensors of `state`,
    `fp8_scales` ({state key: scale per row}, not finite where not from fp8) for weights a loader
    widened already (Flux.1's scaled files)."""
    scales = {k: v for k, v in (fp8_scales or {}).items() if bool(v.isfinite().all())}
    scales.update({k: torch.ones(t.shape[0]) for k, t in state.items()
                   if t.dtype == torch.float8_e4m3fn and t.ndim == 2})
    for key in [k for k, t in state.items() if t.dtype in _FP8]:
        state[key] = state[key].to(torch.bfloat16)
    with init_empty_weights():
        model = cls(**config)
    model = assign_state(model, state, what, path, file_key)
    modules = dict(model.named_modules()) if scales else {}
    for key, scale in scales.items():
        linear = modules.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
        if isinstance(linear, torch.nn.Linear):
            mark_fp8_source(linear, scale)
    return model


def check_shapes(model, state: Mapping[str, torch.Tensor], what: str, path: Path,
                 file_key: Optional[Callable[[str], str]] = None) -> None:
    """Refuse, naming the tensor (as the file names it, via `file_key`) and both shapes, a state
    whose tensor shapes differ from those of `model` (built on the meta device from the config the
    file describes), before load_state_dict would fail with a traceback."""
    expected = model.state_dict()
    for key, t in state.items():
        want = expected.get(key)
        if want is not None and tuple(t.shape) != tuple(want.shape):
            name = file_key(key) if file_key else key
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(t.shape)}, but the {what} that the file's other "
                f"tensors describe needs {list(want.shape)}; the file is damaged or mixes two models")


def check_folder_shapes(cls, folder: Path, sub: str) -> None:
    """check_shapes for a diffusers/transformers model folder: its config built on the meta device
    against the shapes in its safetensors headers (no weights read)."""
    where = folder / sub
    try:
        with init_empty_weights():
            if hasattr(cls, "config_class"):  # transformers
                model = cls(cls.config_class.from_pretrained(where))
            else:
                model = cls.from_config(cls.load_config(where))
    except ValueError as exc:  # e.g. channel counts that norm_num_groups does not divide
        raise CheckpointError(f"{where / 'config.json'}: {exc}") from None
    keys = set(model.state_dict())
    for file in _weight_files(where):
        stored = meta_tensors(read_header(file)[0])
        check_shapes(model, {_same_key(k, keys): t for k, t in stored.items()}, sub, file)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files from_pretrained loads (variants such as model.fp16.safetensors aside)."""
    return [f for f in sorted(folder.glob("*.safetensors")) if "." not in f.name[:-len(".safetensors")]]


def _same_key(key: str, keys) -> str:
    """`key` as named among `keys`, with or without the `text_model.` wrapper that CLIP folders
    of older transformers have and the installed CLIPTextModel may not (formats/clip.py)."""
    for candidate in (key, key.removeprefix("text_model."), "text_model." + key):
        if candidate in keys:
            return candidate
    return key


# Key plans of a transformer's single-file layout: {file key: (the state dict keys it is made of, a
# function of their tensors)}, built by each family (models/sd3/mmdit.py, models/flux/bfl.py) from
# these pieces, applied whole (`apply_plan`) or a tensor at a time as it is written (`lazy_state`).

def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(shift, scale) <-> (scale, shift) halves along dim 0; applying it twice is the identity."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def first_part(parts: list[torch.Tensor]) -> torch.Tensor:
    """A renamed tensor: the one part as it is."""
    return parts[0]


def swapped_part(parts: list[torch.Tensor]) -> torch.Tensor:
    return swap_halves(parts[0])


def stacked_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def apply_plan(sd: Mapping[str, torch.Tensor], plan: Mapping[str, tuple[tuple[str, ...], Callable]]
               ) -> dict[str, torch.Tensor]:
    """The file's state dict that `plan` makes of `sd`, all at once."""
    return {name: make([sd[k] for k in keys]) for name, (keys, make) in plan.items()}


def lazy_state(model: torch.nn.Module, plan: Mapping[str, tuple[tuple[str, ...], Callable]],
               dtype: torch.dtype, prefix: str = "") -> dict[str, Lazy]:
    """{prefix + file key: Lazy} of `model`'s weights as a single file names them (`plan`: {file key:
    (the state dict keys it is made of, a function of their tensors)}): each made on the CPU in
    `dtype` only when it is written, from the weight where it lives (a streamed weight's home, or
    the device), so no copy of the whole model is made."""
    sd = model.state_dict()  # references to the weights, no copies

    def maker(keys: tuple[str, ...], make: Callable) -> Callable[[], torch.Tensor]:
        return lambda: make([sd[k].detach().to("cpu", dtype) for k in keys])

    out = {}
    for name, (keys, make) in plan.items():
        shape = make([torch.empty(sd[k].shape, dtype=dtype, device="meta") for k in keys]).shape
        out[prefix + name] = Lazy(dtype, tuple(shape), maker(keys, make))
    return out


def as_stored(model, folder: Path) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each tensor in the dtype its source folder stores it in (loaders
    widen some: diffusers loads fp32, transformers keeps T5's `wo` in fp32), so that carried-over
    weights are written back as the source holds them. Variant files (model.fp16.safetensors) are
    not what from_pretrained loaded and are skipped."""
    state = model.state_dict()
    stored: dict[str, torch.dtype] = {}
    for file in _weight_files(folder):
        stored.update({_same_key(k, state): t.dtype for k, t in meta_tensors(read_header(file)[0]).items()})
    return {k: v.to(stored[k]) if k in stored and v.is_floating_point() else v for k, v in state.items()}


def assign_state(model, state: dict[str, torch.Tensor], what: str, path: Path,
                 file_key: Optional[Callable[[str], str]] = None):
    """Give `model`, made under accelerate's init_empty_weights (parameters on the meta device,
    buffers real), the checkpoint's tensors; a mismatch is a CheckpointError naming the file."""
    check_shapes(model, state, what, path, file_key)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the {what} weights do not match the detected architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, buf in list(model.named_buffers()):
        if buf.device.type == "meta":  # non-persistent buffers (e.g. position_ids) are rebuilt
            raise CheckpointError(f"{path}: {what} buffer {name} was not initialised")
    return model.eval()


def clip_text_model(state: dict, act: str, projection: bool, path: Path):
    """A CLIP text encoder from its transformers-keyed state (`act` its activation; with a
    projection or not), built on the meta device and given the file's tensors in the precision
    the file stores them."""
    # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = clipfmt.clip_config_from_keys(state, hidden_act=act, with_projection=projection)
    vocab = cfg["vocab_size"]
    cfg.update(bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    config = CLIPTextConfig(**cfg)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    with init_empty_weights():
        model = cls(config)
    state = clipfmt.normalize_hf_clip_keys(state, model)
    # Parameters on the meta device (no random initialisation: 10 s for bigG on two cores),
    # then the file's tensors, in the precision the file stores: an fp16 bigG on the GPU is
    # half the size of an fp32 one.
    stored = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    state = {k: v.to(stored) if v.is_floating_point() else v for k, v in state.items()}
    return assign_state(model, state, "text encoder", path)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def t5_config_from_keys(sd: dict[str, torch.Tensor]) -> dict:
    """``T5Config`` kwargs of an encoder read from ``T5EncoderModel`` keys and shapes."""
    def need(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"not a T5 encoder state dict: missing key {key!r}")
        return sd[key]

    emb = need("shared.weight")
    blocks = {int(k.split(".")[2]) for k in sd if k.startswith("encoder.block.")}
    if not blocks or blocks != set(range(len(blocks))):
        raise ValueError(f"T5 encoder block numbering is not contiguous from 0: {sorted(blocks)[:10]}")
    rel = need("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    heads = int(rel.shape[1])
    inner = int(need("encoder.block.0.layer.0.SelfAttention.q.weight").shape[0])
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in sd
    wi = need("encoder.block.0.layer.1.DenseReluDense." + ("wi_0" if gated else "wi") + ".weight")
    return {
        "vocab_size": int(emb.shape[0]), "d_model": int(emb.shape[1]), "d_kv": inner // heads,
        "num_heads": heads, "d_ff": int(wi.shape[0]), "num_layers": len(blocks),
        "relative_attention_num_buckets": int(rel.shape[0]), "relative_attention_max_distance": 128,
        "feed_forward_proj": "gated-gelu" if gated else "relu", "is_encoder_decoder": False,
        "layer_norm_epsilon": 1e-6, "dropout_rate": 0.0, "pad_token_id": 0, "eos_token_id": 1,
        "decoder_start_token_id": 0, "use_cache": False, "tie_word_embeddings": False,
    }


def t5_encoder(state: dict[str, torch.Tensor], path: Path, prefix: str = "", precision: Optional[str] = None):
    """A T5 encoder from its transformers-keyed state (config read from the keys; float8 widened to
    bfloat16, the tied embedding restored), built on the meta device. Without `precision` the
    state's float8 tensors are replaced in place, each freed as it is widened: host memory holds the
    bfloat16 encoder and one float8 tensor at most, not the whole float8 file beside it. With
    `precision` (memory/quantize.py MODES: model.t5_precision) each part of a block is stored so as
    soon as its tensors are in, and they leave the state (`_store_t5`)."""
    def take(keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: state.pop(k) for k in keys}

    return _t5_model(state, take, path, prefix, precision)


def t5_file_encoder(path: Path, prefix: str, precision: Optional[str] = None, own_file: bool = False):
    """A T5 encoder read from a single file's tensors under `prefix` (`own_file`: a file of its own,
    t5xxl_*.safetensors, whose wrapper prefix is found as `encoder_file_prefix` finds it), as
    `t5_encoder`; with `precision` the file is read a part at a time (`_store_t5`), each stored so
    before the next is read: host memory holds the stored encoder and about one part as read and
    widened, never the whole bfloat16 (or float8) encoder. A diffusers folder's T5: `t5_folder_encoder`."""
    header = read_header(path)[0]
    if own_file:
        found = encoder_file_prefix(header, prefix)
        if found is None:
            raise CheckpointError(f"{path}: not a CLIP or T5 text encoder file (no text_model.*, encoder.* "
                                  "or shared.* keys)")
        prefix = found
    if precision is None:
        return t5_encoder(load_prefixed(path, prefix), path, prefix)

    def take(keys: list[str]) -> dict[str, torch.Tensor]:
        wanted = {prefix + k for k in keys}
        return {k[len(prefix):]: t for k, t in read_tensors(path, wanted.__contains__)}

    return _t5_model(meta_tensors(header, prefix), take, path, prefix, precision)


def t5_folder_encoder(folder: Path, precision: Optional[str] = None):
    """The T5 encoder of a transformers folder (a diffusers folder's text_encoder_3/ or
    text_encoder_2/). With `precision` its safetensors files (model.safetensors, or the shards its
    model.safetensors.index.json names) are read a part at a time with its config.json, each part
    stored so before the next is read, as `t5_file_encoder` reads a single file: host memory never
    holds the whole encoder as from_pretrained loads it. Without one (or with no safetensors
    file: from_pretrained reads pytorch_model.bin), from_pretrained's model."""
    # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
    from transformers import T5Config, T5EncoderModel

    folder = Path(folder)
    files = _folder_weight_files(folder)
    if precision is None or not files:
        return T5EncoderModel.from_pretrained(folder).eval()
    try:
        config = T5Config.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / 'config.json'}: not a T5 config ({exc})") from None
    where: dict[str, Path] = {}
    shapes: dict[str, torch.Tensor] = {}
    for file in files:
        for key, t in meta_tensors(read_header(file)[0]).items():
            if key in where:
                raise CheckpointError(f"{folder}: tensor {key} is in both {where[key].name} and {file.name}; "
                                      "the folder mixes two saves: download or copy it again")
            where[key], shapes[key] = file, t

    def take(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for file in files:
            wanted = {k for k in keys if where[k] == file}
            if wanted:
                out.update(read_tensors(file, wanted.__contains__))
        return out

    return _t5_model(shapes, take, folder, "", precision, config)


def _folder_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a transformers model folder as from_pretrained picks them:
    model.safetensors, else the shards model.safetensors.index.json names (each must be there)."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if not index.is_file():
        return _weight_files(folder)
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if not all(isinstance(name, str) for name in names):
            raise ValueError("its weight_map's values are not file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a weight index ({type(exc).__name__}: {exc}); download or copy "
                              "the folder again") from None
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{index}: names {missing[0]}, which is not in {folder}; download or copy "
                              "the folder again")
    return [folder / name for name in names]


def _t5_model(shapes: Mapping[str, torch.Tensor], take: Callable[[list[str]], dict[str, torch.Tensor]],
              path: Path, prefix: str, precision: Optional[str], config=None):
    """T5EncoderModel of the tensors `shapes` names (real or meta), read with `take`; see t5_encoder.
    `config`: a T5Config (a folder's config.json), else read from the keys."""
    # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
    from transformers import T5Config, T5EncoderModel

    if config is None:
        try:
            config = T5Config(**t5_config_from_keys(shapes))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    with init_empty_weights():
        model = T5EncoderModel(config)
    check_shapes(model, shapes, "T5 encoder", path, lambda k: prefix + k)
    expected = set(model.state_dict())
    missing = [k for k in expected if k not in shapes and k != "encoder.embed_tokens.weight"]
    unexpected = [k for k in shapes if k not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{path}: T5 encoder weights do not match "
                              f"(missing {sorted(missing)[:5]}, unexpected {unexpected[:5]})")
    if precision is None:
        state = take(list(shapes))
        # Stability ships T5-XXL in float8, which no matmul takes: widen it to bfloat16.
        for key in list(state):
            if state[key].dtype in _FP8:
                state[key] = state[key].to(torch.bfloat16)
        model.load_state_dict(state, strict=False, assign=True)
    else:
        _store_t5(model, list(shapes), take, precision)
    model.tie_weights()  # encoder.embed_tokens shares shared.weight; some files store it once
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            raise CheckpointError(f"{path}: T5 encoder tensor {name} was not initialised")
    return model.eval()


def _store_t5(model, keys: list[str], take: Callable[[list[str]], dict[str, torch.Tensor]],
              precision: str) -> None:
    """Give the meta-built `model` its tensors a part at a time (each block's attention, then its
    feed-forward), each part widened to bfloat16 and stored in `precision` (quantize_encoder) before
    the next is taken: the same weights as quantize_encoder over the whole bfloat16 encoder, without
    ever holding it whole."""
    parts: dict[tuple[int, int], list[str]] = {}
    for key in keys:
        if key.startswith("encoder.block."):
            where = key.split(".")
            parts.setdefault((int(where[2]), int(where[4])), []).append(key)
    # embedding, final norm; the tied embedding's second copy (Stability's files carry both) is
    # never used: tie_weights gives encoder.embed_tokens shared.weight
    rest = [k for k in keys if not k.startswith("encoder.block.")
            and not (k == "encoder.embed_tokens.weight" and "shared.weight" in keys)]
    model.load_state_dict(_bf16(take(rest)), strict=False, assign=True)
    for (i, j), names in sorted(parts.items()):
        part = model.encoder.block[i].layer[j]
        head = f"encoder.block.{i}.layer.{j}."
        part.load_state_dict({k[len(head):]: t for k, t in _bf16(take(names)).items()}, strict=False,
                             assign=True)
        quantize_encoder(part, precision)
        # the part's bf16 tensors and the quantizer's temporaries, freed now, would otherwise stay
        # resident between the stored tensors beside them: about twice the stored encoder
        # (tests/test_t5_load.py bounds it)
        return_freed_host_memory()
    model.requires_grad_(False)
    mark_stored(model, precision)


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with its floating-point tensors in bfloat16, each source tensor freed as it goes."""
    for key in list(state):
        if state[key].is_floating_point():
            state[key] = state[key].to(torch.bfloat16)
    return state


class _State:
    """A state dict where module_fingerprint takes a module."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


def encoder_fingerprint(module: torch.nn.Module) -> str:
    """module_fingerprint of a text encoder for cache keys; a T5 stored quantized as it loaded is
    digested over the plain tensors its quantized weights are made of (memory/quantize.py
    `plain_state`)."""
    return module_fingerprint(_State(plain_state(module)))


def t5_hidden_states(bundle: ModelBundle, index: int, captions: list[str], device: torch.device, n_t5: int,
                     **tokenize) -> torch.Tensor:
    """The last hidden states (fp32, on the CPU) of the T5 at `index` of the bundle's encoders for
    `captions`, `n_t5` tokens each; on `device` only while it encodes (streamed layer by layer with
    memory.stream_encoders, bundle.extra). `tokenize`: the family's further tokenizer arguments."""
    t5, tokenizer = bundle.text_encoders[index], bundle.tokenizers[index]
    ids = tokenizer(captions, padding="max_length", max_length=n_t5, truncation=True, return_tensors="pt",
                    **tokenize).input_ids
    with encoder_on(t5, device, bundle.extra.get("stream_encoders", False)), torch.no_grad():
        return t5(ids.to(device))[0].float().cpu()


def t5_identity(name: str, bundle: ModelBundle, t5: torch.nn.Module, max_len: int) -> str:
    """The cache identity of a T5's outputs alone (Family.encoder_identity's "frozen text"): its
    weights, how they are stored, the tokens a caption keeps and the width the denoiser joins."""
    precision = bundle.extra.get("t5_precision", "bf16")
    return f"{name}-t5:{encoder_fingerprint(t5)}:{precision}:{max_len}:{bundle.denoiser.config.joint_attention_dim}"


def load_clip_tokenizers(folder: Path) -> list[Any]:
    """The two CLIP tokenizers of `folder` (tokenizer/, tokenizer_2/); the second pads with "!"
    (id 0) rather than end-of-text, as SDXL's and SD3's CLIP-G do."""
    # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
    from transformers import CLIPTokenizer

    return [CLIPTokenizer.from_pretrained(folder / "tokenizer"),
            CLIPTokenizer.from_pretrained(folder / "tokenizer_2", pad_token="!")]


def require_tokenizers(source: Source) -> Path:
    """The folder of `source`'s tokenizers; a CheckpointError saying what to provide where there is none."""
    if source.tokenizers is None:
        raise CheckpointError(
            f"{source.path}: this single file has no tokenizers and none were found beside it or in "
            "the local Hugging Face cache. Set model.tokenizers to a folder containing tokenizer/ "
            "and tokenizer_2/ (and tokenizer_3/ for SD3 with T5), e.g. a downloaded "
            "stabilityai/stable-diffusion-xl-base-1.0 or stabilityai/stable-diffusion-3-medium-diffusers, "
            "or put those folders next to the checkpoint."
        )
    for sub in ("tokenizer", "tokenizer_2"):
        if not (source.tokenizers / sub).is_dir():
            raise CheckpointError(f"model.tokenizers: {source.tokenizers} has no {sub}/ folder")
    return source.tokenizers


@torch.no_grad()
def encode_vae_images(bundle: ModelBundle, pixels: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, tiling: bool) -> dict[str, torch.Tensor]:
    """The VAE's latent distribution (mean, log-variance); sampling happens at train time."""
    vae = bundle.vae
    set_vae_tiling(vae, tiling)
    vae_dtype = next(vae.parameters()).dtype
    dist = vae.encode(pixels.to(device, vae_dtype)).latent_dist
    return {"mean": dist.mean.float().cpu().to(dtype), "logvar": dist.logvar.float().cpu().to(dtype)}


def count_params(header: dict, prefix: str) -> dict:
    """Parameters and their count per stored dtype of the header entries under `prefix`."""
    params, dtypes = 0, {}
    for key, info in header.items():
        if key.startswith(prefix):
            n = 1
            for s in info["shape"]:
                n *= s
            params += n
            dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + n
    return {"params": params, "dtypes": dtypes}


def merge_counts(counts: list[dict]) -> dict:
    """The sum of several `count_params` results (a component stored in several files)."""
    out = {"params": 0, "dtypes": {}}
    for c in counts:
        out["params"] += c["params"]
        for k, v in c["dtypes"].items():
            out["dtypes"][k] = out["dtypes"].get(k, 0) + v
    return out


def encoder_file_prefix(header: Mapping, prefix: str) -> Optional[str]:
    """The wrapper prefix of a text encoder stored on its own (ComfyUI's clip_l / clip_g / t5xxl files:
    HF keys), from its header: the single file's own `prefix`, `transformer.` or none; None when the
    keys are no text encoder's."""
    for candidate in (prefix, "transformer.", ""):
        if any(k.startswith(candidate) and k[len(candidate):].split(".")[0] in ENCODER_ROOTS for k in header):
            return candidate
    return None


def encoder_file_state(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """A text encoder stored on its own, its wrapper prefix (`encoder_file_prefix`) removed."""
    found = encoder_file_prefix(read_header(path)[0], prefix)
    if found is None:
        raise CheckpointError(f"{path}: not a CLIP or T5 text encoder file (no text_model.*, encoder.* or "
                              "shared.* keys)")
    return load_prefixed(path, found)


ENCODER_ROOTS = {"text_model", "text_projection", "encoder", "shared", "embeddings", "final_layer_norm"}


def trained_encoder_states(bundle: ModelBundle,
                           dtype: torch.dtype) -> list[Optional[dict[str, torch.Tensor]]]:
    """Per text encoder of `bundle`, in order: its transformers state dict on the CPU (floats in
    `dtype`) where it trained whole (train.text_encoders = "full": bundle.extra says how many of the
    leading ones and how), else None (a saved file carries the source's over)."""
    trained = int(bundle.extra.get("text_encoders_trained") or 0)
    if bundle.extra.get("text_encoder_training") != "full":
        trained = 0
    return [{k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype)
             for k, v in enc.state_dict().items()} if i < trained else None
            for i, enc in enumerate(bundle.text_encoders)]


def folder_encoders(family, bundle: ModelBundle, dtype: torch.dtype) -> tuple[Any, list, list]:
    """(VAE, text encoders, the trained state of each or None) a diffusers-folder save writes: the
    bundle's own where it still holds them with T5 as loaded, else the source's read again
    (`family.load_encoders`: encoders dropped for training, T5 let go of once its outputs were cached,
    a T5 stored quantized or left out), the trained ones' states (`trained_encoder_states`) taken
    from the bundle in either case."""
    t5_as_loaded = not family.has_t5 or bundle.extra.get("t5_precision", "bf16") == "bf16"
    own = bundle.vae is not None and t5_as_loaded and not bundle.extra.get("frozen_encoders_cached")
    vae, encoders = (bundle.vae, bundle.text_encoders) if own else family.load_encoders(bundle.source)
    trained = trained_encoder_states(bundle, dtype) if bundle.vae is not None else []
    trained += [None] * (len(encoders) - len(trained))  # a T5 left out of the bundle: the source's
    return vae, list(encoders), trained


def save_encoder_folder(encoder, folder: Path, state: Optional[dict[str, torch.Tensor]]) -> None:
    """A transformers text encoder's subfolder of a diffusers folder: `state` (trained_encoder_states)
    where it trained, else the encoder as it is."""
    if state is None:
        encoder.save_pretrained(folder)
    else:
        encoder.save_pretrained(folder, state_dict=state)


def warn_named_over_own(source: Source, prefixes: Mapping[str, str]) -> None:
    """A single file that holds a text encoder of its own ({part: key prefix}; vramfit writes the
    trained ones there under train.text_encoders = "full"), loaded with model.<part> naming another
    file: that file is used, as asked; say that the file's own encoder is not."""
    if source.kind != "single_file":
        return
    header, _ = read_header(source.path)
    for part, prefix in prefixes.items():
        named = source.encoder_file(part)
        if named and any(k.startswith(prefix) for k in header):
            log.warning("model.%s: %s is used, not the %s that %s holds itself (%s*; a run with "
                        "train.text_encoders = \"full\" writes the trained one there); leave model.%s out to "
                        "use that one", part, named, part, source.path.name, prefix, part)
