"""DreamBooth prior preservation: class images, generated with the base model when missing.

Each class image has a slot: slot i is rendered (when its file is missing) with seed
`prior.seed + i` at the size of the bucket the slot is given, and the slots are spread over the
instance images' buckets in proportion to how many instance images each bucket holds (at least
one per bucket). So every training batch can pair its instance images with class images of the
same shape and run both through one forward pass, as diffusers' DreamBooth script does, and
the set of class images depends only on the config, never on how many already existed.
Images the user put in the folder fill the first free slots but keep the bucket of their own
aspect; a batch whose bucket has no class image trains without one.

Class images take `prior.class_prompt` as their caption. They are ordinary dataset items
afterwards: validated by the scanner, cached like the instance images (latents and text), and
weighted in the loss by `prior.loss_weight` (train.data.TrainingData.batch).
Cost: one base-model generation per missing image, before caching; nothing while training
besides the doubled batch.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from vramfit.config.schema import RunConfig
from vramfit.data.buckets import assign_bucket, make_buckets
from vramfit.data.scan import IMAGE_EXTENSIONS, scan_dataset
from vramfit.generate import build_pipeline, cast_floating, generate, save_png

log = logging.getLogger("vramfit")
SLOT_NAME = "class-{:05d}.png"


def class_dir(cfg: RunConfig) -> Path:
    return Path(cfg.prior.class_dir).expanduser() if cfg.prior.class_dir else cfg.output_dir / "class_images"


def slot_buckets(instance_buckets: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The bucket of each of n class slots: proportional to the instance buckets, >= 1 each.

    Largest-remainder allocation over the buckets in sorted order, so it is deterministic.
    """
    counts = Counter(instance_buckets)
    buckets = sorted(counts)
    if n < len(buckets):
        raise ValueError(f"prior.num_images is {n}, but the instance images use {len(buckets)} buckets "
                         "and each needs at least one class image; raise prior.num_images")
    total = sum(counts.values())
    share = {b: 1 + (n - len(buckets)) * counts[b] / total for b in buckets}
    given = {b: int(share[b]) for b in buckets}
    for b in sorted(buckets, key=lambda b: (-(share[b] - given[b]), b))[:n - sum(given.values())]:
        given[b] += 1
    return [b for b in buckets for _ in range(given[b])]


def sampling_problems(cfg: RunConfig, family) -> list[str]:
    """Class images missing where the model, as model.t5_precision leaves it, cannot generate them
    (a family whose pipeline needs T5, T5 left out): found before the model loads."""
    if not cfg.prior.class_prompt or cfg.model.t5_precision != "none" or not family.has_t5 \
            or family.samples_without_t5:
        return []
    folder = class_dir(cfg)
    present = _existing(folder) if folder.is_dir() else {}
    missing = sum(1 for i in range(cfg.prior.num_images) if i not in present)  # as ensure_class_images
    if not missing:
        return []
    return [f"model.t5_precision: \"none\" leaves {family.display_name} without T5, which generating class "
            f"images (prior.class_prompt) needs: {missing} of prior.num_images = {cfg.prior.num_images} are "
            f"missing in {folder}; store T5 as int8 or nf4, or put the class images there"]


def _existing(folder: Path) -> dict[int, Path]:
    """Slot index -> file for the class images present (slot files and any others, in name order)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
                   and not p.name.startswith("."))
    named = {int(p.stem[6:]): p for p in files if p.stem.startswith("class-") and p.stem[6:].isdigit()}
    others = iter(p for p in files if p not in named.values())
    slots: dict[int, Path] = dict(named)
    i = 0
    for p in others:  # user-supplied class images fill the slots the project's files leave free
        while i in slots:
            i += 1
        slots[i] = p
    return slots


def ensure_class_images(cfg: RunConfig, family, bundle, buckets: list[tuple[int, int]],
                        device: torch.device, progress: bool) -> tuple[Path, list[tuple[int, int]], int]:
    """Generate every missing slot's image; returns (folder, slot buckets, images generated)."""
    folder = class_dir(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    slots = slot_buckets(buckets, cfg.prior.num_images)
    present = _existing(folder)
    _check_prompts(present, cfg.prior.class_prompt, folder)
    missing = [i for i in range(len(slots)) if i not in present]
    if missing:
        log.info("prior preservation: generating %d class images of %r in %s", len(missing),
                 cfg.prior.class_prompt, folder)
        _generate(cfg, family, bundle, folder, [(i, slots[i]) for i in missing], device, progress)
    return folder, slots, len(missing)


def _check_prompts(present: dict[int, Path], prompt: str, folder: Path) -> None:
    """Refuse class images this project generated for another class prompt (they would train
    under the wrong caption); images without that record (the user's own) are taken as they are."""
    others = []
    for path in present.values():
        if not path.name.startswith("class-"):
            continue
        try:
            with Image.open(path) as im:
                made_for = getattr(im, "text", {}).get("prompt")
        except OSError:
            continue  # unreadable: class_items names it and skips it
        if made_for is not None and made_for != prompt:
            others.append((path.name, made_for))
    if others:
        name, made_for = others[0]
        raise ValueError(f"prior.class_dir: {folder} holds {len(others)} class images generated for the "
                         f"prompt {made_for!r} (e.g. {name}), not for prior.class_prompt {prompt!r}; give "
                         "another prior.class_dir, or move those images away to have them generated again")


def _generate(cfg: RunConfig, family, bundle, folder: Path, todo: list[tuple[int, tuple[int, int]]],
              device: torch.device, progress: bool) -> None:
    modules = {"vae": bundle.vae, **{f"te{i}": m for i, m in enumerate(bundle.text_encoders)},
               "denoiser": bundle.denoiser}
    dtypes = {k: next(m.parameters()).dtype for k, m in modules.items()}
    pipe = build_pipeline(bundle)
    pipe.set_progress_bar_config(disable=True)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    p = cfg.prior
    try:
        for i, (w, h) in _bar(todo, progress):
            image = generate(pipe, [p.class_prompt], negative=p.negative_prompt, seed=p.seed + i,
                             steps=p.steps, guidance=p.guidance, width=w, height=h, device=device,
                             dtype=dtype, offload=True,
                             max_sequence_length=bundle.extra.get("max_sequence_length"))[0]
            save_png(image, folder / SLOT_NAME.format(i),
                     {"prompt": p.class_prompt, "seed": str(p.seed + i), "model": bundle.source.label})
    finally:  # everything back on the CPU in the precision it had, as training expects it
        if getattr(pipe, "_vramfit_placed", None) is not None:
            pipe.remove_all_hooks()
        for k, m in modules.items():
            cast_floating(m, dtypes[k], "cpu")


def _bar(items, enabled: bool):
    if not enabled:
        return items

    return tqdm(items, desc="class images", leave=False)


def class_items(cfg: RunConfig, folder: Path, slots: list[tuple[int, int]]):
    """The class images as scanned items with their buckets: a generated image has its slot's
    (it was rendered at that size); the user's own take the bucket of their own aspect, as
    instance images do, so they are never cropped to another shape."""
    buckets = make_buckets(cfg.data.resolution, cfg.data.bucket_step, cfg.data.max_aspect)
    result = scan_dataset(folder, instance_prompt=cfg.prior.class_prompt, min_size=1,
                          max_pixels=cfg.data.max_pixels)
    for problem in result.problems:
        log.warning("class image %s skipped: %s", problem.path, problem.reason)
    by_path = {Path(it.path).resolve(): it for it in result.items}
    out = []
    for slot, path in sorted(_existing(folder).items()):
        item = by_path.get(path.resolve())
        if slot < len(slots) and item is not None:
            own = None if path.name.startswith("class-") else tuple(assign_bucket(item.width, item.height, buckets))
            out.append((item, own or slots[slot]))
    if len(out) < len(slots):
        log.warning("prior preservation: %d of %d class images are usable (see the warnings above)",
                    len(out), len(slots))
    if not out:
        raise ValueError(f"prior.class_dir: no usable class images in {folder}")
    return out
