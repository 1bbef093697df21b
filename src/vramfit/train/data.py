"""From a validated dataset to training batches: bucketing, the cache stage, live encoding.

The cache stage puts one model on the device at a time (the VAE, then each text encoder), and
writes every entry before training starts, so the training phase holds only the denoiser. With
caching turned off, the same encoding functions run inside the loop instead; both paths give
identical tensors for the same item, which the tests check.

A cache entry found damaged or gone while training is encoded again and written back where its
encoder is still loaded (one of the caches is off). When both caches are on the encoders were freed
after caching (reloading them mid-run would take the memory the training was planned without), so
the micro-batch is skipped instead, with a warning naming the file, and counted in the stats
(`micro_batches_skipped`, in run.json); the entry is rebuilt by the next run's cache stage. When
two epochs' worth of micro-batches are skipped in a row, none is usable (the cache folder removed,
say) and training cannot go on: CacheEntriesLost stops it, and the loop saves the state first.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from tqdm.auto import tqdm

from PIL import ImageOps

from vramfit.config.schema import CacheConfig, DatasetConfig
from vramfit.data import captions, masks
from vramfit.data.buckets import assign_bucket, fit_to_bucket, image_to_tensor, make_buckets, resized_size
from vramfit.data.cache import DiskCache, latent_key, text_key
from vramfit.data.datasets import ScannedDataset
from vramfit.data.fingerprint import digest, file_digest
from vramfit.data.scan import Item, load_image
from vramfit.models.adapter import Family, ModelBundle
from vramfit.memory.vae_tiling import vae_tile

log = logging.getLogger("vramfit.data")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEXT_CHUNK = 64


PLAIN = DatasetConfig(path=".")  # the rules of images no dataset holds ([prior]'s class images)


@dataclass
class Record:
    """One image of the run as it is cached: its bucket, crop, caption variants and cache keys."""

    item: Item
    bucket: tuple[int, int]
    image_digest: str
    crop_seed: int
    spec: DatasetConfig = PLAIN  # the rules of its dataset
    dataset: int = -1  # index of its dataset (-1: [prior]'s class images)
    captions: tuple[str, ...] = ()  # the caption variants it trains with (data/captions.py)
    latent_key: str = ""
    flip_key: str = ""  # the mirrored latent's (spec.flip)
    text_keys: tuple[str, ...] = ()
    mask_digest: str = ""  # of its mask file (spec.masks)
    prior: bool = False  # a class image of prior preservation (train/prior.py, regularization datasets)
    validation: bool = False  # held out: scored by the validation loss, never trained

    def __post_init__(self) -> None:
        self.captions = self.captions or (self.item.caption,)

    @property
    def text_key(self) -> str:
        return self.text_keys[0] if self.text_keys else ""


@dataclass(frozen=True)
class Draw:
    """One record as one micro-batch slot trains it: which caption variant (-1: dropped, the empty
    caption) and whether mirrored."""

    record: Record
    variant: int = 0
    flipped: bool = False

    @property
    def item(self) -> Item:
        return self.record.item

    @property
    def prior(self) -> bool:
        return self.record.prior

    @property
    def caption(self) -> str:
        return captions.EMPTY if self.variant < 0 else self.record.captions[self.variant]


def make_records(datasets: list[ScannedDataset], seed: int) -> list[Record]:
    """The records of every dataset's items: bucket, crop seed, caption variants, validation split."""
    records = []
    for ds in datasets:
        d = ds.config
        buckets = make_buckets(d.resolution, d.bucket_step, d.max_aspect)
        for item in ds.result.items:
            records.append(record_of(item, d, ds.index, buckets, seed))
    return records


def record_of(item: Item, d: DatasetConfig, index: int, buckets: list, seed: int, prior: bool = False,
              bucket: Optional[tuple[int, int]] = None) -> Record:
    """The record of one item of dataset `d` (number `index`)."""
    crop_seed = int(digest(seed, item.key)[:8], 16) if d.random_crop else 0
    lines = list(item.caption_lines) if d.caption_per_line else [item.caption]
    variants = captions.variants(lines, shuffle=d.shuffle_tags, keep_tokens=d.keep_tokens, separator=d.tag_separator,
                                 count=d.caption_variants, seed=seed, key=item.key)
    # class images are never held out: their loss says nothing of what the run learns
    held = d.validation or (not d.regularization and not prior and d.validation_share > 0
                            and int(digest("validation", item.key)[:8], 16) / 2**32 < d.validation_share)
    mask = ""
    if d.masks is not None:
        mask = file_digest(masks.find_mask(Path(item.path), Path(d.path).expanduser(), Path(d.masks).expanduser()))
    return Record(item, tuple(bucket or assign_bucket(item.width, item.height, buckets)),
                  item.sha256 or file_digest(item.path), crop_seed, d, index, tuple(variants), mask_digest=mask,
                  prior=prior or d.regularization, validation=held)


def _crop_of(rec: Record):
    """The crop fit_to_bucket makes of the record's image (random at its fixed seed, or centred)."""
    return random.Random(rec.crop_seed) if rec.spec.random_crop else None


def encode_item_image(family: Family, bundle: ModelBundle, rec: Record, cache_cfg: CacheConfig,
                      device: torch.device, flipped: bool = False) -> dict[str, torch.Tensor]:
    """Latent distribution, SDXL size conditioning and loss mask of one item (the cache stage and
    live path), mirrored left-right when `flipped`: the crop offset is then measured from the
    mirrored image's left edge, as SDXL's conditioning reads it."""
    source = load_image(rec.item.path)
    rng = _crop_of(rec)
    image, crop = fit_to_bucket(source, rec.bucket, random_crop=rec.spec.random_crop, rng=rng)
    info = crop
    if flipped:
        image = ImageOps.mirror(image)
        spare_w = resized_size(source.width, source.height, rec.bucket)[0] - rec.bucket[0]
        crop = dataclasses.replace(crop, crop_top_left=(crop.crop_top_left[0], spare_w - crop.crop_top_left[1]))
    pixels = image_to_tensor(image).unsqueeze(0)
    out = family.encode_images(bundle, pixels, device, DTYPES[cache_cfg.dtype], cache_cfg.vae_tiling)
    out = {k: v[0] for k, v in out.items()}
    out["time_ids"] = torch.tensor(crop.time_ids(), dtype=torch.float32)
    mask = _mask_image(rec)
    if mask is not None:
        out["mask"] = masks.mask_for_bucket(mask, info, flipped)
    return out


def _mask_image(rec: Record):
    """The record's mask (spec.masks, or the alpha of spec.alpha_mask), None when it trains unmasked."""
    d = rec.spec
    if d.masks is not None:
        found = masks.find_mask(Path(rec.item.path), Path(d.path).expanduser(), Path(d.masks).expanduser())
        if found is None:  # there when the dataset was scanned
            raise ValueError(f"the mask of {rec.item.key} is no longer in {d.masks} (masks); put it back, or "
                             "run again to have the image skipped")
        return masks.load_mask(found)
    return masks.alpha_of(Path(rec.item.path)) if d.alpha_mask else None


class CacheEntriesLost(ValueError):
    """Every micro-batch of an epoch met a damaged or missing cache entry while training."""


class TrainingData:
    """Owns the records and produces batches, from the cache or by encoding live."""

    def __init__(self, family: Family, bundle: ModelBundle, records: list[Record], cache_cfg: CacheConfig,
                 cache: DiskCache, device: torch.device, seed: int = 0, prior_weight: float = 1.0,
                 identities: Optional[dict[str, str]] = None, share: Optional[Callable[[list], list]] = None,
                 frozen_text: bool = False):
        self.family, self.bundle, self.records, self.seed = family, bundle, records, seed
        # What the text cache holds: every encoder's outputs (cache.text), or, while the CLIP encoders
        # train (`frozen_text`), those of the encoders that never train (Family.encode_frozen_text:
        # SD3's and Flux.1's T5), which training joins to the CLIPs' live ones; None: nothing
        self.text_part: Optional[str] = "text" if cache_cfg.text else "frozen text" if frozen_text else None
        # Over several ranks, `share` picks this rank's part of the entries to encode (distributed.py).
        self.share = share or (lambda items: items)
        self.prior_weight = prior_weight
        self.identities = identities or {}  # encoder_identity by part, when taken before quantizing
        self.cache_cfg, self.cache, self.device = cache_cfg, cache, device
        self.stats = {"latents_cached": 0, "latents_reused": 0, "text_cached": 0, "text_reused": 0}
        # the keys of the entries the cache stage writes (stats: how many were written)
        self.pending: dict[str, list[str]] = {"latents": [], "text": []}
        self.empty_key = ""  # the empty caption's text entry, where a dataset drops captions
        self._skipped_in_a_row = 0
        self._named: set[str] = set()  # items whose unusable entry was warned about
        self._lengths: dict[tuple[int, int], int] = {}  # (epoch, batch size) -> micro-batches
        # draws trained per dataset index (-1: [prior]'s class images): images, dropped captions, mirrored
        self.drawn = {"images_trained": Counter(), "captions_dropped": Counter(), "flipped": Counter()}

    @property
    def trained(self) -> list[Record]:
        return [r for r in self.records if not r.validation]

    @property
    def held_out(self) -> list[Record]:
        return [r for r in self.records if r.validation]

    @property
    def drops_captions(self) -> bool:
        return any(r.spec.caption_dropout > 0 for r in self.trained)

    def warn_long_captions(self, tokenizers: list) -> int:
        """Name every caption the text encoders will truncate; returns how many images have one.
        `tokenizers`: the family's caption tokenizers, each with the length its encoder keeps as its
        model_max_length (Family.caption_tokenizers: CLIP 77, SD3's T5 model.max_sequence_length)."""
        long = 0
        for r in self.records:
            over = [(n, tok.model_max_length) for caption in r.captions for tok in tokenizers
                    if (n := len(tok(caption, truncation=False).input_ids)) > tok.model_max_length]
            if over:
                n, limit = max(over)
                log.warning("caption of %s is %d tokens; the text encoder keeps the first %d", r.item.key, n, limit)
                long += 1
        return long

    # ---- cache stage -------------------------------------------------------------------------
    def assign_keys(self) -> None:
        store = self.cache_cfg.dtype
        if self.cache_cfg.latents:
            vae_id = self.identities.get("vae") or self.family.encoder_identity(self.bundle, "vae")
            # tiles of another side encode differently: the key holds the side (False untiled)
            tiling = self.cache_cfg.vae_tiling and vae_tile(self.bundle.vae.config.sample_size)
            for r in self.records:
                crop = ("random", r.crop_seed) if r.spec.random_crop else ("center",)
                # an entry with a mask says whose: a mask file's digest, or the image's alpha
                crop += ("mask", r.mask_digest) if r.mask_digest else ("alpha",) if r.spec.alpha_mask else ()
                r.latent_key = latent_key(r.image_digest, r.bucket, crop, vae_id, self.cache_cfg.vae_dtype,
                                          store, tiling)
                if r.spec.flip and not r.validation:
                    r.flip_key = latent_key(r.image_digest, r.bucket, crop + ("flip",), vae_id,
                                            self.cache_cfg.vae_dtype, store, tiling)
        text_id = self.text_part and (self.identities.get(self.text_part)
                                      or self.family.encoder_identity(self.bundle, self.text_part))
        if not text_id:  # a model with no frozen encoder (SDXL, T5 left out) caches no text
            self.text_part = None
        else:
            for r in self.records:
                r.text_keys = tuple(text_key(c, text_id, store) for c in r.captions)
            if self.drops_captions:
                self.empty_key = text_key(captions.EMPTY, text_id, store)

    def latent_entries(self) -> list[tuple[Record, bool, str]]:
        """(record, mirrored, key) of every latent entry the run trains from, each key once (the same
        image in two datasets, or with two captions, is one entry: encoded and counted once)."""
        entries: dict[str, tuple[Record, bool, str]] = {}
        for r in self.records:
            for flipped, key in ((False, r.latent_key), (True, r.flip_key)):
                if key and key not in entries:
                    entries[key] = (r, flipped, key)
        return list(entries.values())

    def text_entries(self) -> dict[str, str]:
        """Text key -> caption of every text entry the run trains from (the empty caption's too)."""
        entries = {key: c for r in self.records for c, key in zip(r.captions, r.text_keys)}
        if self.empty_key:
            entries[self.empty_key] = captions.EMPTY
        return entries

    def cache_latents(self, progress: bool = False) -> None:
        entries = self.latent_entries()
        self.cache.clean_stale("latents", [key for _, _, key in entries])
        missing = [e for e in entries if not self.cache.has("latents", e[2])]
        self.stats["latents_reused"] = len(entries) - len(missing)
        todo = self.share(missing) if missing else missing
        self.pending["latents"], self.stats["latents_cached"] = [key for _, _, key in todo], 0
        if not todo:
            return
        self.bundle.vae.to(self.device)
        for r, flipped, key in _bar(todo, "cache latents", progress):
            enc = encode_item_image(self.family, self.bundle, r, self.cache_cfg, self.device, flipped)
            self.cache.put("latents", key, enc, {"vramfit.item": r.item.key})
            self.stats["latents_cached"] += 1
        self.bundle.vae.to("cpu")

    def cache_text(self, progress: bool = False) -> None:
        entries = self.text_entries()
        self.cache.clean_stale("text", list(entries))
        pending = {k: c for k, c in entries.items() if not self.cache.has("text", k)}
        self.stats["text_reused"] = len(entries) - len(pending)
        keys = self.share(list(pending)) if pending else []
        self.pending["text"], self.stats["text_cached"] = list(keys), 0
        for start in _bar(range(0, len(keys), TEXT_CHUNK), "cache text", progress):
            chunk = keys[start:start + TEXT_CHUNK]
            out = self._encode_cached_part([pending[k] for k in chunk])
            for i, key in enumerate(chunk):
                self.cache.put("text", key, {k: v[i] for k, v in out.items()}, {})
                self.stats["text_cached"] += 1

    def _encode_cached_part(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """What a text entry holds for `captions`: every encoder's outputs, or the frozen ones'."""
        encode = self.family.encode_text if self.text_part == "text" else self.family.encode_frozen_text
        return encode(self.bundle, captions, self.device, DTYPES[self.cache_cfg.dtype])

    def written(self, kind: str) -> int:
        """How many of the cache stage's entries of `kind` are in the cache now: counted on disk, so a
        stop between an entry's write and its count still reports it."""
        return sum(self.cache.path(kind, key).is_file() for key in self.pending[kind])  # written whole or not

    def cache_size(self) -> dict[str, int]:
        """Entries and bytes of the run's text and latent cache entries (what the cache holds for it)."""
        out = {}
        for kind, keys in (("latents", [k for _, _, k in self.latent_entries()]), ("text", list(self.text_entries()))):
            cached = self.cache_cfg.latents if kind == "latents" else self.text_part is not None
            files = [self.cache.path(kind, k) for k in keys if cached]
            sizes = [f.stat().st_size for f in files if f.is_file()]
            out[f"{kind}_entries"], out[f"{kind}_bytes"] = len(sizes), sum(sizes)
        return out

    def summary(self) -> list[dict]:
        """Per dataset: its name, images, held-out images, repeats (or weight) and what was trained
        from it so far (run.json)."""
        out = []
        for index in sorted({r.dataset for r in self.records}):
            recs = [r for r in self.records if r.dataset == index]
            spec = recs[0].spec
            out.append({"name": spec.label if index >= 0 else "[prior] class images", "path": spec.path,
                        "images": len(recs), "held_out": sum(r.validation for r in recs),
                        "repeats": spec.weight if spec.weight is not None else spec.repeats or 1,
                        "regularization": recs[0].prior, "caption_variants": sum(len(r.captions) for r in recs),
                        **{k: counts[index] for k, counts in self.drawn.items()}})
        return out

    # ---- batches -----------------------------------------------------------------------------
    def _latent(self, d: Draw) -> Optional[dict[str, torch.Tensor]]:
        """The draw's latent entry; encoded again (and written back) when it is unusable and the
        VAE is loaded; None when it is unusable and the VAE is not."""
        r = d.record
        if not self.cache_cfg.latents:
            return encode_item_image(self.family, self.bundle, r, self.cache_cfg, self.device, d.flipped)
        key = r.flip_key if d.flipped else r.latent_key
        entry = self.cache.get("latents", key)
        if entry is not None or self.bundle.vae is None:
            return entry
        log.warning("latent cache entry of %s is damaged or gone; encoding it again", r.item.key)
        vae_device = next(self.bundle.vae.parameters()).device  # where the cache stage left it
        entry = encode_item_image(self.family, self.bundle, r, self.cache_cfg, vae_device, d.flipped)
        self._write_back("latents", key, entry, {"vramfit.item": r.item.key})
        return entry

    def _text_key(self, d: Draw) -> str:
        return self.empty_key if d.variant < 0 else d.record.text_keys[d.variant]

    def _text(self, draws: list[Draw]) -> Optional[dict[str, torch.Tensor]]:
        """The draws' conditioning: their text entries stacked (where the frozen encoders' outputs
        are cached, joined to the training encoders' live ones); encoded again as for `_latent`;
        None when one is unusable and the text encoders are not loaded."""
        captions, dtype = [d.caption for d in draws], DTYPES[self.cache_cfg.dtype]
        if self.text_part is None:
            return self.family.encode_text(self.bundle, captions, self.device, dtype)
        entries = [self.cache.get("text", self._text_key(d)) for d in draws]
        if any(e is None for e in entries):
            # with the CLIPs training, T5 is not to come to the device mid-run (the plan has no room for
            # it there): the micro-batch is skipped, and the next run's cache stage writes the entry
            if not self.bundle.text_encoders or self.text_part == "frozen text":
                return None
            log.warning("text cache entries of %s are damaged or gone; encoding them again",
                        ", ".join(d.item.key for d, e in zip(draws, entries) if e is None))
            out = self._encode_cached_part(captions)
            for i, (d, e) in enumerate(zip(draws, entries)):
                if e is None:
                    entries[i] = {k: v[i] for k, v in out.items()}
                    self._write_back("text", self._text_key(d), entries[i], {})
        stacked = {k: torch.stack([e[k] for e in entries]) for k in entries[0]}
        if self.text_part == "text":
            return stacked
        return self.family.encode_text(self.bundle, captions, self.device, dtype, frozen=stacked)

    def _write_back(self, kind: str, key: str, entry: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        try:
            self.cache.put(kind, key, entry, meta)
            self.stats["cache_entries_rebuilt"] = self.stats.get("cache_entries_rebuilt", 0) + 1
        except OSError as exc:  # training goes on with the entry in memory; the next run writes it
            log.warning("could not write the rebuilt cache entry %s back (%s)", self.cache.path(kind, key),
                        exc)

    def batch(self, draws: list[Draw]) -> Optional[dict[str, torch.Tensor]]:
        """The micro-batch's tensors, or None when it is to be skipped (an unusable cache entry that
        cannot be encoded again now); raises CacheEntriesLost when none is usable any more."""
        lat = [self._latent(d) for d in draws]
        text = self._text(draws) if all(e is not None for e in lat) else None
        if text is None:
            return self._skip(draws, lat)
        self._skipped_in_a_row = 0
        for d in draws:
            if not d.record.validation:
                self.drawn["images_trained"][d.record.dataset] += 1
                self.drawn["captions_dropped"][d.record.dataset] += d.variant < 0
                self.drawn["flipped"][d.record.dataset] += d.flipped
        out = {k: torch.stack([e[k] for e in lat]) for k in lat[0] if k != "mask"}
        out.update(text)
        if any(d.record.spec.masks is not None or d.record.spec.alpha_mask for d in draws):
            grid = out["mean"].shape[-2:]
            out["loss_mask"] = torch.stack([_loss_weight(e.get("mask"), d.record.spec.mask_min_weight, grid)
                                            for d, e in zip(draws, lat)])
        n_prior = sum(d.prior for d in draws)
        if n_prior:  # loss = mean over instance images + prior_weight * mean over class images
            n = len(draws) - n_prior
            out["sample_weight"] = torch.tensor([self.prior_weight / n_prior if d.prior else 1.0 / n
                                                 for d in draws])
        return out

    def _skip(self, draws: list[Draw], lat: list) -> None:
        self.stats["micro_batches_skipped"] = self.stats.get("micro_batches_skipped", 0) + 1
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= 2 * len(self.records):  # a usable one would have come within two epochs
            raise CacheEntriesLost(
                f"every micro-batch of two epochs met a damaged or missing cache entry in {self.cache.root} "
                "(was the cache removed or changed while training?); training cannot go on")
        bad = [(d, "latents", d.record.flip_key if d.flipped else d.record.latent_key) if e is None
               else (d, "text", self._text_key(d)) for d, e in zip(draws, lat)
               if e is None or (self.text_part is not None
                                and not self.cache.path("text", self._text_key(d)).is_file())]
        new = [(d, kind, key) for d, kind, key in bad if d.item.key not in self._named]
        if new:
            self._named.update(d.item.key for d, _, _ in new)
            log.warning("skipping a micro-batch (%s): its cache entries are damaged or gone and the encoders "
                        "are not loaded while training: %s. The next run's cache stage rebuilds them; until "
                        "then each micro-batch that holds them is skipped",
                        ", ".join(d.item.key for d in draws),
                        "; ".join(f"the {kind} entry of {d.item.key} ({self.cache.path(kind, key)})"
                                  for d, kind, key in new))
        return None

    # ---- an epoch ------------------------------------------------------------------------------
    def epoch_records(self, epoch: int, prior: bool) -> list[Record]:
        """The records an epoch trains (or, `prior`, the class images it pairs them with): each
        dataset's `repeats` times over, or `weight` times its size: whole passes, then the next
        part of a fixed order of its images (so over the epochs each is trained equally often)."""
        by_dataset: dict[int, list[Record]] = {}
        for r in self.records:
            if r.prior == prior and not r.validation:
                by_dataset.setdefault(r.dataset, []).append(r)
        out = []
        for index, recs in sorted(by_dataset.items()):
            times = recs[0].spec.times
            whole, part = int(times), times - int(times)
            out += recs * whole
            if part:
                order = _ordered(recs, torch.Generator().manual_seed(self.seed * 7919 + index + 1), True)
                start, stop = math.floor(epoch * part * len(recs)), math.floor((epoch + 1) * part * len(recs))
                out += [order[i % len(recs)] for i in range(start, stop)]
        return out

    def batches(self, batch_size: int, generator: torch.Generator, shuffle: bool,
                epoch: int = 0) -> Iterator[list[Draw]]:
        """One epoch of same-bucket batches of the trained images, in a seeded order, each slot a Draw.

        With class images (prior preservation, regularization datasets) each batch also carries
        as many class images of its bucket, taken in a seeded order that cycles through them (an
        epoch is one pass over the other images).
        """
        groups = []
        instance = _by_bucket(self.epoch_records(epoch, prior=False))
        for bucket in sorted(instance):
            recs = _ordered(instance[bucket], generator, shuffle)
            groups += [recs[i:i + batch_size] for i in range(0, len(recs), batch_size)]
        classes = {bucket: itertools.cycle(_ordered(recs, generator, shuffle))
                   for bucket, recs in sorted(_by_bucket(self.epoch_records(epoch, prior=True)).items())}
        slot = 0
        for group in _ordered(groups, generator, shuffle):
            cycle = classes.get(group[0].bucket)
            full = group + [next(cycle) for _ in group] if cycle is not None else group
            draws = []
            for r in full:
                draws.append(self.draw(r, epoch, slot))
                slot += 1
            yield draws

    def draw(self, r: Record, epoch: int, slot: int) -> Draw:
        """How slot `slot` of epoch `epoch` trains record `r`: a caption variant, dropped at the
        dataset's rate, mirrored one time in two where it flips."""
        rng = captions.draw(self.seed, epoch, slot, r.item.key)
        variant = rng.randrange(len(r.captions))
        dropped = rng.random() < r.spec.caption_dropout
        flipped = rng.random() < 0.5
        return Draw(r, -1 if dropped else variant, flipped and r.spec.flip)

    def epoch_length(self, epoch: int, batch_size: int) -> int:
        """Micro-batches of epoch `epoch` (it varies where a dataset has a fractional weight)."""
        key = (epoch, batch_size)
        if key not in self._lengths:
            counts = Counter(r.bucket for r in self.epoch_records(epoch, prior=False))
            self._lengths[key] = sum(math.ceil(n / batch_size) for n in counts.values())
        return self._lengths[key]

    def validation_batches(self, batch_size: int) -> list[list[Draw]]:
        """The held-out images in same-bucket batches, in a fixed order: each as written (its first
        caption, not mirrored)."""
        by_bucket = _by_bucket(self.held_out)
        return [[Draw(r) for r in recs[i:i + batch_size]]
                for bucket in sorted(by_bucket) for recs in (by_bucket[bucket],)
                for i in range(0, len(recs), batch_size)]


def tag_frequency(records: list[Record]) -> dict[str, dict[str, int]]:
    """Per dataset (its name, else its folder's), how many trained images carry each comma-separated
    tag of their first caption: kohya's ss_tag_frequency, which A1111 and Civitai show for a LoRA."""
    out: dict[str, Counter] = {}
    for rec in records:
        if rec.prior or rec.validation or not rec.captions:
            continue
        name = rec.spec.name or Path(rec.spec.path).name or "data"
        tags = {t.strip() for t in rec.captions[0].split(",") if t.strip()}
        out.setdefault(name, Counter()).update(tags)
    return {name: dict(sorted(c.items())) for name, c in out.items()}


def _by_bucket(records: list[Record]) -> dict[tuple[int, int], list[Record]]:
    """The records of each bucket, in record order."""
    out: dict[tuple[int, int], list[Record]] = {}
    for r in records:
        out.setdefault(r.bucket, []).append(r)
    return out


def _loss_weight(mask: Optional[torch.Tensor], floor: float, grid: torch.Size) -> torch.Tensor:
    """A latent-grid loss weight: `floor` where the mask is 0 rising to 1 where it is 1; all ones
    without a mask (an image of an unmasked dataset, or one with no alpha)."""
    if mask is None:
        return torch.ones(1, *grid)
    return floor + (1.0 - floor) * mask.float()


def _ordered(items: list, generator: torch.Generator, shuffle: bool) -> list:
    order = torch.randperm(len(items), generator=generator).tolist() if shuffle else range(len(items))
    return [items[i] for i in order]


def _bar(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable

    return tqdm(iterable, desc=desc, leave=False)


def free_device_memory(device: Optional[torch.device]) -> None:
    """On a GPU: collect the reference cycles that still hold device tensors and give the
    allocator's cached blocks back, so the next phase (and the memory report) sees them free. On
    the CPU nothing: CPython's own collections free host memory in time, and an explicit one
    scans every object of the process (0.1 to 0.4 s a call, more the more it holds)."""
    if device is not None and device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
