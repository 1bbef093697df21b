"""The typed run configuration: every key a user can set, its type, default and meaning.

Defaults live here and nowhere else. Unknown keys are rejected (extra="forbid") so a typo
never silently falls back to a default, and no number may be inf or nan; `load.py` turns
pydantic's errors into one message that lists every problem with its key path and a "did you
mean". Checks across several keys raise KeyProblems, which names the key each problem concerns.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vramfit.config.rules import config_problems

# The devices vramfit runs on (train.device, generate --device), and how messages list them.
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N (N: a GPU index, e.g. cuda:1)"
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text) -> int:
    """Bytes of a size such as "8GiB", "7.5GB", "512 MiB" or "8000000000" (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 8GiB, 7.5GB, 6144MiB or a number of bytes "
                         f"(units: {', '.join(u for u in _SIZE_UNITS if u)}, case-insensitive)")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return size


# Seeds reach torch.Generator.manual_seed through sums and products (train/loop.py: seed times a
# million plus the epoch; prior and sample seeds plus an index), which must stay within 64 bits.
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
# SD3's "mode" timestep density maps [0, 1] onto itself monotonically only for scales in this range.
MODE_SCALE_MAX = 2 / (math.pi - 2)


# Where skip-layer guidance is asked for: the settings that turn it on or off, give its blocks and its scale
SAMPLE_SKIP_KEYS = ("sample.skip_layer_guidance", "sample.skip_layer_guidance_layers",
                    "sample.skip_layer_guidance_scale")


@dataclass(frozen=True)
class SkipLayerGuidance:
    """Skip-layer guidance as a config or command line asks for it: `on` None (the model's default),
    False (off) or True; `layers` and `scale` None: the model's. `keys` name the three settings (on,
    layers, scale) in messages."""

    on: Optional[bool] = None
    layers: Optional[tuple[int, ...]] = None
    scale: Optional[float] = None
    keys: tuple[str, str, str] = SAMPLE_SKIP_KEYS

    @property
    def given(self) -> bool:
        """Whether anything is asked beyond the model's default."""
        return self.on is not None or self.layers is not None or self.scale is not None

    @property
    def text(self) -> str:
        """The choice as an image's metadata records it: "off", or the blocks and scale given ("on":
        the model's own)."""
        if self.on is False:
            return "off"
        parts = [f"blocks {','.join(map(str, self.layers))}" if self.layers else "",
                 f"scale {self.scale:g}" if self.scale is not None else ""]
        return ", ".join(p for p in parts if p) or "on"

    @property
    def key(self) -> str:
        """The setting a message about the whole choice names: the first one given."""
        given = [k for k, v in zip(self.keys, (self.on, self.layers, self.scale)) if v is not None]
        return given[0] if given else self.keys[0]


def skip_layer_problems(asked: SkipLayerGuidance, guidance: Optional[float],
                        guidance_key: str) -> list[tuple[str, str]]:
    """What is wrong with skip-layer guidance `asked` beside `guidance` (None: the family's, above 1),
    whatever the model: as (key, problem). The model's blocks are checked where it is known."""
    on_key, layers_key, scale_key = asked.keys
    problems = []
    if asked.on is False:
        problems += [(key, f"given while {on_key} is off; leave it out, or turn skip-layer guidance on")
                     for key, value in ((layers_key, asked.layers), (scale_key, asked.scale))
                     if value is not None and key != on_key]
    elif asked.given and guidance is not None and guidance <= 1:
        given = f"{guidance_key}{' ' if guidance_key.startswith('-') else ' = '}{guidance:g}"
        problems.append((asked.key, f"skip-layer guidance applies with classifier-free guidance, which "
                         f"{given} turns off; set {guidance_key} above 1"))
    if asked.layers is not None and len(set(asked.layers)) != len(asked.layers):
        problems.append((layers_key, f"{list(asked.layers)} names a block twice; give each once"))
    return problems


class KeyProblems(ValueError):
    """Problems found by a check across several keys, each as (key, what is wrong). Keys are
    relative to the section whose validator raises it (absolute in RunConfig's)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{key}: {text}" for key, text in problems))


def _raise_any(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise KeyProblems(problems)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class ModelConfig(_Section):
    path: str = Field(
        "tiny:ssd1b",
        description="A single-file .safetensors, a diffusers folder, a Hugging Face repo id, or a "
        "tiny model vramfit builds for tests and the demo (tiny:<name>; the error for an unknown "
        "one lists them).",
    )
    family: Literal["auto", "sdxl", "sd3", "flux"] = Field(
        "auto", description="Model family; auto reads it from the checkpoint."
    )
    tokenizers: Optional[str] = Field(
        None,
        description="Folder holding tokenizer/ and tokenizer_2/ (a diffusers SDXL folder "
        "works). Needed when a single file is used and no tokenizer is found beside it.",
    )
    revision: Optional[str] = Field(None, description="Revision of a Hugging Face repo id.")
    vae: Optional[str] = Field(None, description="Flux.1 transformer-only file (flux1-dev.safetensors): "
                               "the VAE as a file of its own (BFL's ae.safetensors).")
    clip_l: Optional[str] = Field(
        None, description="SD3 single file: CLIP-L text encoder as a file of its own (e.g. ComfyUI's "
        "clip_l.safetensors), for files without it (sd3_medium.safetensors) or to replace it.")
    clip_g: Optional[str] = Field(None, description="SD3 single file: CLIP-G text encoder file (clip_g.safetensors).")
    t5: Optional[str] = Field(None, description="SD3 single file: T5-XXL encoder file, fp16 or fp8 "
                              "(t5xxl_fp16.safetensors, t5xxl_fp8_e4m3fn.safetensors).")
    t5_precision: Literal["bf16", "int8", "fp8", "nf4", "none"] = Field(
        "bf16", description="SD3: how T5-XXL is stored while captions are encoded (int8 and fp8 "
        "halve it, nf4 quarters it; torchao, CPU or CUDA); none leaves T5 out (zeros), as SD3 allows.")
    max_sequence_length: Optional[int] = Field(
        None, ge=1, le=512, description="SD3 and Flux.1: T5 tokens per caption, up to 512. Default: "
        "the model's own: SD3 77 (as its DreamBooth script), Flux.1 dev 512 and schnell 256 (as "
        "their pipelines).")
    allow_pickle: bool = Field(
        False, description="Load a pickle .ckpt (with torch.load(weights_only=True)); pickle files "
        "can run code when loaded by other tools, so they are refused unless this is set.")


class _DatasetKeys(_Section):
    """Keys every dataset has; set in [data] they are the default of every [[data.datasets]] entry."""

    caption_extension: str = Field(".txt", description="Suffix of the caption file beside each image "
                                   "(the leading dot is optional).")
    default_caption: Optional[str] = Field(
        None, min_length=1, description="Caption of the images that have no caption file (kohya's class "
        "tokens); without it such images are skipped and named.")
    resolution: int = Field(1024, ge=64, le=4096, description="Base bucket side in pixels.")
    bucket_step: int = Field(64, ge=8, le=512, description="Bucket sides are multiples of this many "
                             "pixels (of 8, and of 16 for SD3; it divides data.resolution). A smaller step "
                             "makes more buckets, closer to each image's aspect ratio, so less is cropped.")
    max_aspect: float = Field(4.0, ge=1.0, le=8.0, description="Largest aspect ratio (long side over short) "
                              "of a bucket; a more elongated image goes to the most elongated bucket and is "
                              "cropped to it.")
    min_size: int = Field(256, ge=1, le=65536, description="Images with a shorter side are skipped.")
    max_pixels: int = Field(178_956_970, ge=1, le=2**40, description="Larger images are skipped unopened "
                            "(decompression-bomb guard; PIL's own default limit).")
    random_crop: bool = Field(False, description="Crop each image to its bucket at a random offset "
                              "instead of the centre: one offset per image, fixed by train.seed, so its "
                              "cached latent is reused (SDXL's crop conditioning records the offset).")
    caption_dropout: float = Field(0.0, ge=0, lt=1, description="Share of the draws that train on the empty "
                                   "caption instead of the image's (its encoding is cached once).")
    shuffle_tags: bool = Field(False, description="Shuffle the caption's comma-separated tags (after the "
                               "first keep_tokens); the shuffles are cached as caption_variants.")
    keep_tokens: int = Field(0, ge=0, le=1000, description="With shuffle_tags: the leading tags that stay "
                             "in place (e.g. the trigger word).")
    tag_separator: str = Field(",", min_length=1, description="What separates the tags of a caption for "
                               "shuffle_tags and keep_tokens.")
    caption_per_line: bool = Field(False, description="A caption file (or a metadata caption list) holds "
                                   "several captions, one per line; each epoch trains one of them. False: "
                                   "the lines are joined into one caption.")
    caption_variants: int = Field(4, ge=1, le=64, description="Most cached text encodings per image (its "
                                  "captions and their tag shuffles); each draw picks one. The text cache "
                                  "grows with it: one entry per distinct variant.")
    flip: bool = Field(False, description="Train each draw of an image mirrored left-right at random (one "
                       "in two); the mirrored latent is cached beside it, with SDXL's crop conditioning "
                       "measured on the mirrored image.")
    masks: Optional[str] = Field(None, description="Folder of mask images named as the images (any image "
                                 "suffix; white: trained, black: masked out), for masked loss.")
    alpha_mask: bool = Field(False, description="Masked loss with the image's alpha channel as the mask "
                             "(opaque: trained); images without alpha train unmasked.")
    mask_min_weight: float = Field(0.0, ge=0, le=1, description="Loss weight of the masked-out area (with "
                                   "masks or alpha_mask): 0 ignores it, 1 trains it fully.")
    validation_share: float = Field(0.0, ge=0, lt=1, description="Share of the images held out of "
                                    "training as the validation set (picked by a hash of the file name, "
                                    "the same every run).")

    @field_validator("caption_extension")
    @classmethod
    def _a_suffix(cls, value: str) -> str:
        bare = value[1:] if value.startswith(".") else value
        if not bare or bare.strip(".") == "":
            raise ValueError(f"{value!r} is no file suffix; write e.g. .txt or .caption")
        if any(c in bare for c in "/\\") or not bare.isprintable():
            raise ValueError(f"{value!r} holds a path separator or a control character; write a suffix "
                             "such as .txt")
        return value

    def _key_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.bucket_step % 8:
            problems.append(("bucket_step", f"{self.bucket_step} is not a multiple of 8 (the VAE "
                             "downsamples by 8)"))
        elif self.resolution % self.bucket_step:
            problems.append(("resolution", f"{self.resolution} is not a multiple of bucket_step "
                             f"({self.bucket_step})"))
        if self.masks is not None and self.alpha_mask:
            problems.append(("alpha_mask", "given beside masks; use one source of masks"))
        return problems


DATASET_DEFAULTS = tuple(_DatasetKeys.model_fields)  # the keys a dataset takes from [data] when not set


class DatasetConfig(_DatasetKeys):
    """One dataset of a run ([[data.datasets]]): its images, how often an epoch trains them, its rules."""

    name: Optional[str] = Field(None, min_length=1, description="Name in messages and `vramfit data`; "
                                "default: the folder's name.")
    path: str = Field(description="Folder of the dataset's images.")
    metadata: Optional[str] = Field(None, description="kohya metadata .json or Hugging Face metadata.jsonl "
                                    "of this dataset (as data.metadata).")
    instance_prompt: Optional[str] = Field(None, min_length=1, description="Caption of every image of "
                                           "this dataset (caption files are then not needed).")
    class_prompt: Optional[str] = Field(None, min_length=1, description="A regularization dataset: caption "
                                        "of every class image (as instance_prompt).")
    repeats: Optional[int] = Field(None, ge=1, le=10**6, description="Times an epoch trains each image "
                                   "(kohya's num_repeats); default 1.")
    weight: Optional[float] = Field(None, ge=0.01, le=10**6, description="Instead of repeats: images an epoch "
                                    "trains, as a multiple of the dataset's size (0.5: half of them, a "
                                    "different half each epoch; exact over the epochs).")
    regularization: bool = Field(False, description="Class images of prior preservation: each batch of "
                                 "the other datasets' images carries as many of these of its bucket, "
                                 "weighted by prior.loss_weight.")
    validation: bool = Field(False, description="Held out: not trained, its loss is the validation loss "
                             "([validation]).")

    @model_validator(mode="after")
    def _consistent(self) -> "DatasetConfig":
        problems = self._key_problems()
        if self.repeats is not None and self.weight is not None:
            problems.append(("weight", "given beside repeats; use one of them"))
        if self.instance_prompt is not None and self.metadata is not None:
            problems.append(("instance_prompt", "metadata gives captions too; use one of them"))
        if self.class_prompt is not None and not self.regularization:
            problems.append(("class_prompt", "only for a regularization dataset (regularization = true); "
                             "use instance_prompt"))
        if self.regularization and self.instance_prompt is not None:
            problems.append(("instance_prompt", "a regularization dataset's caption is class_prompt"))
        if self.regularization and self.validation:
            problems.append(("validation", "a dataset is either regularization or validation"))
        if self.validation and self.validation_share:
            problems.append(("validation_share", "the whole dataset is held out already (validation = true)"))
        _raise_any(problems)
        return self

    @property
    def label(self) -> str:
        return self.name or Path(self.path).name or self.path

    @property
    def times(self) -> float:
        """Images an epoch trains per image of the dataset (repeats, or weight)."""
        return float(self.weight) if self.weight is not None else float(self.repeats or 1)


class DataConfig(_DatasetKeys):
    path: Optional[str] = Field(None, description="Folder of training images (the short form of one "
                                "dataset; with data.datasets leave it out).")
    metadata: Optional[str] = Field(
        None,
        description="kohya metadata .json or Hugging Face metadata.jsonl; default: "
        "<path>/metadata.jsonl when present, else same-name caption files.",
    )
    instance_prompt: Optional[str] = Field(
        None, min_length=1, description="DreamBooth: use this prompt for every image (caption "
        "files are then not needed), e.g. \"a photo of sks dog\".")
    datasets: list[DatasetConfig] = Field(
        default_factory=list, description="Several datasets ([[data.datasets]] tables), each with its "
        "path, repeats and rules; the other [data] keys are their defaults. docs/data.md.")
    kohya: Optional[str] = Field(None, description="A kohya dataset config (.toml) or a kohya train_data_dir "
                                 "(subfolders named like 10_sks dog: 10 repeats, caption 'sks dog' for "
                                 "images without one), read as data.datasets.")
    kohya_reg: Optional[str] = Field(None, description="A kohya reg_data_dir: its N_class subfolders become "
                                     "regularization datasets.")
    shuffle: bool = Field(True, description="Train the images of each bucket, and the batches, in a new "
                          "order every epoch, seeded by train.seed; false: bucket by bucket in the order "
                          "they were read.")

    @model_validator(mode="after")
    def _consistent(self) -> "DataConfig":
        problems = self._key_problems()
        if self.instance_prompt is not None and self.metadata is not None:
            problems.append(("instance_prompt", "data.metadata gives captions too; use one of them"))
        several = [k for k in ("datasets", "kohya") if getattr(self, k)]
        if len(several) > 1:
            problems.append(("kohya", "given beside data.datasets; use one of them"))
        if several:
            problems += [(k, f"given beside data.{several[0]}; give each dataset its own {k}")
                         for k in ("path", "metadata", "instance_prompt") if getattr(self, k) is not None]
        if self.kohya_reg is not None and not self.kohya:
            problems.append(("kohya_reg", "a kohya reg_data_dir goes with data.kohya (the train_data_dir)"))
        names = [d.label for d in self.datasets]
        for name in sorted({n for n in names if names.count(n) > 1}):
            problems.append(("datasets", f"two datasets are named {name!r}; give each a distinct name"))
        _raise_any(problems)
        return self

    def dataset_list(self) -> list[DatasetConfig]:
        """The datasets with every key they leave out taken from [data] (the short form: one, from
        data.path). A kohya config is read by the data layer (data/kohya.py), not here."""
        base = {k: getattr(self, k) for k in DATASET_DEFAULTS}
        if not self.datasets:
            if self.path is None:
                return []
            return [DatasetConfig(**base, path=self.path, metadata=self.metadata,
                                  instance_prompt=self.instance_prompt)]
        return [inherit(d, base) for d in self.datasets]


def inherit(dataset: DatasetConfig, base: dict) -> DatasetConfig:
    """`dataset` with the [data] defaults `base` for the keys it does not set itself."""
    own = {k: getattr(dataset, k) for k in dataset.model_fields_set}
    return DatasetConfig(**{**base, **own, "path": dataset.path})


class CacheConfig(_Section):
    dir: Optional[str] = Field(
        None, description="Cache folder; default ~/.cache/vramfit (content-addressed, shareable)."
    )
    latents: bool = Field(True, description="Encode images once and train from disk.")
    text: bool = Field(True, description="Encode captions once and train from disk.")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Stored precision.")
    vae_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="VAE precision while encoding (SDXL's VAE overflows in fp16)."
    )
    vae_tiling: bool = Field(False, description="Encode images in tiles of half the VAE's sample size (512 px for "
                             "SDXL and SD3): bounded memory, slower, slight seams.")


class LoraSettings(_Section):
    type: Literal["lora", "dora", "lokr", "loha"] = Field(
        "lora", description="Adapter type (peft): lora; dora (LoRA plus a trained magnitude per output "
        "row); lokr (Kronecker product of two small factors); loha (Hadamard product of two LoRAs). "
        "Every type exports in kohya/LyCORIS keys for SDXL-family models; diffusers loads lora and dora.")
    rank: int = Field(4, ge=1, le=1024, description="Rank r of each adapted layer's update (two matrices "
                      "of r rows or columns): a higher rank can learn more and costs memory and file size in "
                      "proportion.")
    alpha: Optional[float] = Field(None, gt=0, le=65536, description="Scale numerator; default: the rank "
                                   "(scale 1).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on each LoRA branch's "
                           "input while training (peft's lora_dropout); 0 turns it off. Not with "
                           "train.cuda_graphs, which \"auto\" then leaves off.")
    targets: list[str] = Field(
        ["to_q", "to_k", "to_v", "to_out.0"],
        description='Module name suffixes to adapt, or ["all_linear"] for every linear layer of '
        "the attention/transformer blocks.",
        min_length=1,
    )
    conv_rank: Optional[int] = Field(
        None, ge=1, le=1024, description="Also adapt the convolutions of the UNet's ResNet blocks and "
        "down/upsamplers at this rank (kohya's conv_dim), with every lora.type. SDXL family only. Default: "
        "convolutions untouched.")
    conv_alpha: Optional[float] = Field(None, gt=0, le=65536, description="Scale numerator of the "
                                        "convolutions' adapters (kohya's conv_alpha); default: conv_rank.")
    lokr_factor: int = Field(-1, ge=-1, le=65536, description="LoKr only: the size each dimension's first "
                             "factor is brought near (peft's decompose_factor); -1: near its square root.")
    text_encoder_rank: int = Field(
        0, ge=0, le=1024, description="Also train a LoRA of this rank on the CLIP text encoders' attention "
        "and MLP linears (q_proj, k_proj, v_proj, out_proj, fc1, fc2): CLIP-L and CLIP-G of the SDXL family "
        "and SD3, CLIP-L of Flux.1. 0: the text encoders stay frozen. The CLIPs then encode every caption "
        "each step (cache.text is turned off; a frozen T5's outputs are still cached); train.text_encoder_lr "
        "sets their learning rate.")
    text_encoder_alpha: Optional[float] = Field(None, gt=0, le=65536, description="Scale numerator of the "
                                                "text encoders' LoRA; default: lora.text_encoder_rank.")
    base_quantization: Literal["none", "int8", "fp8", "nf4"] = Field(
        "none", description="How the frozen base's linear weights are stored while the LoRA trains "
        "(convs, norms and embeddings stay in the training precision): none; int8 (per-channel, "
        "about half of bf16); fp8 (e4m3 with per-channel scales, about half; a float8 e4m3 file's own values and scales are kept); nf4 (4-bit "
        "NormalFloat in blocks of 64, about a quarter). Each costs a small error in the base's "
        "outputs and one widening of each weight in forward and in backward. train.mode = 'lora' only.")


class TrainConfig(_Section):
    mode: Literal["full", "lora"] = Field("full", description="Train all denoiser weights, or a LoRA.")
    steps: int = Field(1000, ge=1, le=10**9, description="Optimizer steps (or give train.epochs).")
    epochs: Optional[int] = Field(None, ge=1, le=10**6, description="Train this many epochs (passes over "
                                  "the datasets with their repeats) instead of train.steps, which is then "
                                  "derived from the data and shown at the start.")
    batch_size: int = Field(1, ge=1, le=4096, description="Images per micro-batch, all of one bucket (a "
                            "bucket's last batch of an epoch may be smaller); with prior preservation each "
                            "batch carries as many class images besides.")
    grad_accum: int = Field(1, ge=1, le=10**6, description="Micro-batches per optimizer step.")
    lr: float = Field(1e-5, gt=0, le=1.0, description="Learning rate: its value after train.warmup_steps, "
                      "which train.lr_scheduler keeps or lowers from there.")
    text_encoder_lr: Optional[float] = Field(None, ge=0, le=1.0, description="Learning rate of the trained "
                                             "text encoders (lora.text_encoder_rank's LoRA, or "
                                             "train.text_encoders = 'full'), scaled by train.lr_scheduler as "
                                             "train.lr is; 0 keeps them as they are. Default: train.lr.")
    text_encoders: Literal["frozen", "full"] = Field(
        "frozen", description="full: a full fine-tune (train.mode = 'full') also trains every weight of the "
        "CLIP text encoders (SDXL family and SD3: CLIP-L and CLIP-G; Flux.1: CLIP-L; T5 stays frozen), in "
        "the training precision, at train.text_encoder_lr; the CLIPs then encode every caption each step "
        "(cache.text is turned off; a frozen T5's outputs are still cached) and the saved files carry the "
        "trained encoders. A LoRA run trains "
        "them with lora.text_encoder_rank instead.")
    optimizer: Literal["adafactor", "adamw", "adamw8bit", "lion", "prodigy", "schedulefree_adamw", "came",
                       "custom"] = Field(
        "adafactor", description="adamw8bit: torchao's AdamW with 8-bit block-quantized moments "
        "(a quarter of AdamW's state; the write-up's --use_8bit_adam). lion: Lion (sign updates, one "
        "moment; a learning rate 3-10x below AdamW's; train.betas default to (0.9, 0.99) for it). "
        "prodigy, schedulefree_adamw, came: pytorch-optimizer's Prodigy (estimates the step size: "
        "set train.lr = 1.0), ScheduleFreeAdamW (samples, validates and saves its averaged weights; "
        "use lr_scheduler constant) and CAME. custom: the class train.optimizer_class names. "
        "docs/training.md, Optimizers and schedules.")
    optimizer_class: Optional[str] = Field(
        None, pattern=r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$",
        description="train.optimizer = 'custom': the dotted path of a torch.optim-style class "
        "(package.module.Class), built as Class(params, lr=train.lr, **train.optimizer_args) plus "
        "train.betas, eps and weight_decay where the config sets them.")
    optimizer_args: dict[str, Any] = Field(
        default_factory=dict, description="Further arguments of the optimizer's class, by name (prodigy, "
        "schedulefree_adamw, came and custom), e.g. {d_coef = 0.5} for Prodigy.")
    weight_decay: float = Field(0.0, ge=0, le=10.0, description="Decoupled weight decay: every step "
                                "multiplies each trained weight by 1 - lr * weight_decay (every optimizer); "
                                "0 turns it off.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW's decay rates of the first and second moments, each in [0, 1); also "
        "Lion's, Prodigy's, schedule-free AdamW's and CAME's first two (and a custom class's where set).")
    eps: float = Field(1e-8, gt=0, le=1.0, description="AdamW's term added to the second moment's square "
                       "root in the update's denominator (adamw, adamw8bit, prodigy, schedulefree_adamw, "
                       "and a custom class where set; Adafactor, Lion and CAME have no use for it).")
    lr_scheduler: Literal["constant", "cosine", "linear", "cosine_with_restarts", "polynomial"] = Field(
        "constant", description="constant: the learning rate rises linearly over train.warmup_steps, then "
        "stays at train.lr; cosine: after the same warm-up it falls along a half cosine to 0 at train.steps; "
        "linear: falls in a straight line to 0; cosine_with_restarts: train.lr_cycles half cosines, each "
        "from train.lr to 0; polynomial: falls as (1 - progress) ** train.lr_power to 0.")
    lr_cycles: int = Field(1, ge=1, le=10**6, description="lr_scheduler cosine_with_restarts: how many times "
                           "the learning rate falls to 0 and starts again from train.lr.")
    lr_power: float = Field(1.0, gt=0, le=100.0, description="lr_scheduler polynomial: the power of its fall "
                            "(1: linear; 2: faster at first).")
    warmup_steps: int = Field(0, ge=0, le=10**9, description="Optimizer steps over which the learning rate "
                              "rises linearly from 0 to train.lr; fewer than train.steps.")
    precision: Literal["full_bf16", "mixed_bf16", "fp32"] = Field(
        "full_bf16",
        description="full_bf16: weights and grads in bf16 (the optimizer computes each update in "
        "fp32 and writes it back as train.stochastic_rounding says); mixed_bf16: fp32 master "
        "weights with bf16 autocast; fp32: everything fp32.",
    )
    gradient_checkpointing: bool | float = Field(
        True, description="Recompute the denoiser's blocks in backward instead of keeping their "
        "activations: true (every block), false (none), or a share between 0 and 1 of the blocks, "
        "spread evenly through the forward (0.25: one block in four recomputes; the others keep "
        "their activations): memory between false and true, recomputation that share of true's. "
        "memory/checkpointing.py.")
    max_grad_norm: float = Field(
        1.0, ge=0, le=1e6, description="Gradient clipping; 0 disables. Global norm, except with "
        "optimizer_in_backward: each tensor is clipped alone to max_grad_norm * "
        "sqrt(numel / numel of all trainable tensors), its share of the global budget.")
    stochastic_rounding: bool = Field(
        True, description="Applies to bf16 weights (full_bf16): optimizer updates, bf16 moments, and "
        "gradient accumulation into bf16 gradients (grad_accum > 1) are rounded stochastically, "
        "exact on average, instead of to nearest (which drops updates below bf16's spacing). "
        "Costs one random draw per value written; no effect on fp32 weights or LoRA matrices.")
    optimizer_in_backward: bool = Field(
        False, description="Step each parameter inside backward as soon as its gradient of the last "
        "micro-batch is complete, and free that gradient at once: no full set of gradients is ever "
        "held. Works with every optimizer, precision, LoRA and grad_accum (earlier micro-batches "
        "accumulate as usual); clipping becomes per tensor (see max_grad_norm); a non-finite "
        "gradient tensor is not applied while the finite ones are.")
    compile: bool = Field(
        False, description="Compile the denoiser's repeated blocks with torch.compile (regional "
        "compilation: the UNet's attention and resnet blocks, SD3's joint blocks), once per bucket "
        "shape, before the first step. Fewer kernel launches and fused elementwise work: faster "
        "steps on a GPU after a start-up of a minute or two. Not with memory.stream_weights or "
        "memory.offload_activations, whose hooks move tensors around the blocks.")
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto", description="Record the denoiser's forward and backward as CUDA graphs (once per bucket "
        "shape, at its first step) and replay them: one launch instead of thousands of small ones, "
        "for steps the host no longer slows down. auto (the default): on where the run trains on a "
        "GPU in one process and nothing below refuses them, off otherwise, and off again when the "
        "fit probe (memory.fit_probe) finds the recorded step too large for the GPU (or for "
        "memory.vram_budget, whose planner may turn them on too) and the step without them fits "
        "(the run's config.toml records which). CUDA only; not with LoRA dropout, grad_accum > 1 "
        "with optimizer_in_backward, or memory.stream_weights in a full fine-tune whose streamed "
        "weights step in CPU memory (all but optimizer_in_backward with Adafactor). Streamed "
        "weights record too: their copies to the GPU and home are part of the graphs; so do "
        "offloaded activations (each bucket shape then runs one step eagerly first, which makes "
        "their pinned buffers). A quantized LoRA base records too, and so does accumulation (bf16 "
        "sums with stochastic_rounding included), and so do compiled blocks (train.compile: each "
        "bucket shape then runs one step eagerly, which compiles it, and records at its second; so "
        "again after a sample grid). "
        "With optimizer_in_backward the recorded backward steps the weights as well (no gradient "
        "stays allocated); otherwise the gradients stay allocated between steps. The graphs keep "
        "their activations in a memory pool of their own: the memory report shows the peak.")
    noise_offset: float = Field(0.0, ge=0, le=1.0, description="SDXL family: offset noise, one normal "
                                "draw per sample and latent channel, times this, added to the noise (darker "
                                "darks, brighter brights); 0 turns it off.")
    input_perturbation: float = Field(0.0, ge=0, le=1.0, description="SDXL family: the noisy input is made "
                                      "with the noise plus this times a second normal draw, while the target "
                                      "stays the noise (diffusers' train_text_to_image; 0.1 there); 0 turns "
                                      "it off.")
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto", description="SDXL family: what the UNet predicts, the noise (epsilon) or v. auto: what the "
        "checkpoint says (a single file's v_pred key, a diffusers folder's scheduler config), else "
        "epsilon. Sample grids, `vramfit generate` and the saved files follow it (single files carry "
        "the v_pred key ComfyUI reads).")
    zero_terminal_snr: bool | Literal["auto"] = Field(
        "auto", description="SDXL family: rescale the noise schedule so its last timestep is pure noise "
        "(needs v_prediction; sampling then starts there, \"trailing\" spacing). auto: what the "
        "checkpoint says (a single file's ztsnr key, a diffusers folder's rescale_betas_zero_snr), "
        "else false.")
    min_snr_gamma: float = Field(0.0, ge=0, le=1000.0, description="min-SNR-gamma loss weighting, every "
                                 "family: each sample's loss counts as its clean-latent loss times "
                                 "min(SNR, gamma) (epsilon: min(SNR, gamma)/SNR; v: min(SNR, gamma)/(SNR+1); "
                                 "flow: min(SNR, gamma) * sigma^2 with SNR = ((1-sigma)/sigma)^2); 5 is the "
                                 "paper's; 0 disables.")
    debiased_estimation: bool = Field(False, description="Debiased-estimation loss weighting, every family "
                                      "(kohya's): epsilon 1/sqrt(SNR), v 1/(SNR+1), flow sigma*(1-sigma); "
                                      "SNR capped at 1000.")
    loss: Literal["mse", "huber", "smooth_l1"] = Field(
        "mse", description="The loss of each element: mse (squared error), huber (kohya's pseudo-Huber, "
        "2c(sqrt(d^2+c^2)-c): squared for small errors, linear for large ones) or smooth_l1 (the same "
        "divided by c). c is train.huber_c.")
    huber_c: float = Field(0.1, gt=0, le=1.0, description="With train.loss huber or smooth_l1: the "
                           "threshold c between the squared and the linear part.")
    huber_schedule: Literal["constant", "snr"] = Field(
        "snr", description="With train.loss huber or smooth_l1: constant (c everywhere) or snr (kohya's "
        "default: c at pure noise, rising to 1 at no noise, c + (1-c)/(1+1/sqrt(SNR))^2).")
    weighting_scheme: Literal["logit_normal", "mode", "cosmap", "uniform"] = Field(
        "logit_normal", description="SD3 flow matching: timestep density (and cosmap's loss weight).")
    logit_mean: float = Field(0.0, ge=-10.0, le=10.0, description="SD3, weighting_scheme logit_normal: mean "
                              "of the normal whose sigmoid picks each sample's timestep; above 0 favours "
                              "less noisy timesteps, below 0 noisier ones.")
    logit_std: float = Field(1.0, gt=0, le=10.0, description="SD3, weighting_scheme logit_normal: standard "
                             "deviation of that normal; smaller gathers the timesteps around the one "
                             "logit_mean picks, larger spreads them toward both ends.")
    mode_scale: float = Field(1.29, ge=-1.0, le=MODE_SCALE_MAX, description="SD3's mode density; "
                              f"between -1 and 2/(pi-2) = {MODE_SCALE_MAX:.4f}, where it stays a density.")
    flow_shift: Optional[float] = Field(None, gt=0, le=100.0, description="Flow families (SD3, Flux.1): "
                                        "a fixed timestep shift, sigma = s*u/(1+(s-1)*u) of each density "
                                        "draw u; above 1 trains noisier timesteps. Unset: the model's "
                                        "scheduler's (3.0). Setting it makes the shift fixed.")
    flow_shift_mode: Literal["auto", "fixed", "resolution"] = Field(
        "auto", description="Flow families: fixed (train.flow_shift) or resolution (Flux.1's: the shift "
        "e^mu grows with the image's token count, from the scheduler's base_shift at 256 tokens to "
        "max_shift at 4096). auto: fixed where train.flow_shift is set, else the family's (SD3 fixed, "
        "Flux.1 resolution).")
    guidance: float = Field(1.0, ge=0, le=100.0, description="Flux.1 dev (a guidance-distilled transformer): "
                            "the guidance its guidance embedding is given while training (1.0 as most Flux "
                            "trainers; the pipeline samples at 3.5).")
    seed: Seed = Field(42, description="Seed of the run's random draws: the batch order, random crops, each "
                       "micro-batch's noise and timesteps, a LoRA's initial weights and stochastic rounding.")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N.")
    cpu_threads: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        "auto", description="Threads torch computes with when the run (or its caching) is on the CPU. "
        "auto: OMP_NUM_THREADS where it is set, else half the physical cores, 1 to 4: more threads "
        "make a small model's steps hardly faster, and much slower where other processes load the "
        "machine. No effect on a GPU run.")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Under `accelerate launch` or `vramfit train --gpus N` (several processes): "
        "ddp keeps a whole model on every GPU and averages gradients (LoRA and full fine-tune); fsdp "
        "shards weights, gradients and optimizer state (full fine-tune with adamw). No effect on one "
        "process. docs/multi-gpu.md.")
    nonfinite: Literal["skip", "stop"] = Field(
        "skip",
        description="A NaN/inf loss or gradient: skip that optimizer step (counted in run.json), "
        "or stop the run naming the step and the batch's files.",
    )

    @field_validator("gradient_checkpointing")
    @classmethod
    def _checkpoint_share(cls, value: bool | float) -> bool | float:
        if isinstance(value, bool):
            return value
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"a share of the blocks lies between 0 and 1, not {value}; or write true "
                             f"(every block) or false (none)")
        return True if value == 1.0 else False if value == 0.0 else float(value)

    @field_validator("device")
    @classmethod
    def _a_device(cls, value: str) -> str:
        if not re.fullmatch(DEVICE_PATTERN, value):
            raise ValueError(f"{value!r} is not a device vramfit trains on; use {DEVICE_CHOICES}")
        return value

    @model_validator(mode="after")
    def _optimizer_keys(self) -> "TrainConfig":
        problems = []
        if self.optimizer == "custom" and self.optimizer_class is None:
            problems.append(("optimizer_class", "train.optimizer = 'custom' needs the dotted path of its "
                             "class here, as package.module.Class"))
        if self.optimizer != "custom" and self.optimizer_class is not None:
            problems.append(("optimizer_class", f"applies to train.optimizer = 'custom', not "
                             f"{self.optimizer!r}; set train.optimizer = 'custom' or remove it"))
        if self.optimizer_args and self.optimizer in ("adafactor", "adamw", "adamw8bit", "lion"):
            problems.append(("optimizer_args", f"{self.optimizer!r} takes its settings from train.lr, betas, "
                             "eps and weight_decay; optimizer_args applies to prodigy, schedulefree_adamw, "
                             "came and custom"))
        taken = sorted({"params", "lr"} & set(self.optimizer_args))
        if taken:
            problems.append(("optimizer_args", f"{' and '.join(taken)} come from vramfit (params: the trained "
                             "weights; lr: train.lr, moved by train.lr_scheduler); remove them here"))
        _raise_any(problems)
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainConfig":
        # with train.epochs the steps are known once the data is read (train/epochs.py checks then)
        if self.epochs is None and self.warmup_steps >= self.steps and self.warmup_steps > 0:
            raise KeyProblems([("warmup_steps", f"{self.warmup_steps} must be smaller than train.steps "
                                                f"({self.steps})")])
        return self


FULL_FORMATS = ("single_file", "diffusers")
LORA_FORMATS = ("lora", "lora_kohya")


class SaveConfig(_Section):
    every_steps: int = Field(0, ge=0, description="Also save every N steps; 0 saves at the end only "
                             "(as does a value above train.steps, with a warning at the start).")
    every_epochs: int = Field(0, ge=0, description="Also save at the end of every N-th epoch (at the step "
                              "that finishes it); 0: off.")
    formats: Optional[list[Literal["single_file", "diffusers", "lora", "lora_kohya"]]] = Field(
        None, min_length=1,
        description="full: single_file (ComfyUI/A1111 checkpoint) and/or diffusers (folder); "
        "lora: lora (diffusers/PEFT file; ComfyUI reads it for SD3) and/or lora_kohya (SDXL family, "
        "kohya/A1111/ComfyUI). Default: single_file; for a LoRA run, every LoRA format the family "
        "writes, its primary one as <name>.safetensors (SDXL family: lora_kohya, with lora as "
        "<name>-diffusers.safetensors; SD3: lora).")
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16", description="Precision of the trained denoiser written in single_file and diffusers "
        "checkpoints; the VAE and text encoders carried over keep the source's dtypes, and LoRA files "
        "are written in fp32.")
    name: str = Field("model", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Base name of the "
                      "files written to output.dir: <name>.safetensors (a LoRA's second format beside it "
                      "as <name>-diffusers.safetensors or <name>-kohya.safetensors), the <name>-diffusers "
                      "folder, <name>-stepNNNNNN for intermediate saves and the memory report "
                      "<name>.memory.json. Letters, digits, '.', '_' and '-'.")
    state_every_steps: int = Field(
        0, ge=0, description="Save a resumable training state every N steps (also written at "
        "the end and on Ctrl-C/SIGTERM); 0: every_steps when set, else only end and interrupt.")
    keep_last: int = Field(3, ge=1, le=10**6, description="Intermediate checkpoints and states kept "
                           "(newest).")


class OutputConfig(_Section):
    dir: str = Field("output", description="Folder of the run, created when missing: checkpoints, the "
                     "resolved config.toml, run.json, the memory report, training states (state/), "
                     "TensorBoard logs (logs/), sample grids (samples/) and, by default, DreamBooth "
                     "class images.")


class MemoryConfig(_Section):
    """How the denoiser's weights and activations are placed (memory/offload/)."""

    stream_weights: bool = Field(
        False, description="Keep the weights of the denoiser's blocks (SDXL family: down/mid/up "
        "blocks; SD3: transformer blocks) in pinned CPU memory and copy each block to the GPU just "
        "before it runs, forward and backward, on a side stream. Saves the blocks' weights (and, "
        "for a full fine-tune, their gradients) from the GPU; costs about two host-to-GPU copies "
        "of the streamed weights per step (forward and backward). A full fine-tune with "
        "train.optimizer_in_backward and Adafactor steps each streamed weight on the GPU while its "
        "block is there (its small optimizer state lives on the GPU) and copies the new values "
        "home; otherwise the gradients go home and the streamed weights step on the CPU, seconds "
        "a step (their optimizer state in CPU memory). LoRA matrices stay on the GPU. Sample "
        "grids (with cache.text and cache.latents) stream the denoiser too, beside the whole VAE.")
    stream_unit_mib: float = Field(
        256.0, gt=0, le=2**20, description="With stream_weights: a block holding more than this many MiB of "
        "streamed weights is split into its sub-modules, so at most about two such units are on "
        "the GPU at once (a LoRA's frozen base under train.gradient_checkpointing is never split "
        "finer than the blocks that recompute: Flux.1's and SD3.5 Large's blocks stay whole). "
        "Smaller: less GPU memory, more and smaller copies.")
    resident_blocks: Optional[int] = Field(
        None, ge=0, le=10**4, description="With stream_weights: this many of the denoiser's stream "
        "blocks stay on the GPU like unstreamed weights (in a full fine-tune with their gradients and "
        "optimizer state), and only the rest are streamed: between all streamed (0) and none (the "
        "stream block count). A stream block is a block of the denoiser (SDXL family: its down, mid "
        "and up blocks; SD3 and Flux.1: each transformer block), or its parts where a block holds more "
        "than stream_unit_mib: the units it streams in. The kept ones are spread through the forward "
        "order, the largest first, and each count keeps those of the count below. Each costs its "
        "weights' GPU memory and saves their copies. Default: chosen by vram_budget's plan (the most that fit), 0 "
        "without a budget. At most the stream block count (a count above it is refused, naming it).")
    streamed_grad_sums: Optional[Literal["home", "device"]] = Field(
        None, description="With stream_weights in a full fine-tune whose streamed weights step on the "
        "GPU (train.optimizer_in_backward with Adafactor) and train.grad_accum > 1: where the "
        "gradients of the earlier micro-batches are summed until the last one steps. \"device\": in "
        "sums kept on the GPU, added into as each gradient arrives (costs the streamed weights' "
        "gradient bytes on the GPU, for the whole run); \"home\": copied to pinned CPU memory, summed "
        "there (in fp32 where bf16 weights round stochastically) and brought back for the step (costs "
        "a copy each way, the CPU's additions, a second or more a micro-batch for a billion weights, done "
        "by a worker thread while backward goes on, and twice the streamed weights' bytes of pinned host "
        "memory). Unset: "
        "\"device\" where it applies and the planner predicts the train phase with the sums fits "
        "vram_budget (without one: the GPU's memory); else \"home\". The run's config.toml leaves it "
        "unset, saying what it resolved to.")
    stream_encoders: bool = Field(
        False, description="While captions are encoded (the text cache, or live text encoding), keep "
        "each text encoder's transformer layers (T5-XXL's blocks, the CLIPs' layers) in pinned CPU "
        "memory and copy them to the GPU one at a time just before they run, the next one on a side "
        "stream; only the embeddings, final norms and about two layers are on the GPU (T5-XXL: about "
        "1 GiB in bf16 instead of 9). Same embeddings (the text cache is shared with unstreamed runs); "
        "costs one host-to-GPU copy of each encoder per chunk of 64 captions, and pinned host memory. "
        "Sample grids and `vramfit generate` are not streamed.")
    offload_activations: bool = Field(
        False, description="Keep the tensors saved for backward (with gradient checkpointing: the "
        "checkpointed blocks' inputs; with a share checkpointed, every activation of the other "
        "blocks too) in pinned CPU memory instead of on the GPU; costs one copy "
        "to the host in forward and one back in backward for each saved tensor.")
    vram_budget: Optional[str] = Field(
        None, description="GPU memory the run may use, e.g. \"8GiB\", \"7.5GB\", \"6144MiB\" or a "
        "number of bytes. vramfit then predicts each phase's peak (fit/planner.py) and chooses the "
        "fastest combination of the memory settings you did not set yourself that fits with a margin; "
        "`vramfit plan` shows the choice. Settings you set are never changed.")
    host_budget: Optional[str] = Field(
        None, description="Host (CPU) memory the run may use, written as vram_budget is. With "
        "vram_budget the planner takes no combination whose predicted host peak (fit/host.py: the "
        "models loaded into CPU memory, streamed weights' and offloaded activations' pinned memory, an "
        "EMA in CPU memory) exceeds it, and stops naming this key where none fits; `vramfit plan` prints "
        "the host peak of each phase. Default: this machine's memory less 10% (at least 2 GiB) for the "
        "system, which steers the choice the same way but only warns where nothing fits it.")
    fit_probe: bool = Field(
        True, description="On CUDA, before the cache is filled, run two training steps of a stand-in "
        "denoiser (same architecture and placement, throwaway weights) on a batch of the largest "
        "bucket and stop with a clear message when its measured peak exceeds vram_budget or the GPU. "
        "Costs a few seconds; skipped on CPU.")

    @field_validator("vram_budget", "host_budget")
    @classmethod
    def _budget_parses(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_size(value)
        return value


class LoggingConfig(_Section):
    tensorboard: bool = Field(True, description="Write the loss, learning rate, step time and images per "
                              "second of every step as TensorBoard events in <output.dir>/logs.")
    wandb: bool = Field(False, description="Log the same values, and the run's config, to Weights & Biases "
                        "(needs `pip install wandb`).")
    wandb_project: str = Field("vramfit", description="The Weights & Biases project the run is logged to "
                               "(logging.wandb).")
    progress: bool = Field(True, description="Progress bars on stderr; --no-progress turns them off too.")


class PriorConfig(_Section):
    """DreamBooth prior preservation: class images trained beside the instance images."""

    class_prompt: Optional[str] = Field(
        None, description="Prompt of the class (e.g. 'a photo of a cat'); setting it turns prior "
        "preservation on.")
    class_dir: Optional[str] = Field(
        None, description="Folder of class images; missing ones are generated there with the base "
        "model. Default: <output.dir>/class_images.")
    num_images: int = Field(100, ge=1, le=10**6, description="Class images wanted; only the missing ones "
                            "are generated.")
    loss_weight: float = Field(1.0, ge=0, le=1000.0, description="Weight of the class images' loss "
                               "(diffusers: prior_loss_weight).")
    steps: int = Field(25, ge=1, le=1000, description="Sampling steps per generated class image.")
    guidance: Optional[float] = Field(None, ge=0, le=100.0, description="Guidance scale; default: the "
                                      "family's.")
    negative_prompt: Optional[str] = Field(None, description="Negative prompt of the generated class "
                                           "images, which guidance above 1 steers away from; default: "
                                           "the empty prompt.")
    seed: Seed = Field(0, description="Seed of the first generated class image (the next ones count up).")


class SampleConfig(_Section):
    """Sample grids during training: fixed prompts x fixed seeds, every N steps."""

    prompts: list[str] = Field(default_factory=list, description="One grid row per prompt.")
    seeds: list[Seed] = Field(default_factory=lambda: [0], description="One grid column per seed.")
    every_steps: int = Field(0, ge=0, description="Render a grid every N optimizer steps and at the "
                             "end; 0 turns samples off (above train.steps: at the end only, with a warning).")
    every_epochs: int = Field(0, ge=0, description="Render a grid at the end of every N-th epoch (and at "
                              "the end of the run); 0: off.")
    steps: int = Field(20, ge=1, le=1000, description="Sampling steps.")
    guidance: Optional[float] = Field(None, ge=0, le=100.0, description="Guidance scale; default: the "
                                      "family's.")
    negative_prompt: Optional[str] = Field(None, description="Negative prompt of the sample grids, which "
                                           "guidance above 1 steers away from; default: the empty prompt.")
    width: Optional[int] = Field(None, ge=8, le=4096, description="Default: data.resolution.")
    height: Optional[int] = Field(None, ge=8, le=4096, description="Default: data.resolution.")
    skip_layer_guidance: Optional[bool] = Field(
        None, description="Skip-layer guidance of SD3 and SD3.5 models (the other families sample without it "
        "and refuse it on): on the first steps a third prediction without some transformer blocks steers the "
        "image away from it. Unset: the model's default (SD3.5 Medium: blocks 7, 8, 9 at scale 2.5 over the "
        "first 1-20% of the steps; other models: off); false: off; true: on, with the default's blocks where "
        "skip_layer_guidance_layers is not set. Applies with guidance above 1 only.")
    skip_layer_guidance_layers: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, min_length=1, description="The transformer blocks skip-layer guidance leaves out (0 is the "
        "first; each below the model's block count); turns it on. Default: the model's (SD3.5 Medium: "
        "[7, 8, 9]).")
    skip_layer_guidance_scale: Optional[float] = Field(
        None, gt=0, le=100.0, description="How strongly skip-layer guidance steers; default: the model's "
        "(SD3.5 Medium 2.5; diffusers' 2.8 for blocks given to a model without a default).")

    @property
    def skip_layers(self) -> SkipLayerGuidance:
        """The skip-layer guidance the grids ask for (SD3 family: models/sd3/family.py applies it)."""
        layers = self.skip_layer_guidance_layers
        return SkipLayerGuidance(self.skip_layer_guidance, None if layers is None else tuple(layers),
                                 self.skip_layer_guidance_scale)

    @property
    def grids(self) -> bool:
        """Whether the run renders sample grids: prompts, and a step or epoch count to render at."""
        return bool((self.every_steps or self.every_epochs) and self.prompts)

    @model_validator(mode="after")
    def _prompts_when_on(self) -> "SampleConfig":
        problems = []
        for key in ("every_steps", "every_epochs"):
            if getattr(self, key) and not self.prompts:
                problems.append(("prompts", f"empty while sample.{key} is set; give sample.prompts, or set "
                                 f"sample.{key} = 0"))
        if not self.seeds:
            problems.append(("seeds", "empty; give at least one seed"))
        for side in ("width", "height"):
            if getattr(self, side) is not None and getattr(self, side) % 8:
                problems.append((side, f"{getattr(self, side)} is not a multiple of 8 (the VAE "
                                 "downsamples by 8)"))
        problems += [(key.split(".")[1], text) for key, text in skip_layer_problems(
            self.skip_layers, self.guidance, "sample.guidance")]
        _raise_any(problems)
        return self


class ValidationConfig(_Section):
    """The validation loss: the held-out images (validation datasets, validation_share) at fixed
    timesteps and fixed noise, without gradients, every N steps and at the end."""

    every_steps: int = Field(0, ge=0, description="Compute the validation loss every N optimizer steps; "
                             "0: at the end only. Needs a validation set (a dataset with validation = "
                             "true, or data.validation_share).")
    timesteps: int = Field(4, ge=1, le=100, description="Fixed timesteps each held-out image is scored at, "
                           "spread evenly over the noise schedule.")
    seed: Seed = Field(0, description="Seed of the fixed noise (the same at every evaluation).")
    batch_size: Optional[int] = Field(None, ge=1, le=4096, description="Images per forward pass; default "
                                      "train.batch_size.")


class EmaConfig(_Section):
    """An exponential moving average of the trained weights (memory/ema.py), saved beside them."""

    enabled: bool = Field(False, description="Keep an EMA of the trained weights (a LoRA's adapter "
                          "matrices, or every weight of a full fine-tune; trained text encoders' too), saved as "
                          "<save.name>-ema beside each checkpoint and kept in the training state.")
    decay: float = Field(0.9999, gt=0, lt=1, description="Decay d of each update: ema <- d * ema + (1 - d) "
                         "* weights.")
    update_every: int = Field(1, ge=1, le=10**6, description="Update the EMA after every N-th optimizer "
                              "step (d is per update).")
    warmup: bool = Field(True, description="Ramp the decay up: min(decay, (1 + n) / (10 + n)) at the "
                         "update after n others, 0 at the first (diffusers' EMAModel default); false: decay "
                         "from the first update, starting at the initial weights.")
    device: Literal["gpu", "cpu"] = Field("gpu", description="Where the EMA lives: \"gpu\" beside the "
                                          "trained weights (their count again on the device), \"cpu\" in CPU "
                                          "memory, updated from a staging copy of the weights on a worker "
                                          "thread (host memory: the EMA and the copy; none on the device).")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Precision of the EMA weights; bf16 halves "
                                           "their bytes and rounds each update stochastically (exact on "
                                           "average).")
    sample_with_ema: bool = Field(False, description="Render the sample grids with the EMA weights (swapped "
                                  "in for the grid, the trained ones back after).")


class RunConfig(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    cache: CacheConfig = CacheConfig()
    train: TrainConfig = TrainConfig()
    lora: LoraSettings = LoraSettings()
    prior: PriorConfig = PriorConfig()
    sample: SampleConfig = SampleConfig()
    validation: ValidationConfig = ValidationConfig()
    save: SaveConfig = SaveConfig()
    output: OutputConfig = OutputConfig()
    logging: LoggingConfig = LoggingConfig()
    memory: MemoryConfig = MemoryConfig()
    ema: EmaConfig = EmaConfig()

    @model_validator(mode="after")
    def _formats_fit_the_mode(self) -> "RunConfig":
        problems = []
        allowed = FULL_FORMATS if self.train.mode == "full" else LORA_FORMATS
        wrong = [f for f in self.save.formats or [] if f not in allowed]
        if wrong:
            problems.append(("save.formats", f"{wrong} do not apply to train.mode = {self.train.mode!r} "
                             f"(use {list(allowed)})"))
        # Values, not the keys given: a resolved config.toml lists every key at its value.
        default = LoraSettings()
        if self.train.mode == "full":
            problems += [(f"lora.{k}", "given but train.mode is 'full'; set train.mode = 'lora'")
                         for k in LoraSettings.model_fields if getattr(self.lora, k) != getattr(default, k)]
        _raise_any(problems)
        return self

    @property
    def text_encoder_training(self) -> Optional[str]:
        """How the CLIP text encoders train: "lora" (lora.text_encoder_rank in a LoRA run), "full"
        (train.text_encoders = "full" in a full fine-tune), or None (frozen)."""
        if self.train.mode == "lora" and self.lora.text_encoder_rank:
            return "lora"
        if self.train.mode == "full" and self.train.text_encoders == "full":
            return "full"
        return None

    @property
    def step_batch(self) -> int:
        """Images in one forward pass: the batch, doubled by class images (DreamBooth's generated
        ones, or a regularization dataset's)."""
        classes = self.prior.class_prompt or any(d.regularization for d in self.data.datasets)
        return self.train.batch_size * (2 if classes else 1)

    @model_validator(mode="after")
    def _switched_on_settings(self) -> "RunConfig":
        problems = []
        default = PriorConfig()
        # a regularization dataset (or a kohya config, which may hold one) is weighted by prior.loss_weight
        regularized = any(d.regularization for d in self.data.datasets) or self.data.kohya
        if not self.prior.class_prompt:
            problems += [(f"prior.{k}", "given without prior.class_prompt, which turns prior preservation "
                          "on; set it, or leave the [prior] settings out") for k in PriorConfig.model_fields
                         if k != "class_prompt" and getattr(self.prior, k) != getattr(default, k)
                         and not (k == "loss_weight" and regularized)]
        problems += [(f"ema.{k}", "given without ema.enabled = true; set it, or leave the [ema] settings out")
                     for k in EmaConfig.model_fields if k != "enabled" and not self.ema.enabled
                     and getattr(self.ema, k) != getattr(EmaConfig(), k)]
        problems += config_problems(self)  # config/rules.py: which settings refuse which
        if self.train.text_encoder_lr is not None and not self.text_encoder_training:
            problems.append(("train.text_encoder_lr", "given without lora.text_encoder_rank (a LoRA run) "
                             "or train.text_encoders = 'full' (a full fine-tune), which train the text "
                             "encoders; set one, or leave train.text_encoder_lr out"))
        if self.lora.text_encoder_alpha is not None and not self.lora.text_encoder_rank:
            problems.append(("lora.text_encoder_alpha", "given without lora.text_encoder_rank, which trains "
                             "the text encoders; set it, or leave lora.text_encoder_alpha out"))
        _raise_any(problems)
        trained = {"lora": "lora.text_encoder_rank", "full": "train.text_encoders = 'full'"}.get(
            self.text_encoder_training or "")
        if trained and self.cache.text and "text" in self.cache.model_fields_set:
            _raise_any([("cache.text", f"true cannot be used with {trained}: the trained "
                         "text encoders change every caption's embedding each step, so none can be "
                         "cached; set it to false or leave it out (it is then turned off)")])
            # (left at its default it is turned off when the run is resolved: fit/resolve.py)
        return self

    @property
    def save_formats(self) -> list[str]:
        if self.save.formats:
            return list(self.save.formats)
        # a LoRA run's default: what the family writes of these (models/*.py lora_formats)
        if self.train.mode == "full":
            return ["single_file"]
        # LoHa / LoKr have no diffusers layout (config/rules.py refuses one asked for)
        return [f for f in LORA_FORMATS if not (f == "lora" and self.lora.type in ("lokr", "loha"))]

    def start_warnings(self) -> list[str]:
        """What a run of this config will not do although a key seems to ask for it: intervals
        longer than the run (the end still saves and renders, as always)."""
        notes = []
        if self.train.epochs is not None:  # the steps are known once the data is read
            return notes
        for key, value, what in (
                ("save.every_steps", self.save.every_steps, "intermediate checkpoint"),
                ("save.state_every_steps", self.save.state_every_steps, "intermediate training state"),
                ("sample.every_steps", self.sample.every_steps, "intermediate sample grid")):
            if value > self.train.steps:
                notes.append(f"{key} ({value}) is larger than train.steps ({self.train.steps}): no {what} "
                             "is written; the end of the run writes one as always")
        return notes

    @property
    def output_dir(self) -> Path:
        return Path(self.output.dir)
