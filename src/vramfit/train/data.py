"""From a validated dataset to training batches: bucketing, the cache stage, live encoding.

The cache stage puts one model on the device at a time (the VAE, then each text encoder), and
writes every entry before training starts, so the training phase holds only the denoiser. With
caching turned off, the same encoding functions run inside the loop instead; both paths give
identical tensors for the same item, which the tests check.
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from vramfit.config.schema import CacheConfig, DataConfig
from vramfit.data.buckets import assign_bucket, fit_to_bucket, image_to_tensor, make_buckets
from vramfit.data.cache import DiskCache, latent_key, text_key
from vramfit.data.fingerprint import digest, file_digest
from vramfit.data.scan import Item, load_image
from vramfit.models.adapter import Family, ModelBundle

log = logging.getLogger("vramfit.data")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEXT_CHUNK = 64


@dataclass
class Record:
    item: Item
    bucket: tuple[int, int]
    image_digest: str
    crop_seed: int
    latent_key: str = ""
    text_key: str = ""
    prior: bool = False  # a class image of DreamBooth prior preservation (train/prior.py)


def make_records(items: list[Item], data_cfg: DataConfig, seed: int) -> list[Record]:
    buckets = make_buckets(data_cfg.resolution, data_cfg.bucket_step, data_cfg.max_aspect)
    records = []
    for item in items:
        bucket = assign_bucket(item.width, item.height, buckets)
        crop_seed = int(digest(seed, item.key)[:8], 16) if data_cfg.random_crop else 0
        records.append(Record(item, tuple(bucket), item.sha256 or file_digest(item.path), crop_seed))
    return records


def encode_item_image(family: Family, bundle: ModelBundle, rec: Record, data_cfg: DataConfig,
                      cache_cfg: CacheConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """Latent distribution and SDXL size conditioning of one item (the cache stage and live path)."""
    image = load_image(rec.item.path)
    rng = random.Random(rec.crop_seed) if data_cfg.random_crop else None
    image, crop = fit_to_bucket(image, rec.bucket, random_crop=data_cfg.random_crop, rng=rng)
    pixels = image_to_tensor(image).unsqueeze(0)
    out = family.encode_images(bundle, pixels, device, DTYPES[cache_cfg.dtype], cache_cfg.vae_tiling)
    out = {k: v[0] for k, v in out.items()}
    out["time_ids"] = torch.tensor(crop.time_ids(), dtype=torch.float32)
    return out


class TrainingData:
    """Owns the records and produces batches, from the cache or by encoding live."""

    def __init__(self, family: Family, bundle: ModelBundle, records: list[Record], data_cfg: DataConfig,
                 cache_cfg: CacheConfig, cache: DiskCache, device: torch.device, prior_weight: float = 1.0,
                 identities: Optional[dict[str, str]] = None, share: Optional[Callable[[list], list]] = None):
        self.family, self.bundle, self.records = family, bundle, records
        # Over several ranks, `share` picks this rank's part of the entries to encode (distributed.py).
        self.share = share or (lambda items: items)
        self.prior_weight = prior_weight
        self.identities = identities or {}  # encoder_identity by part, when taken before quantizing
        self.data_cfg, self.cache_cfg, self.cache, self.device = data_cfg, cache_cfg, cache, device
        self.stats = {"latents_cached": 0, "latents_reused": 0, "text_cached": 0, "text_reused": 0}

    def warn_long_captions(self) -> int:
        """Name every caption the text encoders will truncate; returns how many."""
        long = 0
        # CLIP stops at its 77 positions; SD3's T5 at model.max_sequence_length.
        cap = self.bundle.extra.get("max_sequence_length")
        for r in self.records:
            for tok in self.bundle.tokenizers:
                limit = min(tok.model_max_length, cap or tok.model_max_length)
                n = len(tok(r.item.caption, truncation=False).input_ids)
                if n > limit:
                    log.warning("caption of %s is %d tokens; the text encoder keeps the first %d",
                                r.item.key, n, limit)
                    long += 1
                    break
        return long

    # ---- cache stage -------------------------------------------------------------------------
    def assign_keys(self) -> None:
        store = self.cache_cfg.dtype
        if self.cache_cfg.latents:
            vae_id = self.identities.get("vae") or self.family.encoder_identity(self.bundle, "vae")
            for r in self.records:
                crop = ("random", r.crop_seed) if self.data_cfg.random_crop else ("center",)
                r.latent_key = latent_key(r.image_digest, r.bucket, crop, vae_id, self.cache_cfg.vae_dtype,
                                          store, self.cache_cfg.vae_tiling)
        if self.cache_cfg.text:
            text_id = self.identities.get("text") or self.family.encoder_identity(self.bundle, "text")
            for r in self.records:
                r.text_key = text_key(r.item.caption, text_id, store)

    def cache_latents(self, progress: bool = False) -> None:
        missing = [r for r in self.records if not self.cache.has("latents", r.latent_key)]
        self.stats["latents_reused"] = len(self.records) - len(missing)
        todo = self.share(missing) if missing else missing
        if not todo:
            return
        self.bundle.vae.to(self.device)
        for r in _bar(todo, "cache latents", progress):
            enc = encode_item_image(self.family, self.bundle, r, self.data_cfg, self.cache_cfg, self.device)
            self.cache.put("latents", r.latent_key, enc, {"vramfit.item": r.item.key})
        self.bundle.vae.to("cpu")
        self.stats["latents_cached"] = len(todo)

    def cache_text(self, progress: bool = False) -> None:
        pending: dict[str, str] = {}
        for r in self.records:
            if r.text_key not in pending and not self.cache.has("text", r.text_key):
                pending[r.text_key] = r.item.caption
        self.stats["text_reused"] = len({r.text_key for r in self.records}) - len(pending)
        keys = self.share(list(pending)) if pending else []
        for start in _bar(range(0, len(keys), TEXT_CHUNK), "cache text", progress):
            chunk = keys[start:start + TEXT_CHUNK]
            out = self.family.encode_text(self.bundle, [pending[k] for k in chunk], self.device,
                                          DTYPES[self.cache_cfg.dtype])
            for i, key in enumerate(chunk):
                self.cache.put("text", key, {k: v[i] for k, v in out.items()}, {})
        self.stats["text_cached"] = len(keys)

    # ---- batches -----------------------------------------------------------------------------
    def _latent(self, r: Record) -> dict[str, torch.Tensor]:
        if self.cache_cfg.latents:
            entry = self.cache.get("latents", r.latent_key)
            if entry is not None:
                return entry
            if self.bundle.vae is None:
                raise RuntimeError(f"the latent cache entry of {r.item.key} became unreadable during "
                                   "training; run again and it will be rebuilt")
            log.warning("latent cache entry for %s vanished; encoding it again", r.item.key)
        return encode_item_image(self.family, self.bundle, r, self.data_cfg, self.cache_cfg, self.device)

    def _text(self, records: list[Record]) -> dict[str, torch.Tensor]:
        if self.cache_cfg.text:
            entries = [self.cache.get("text", r.text_key) for r in records]
            if all(e is not None for e in entries):
                return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}
            if not self.bundle.text_encoders:
                raise RuntimeError("a text cache entry became unreadable during training; run again "
                                   "and it will be rebuilt")
        return self.family.encode_text(self.bundle, [r.item.caption for r in records], self.device,
                                       DTYPES[self.cache_cfg.dtype])

    def batch(self, records: list[Record]) -> dict[str, torch.Tensor]:
        lat = [self._latent(r) for r in records]
        out = {k: torch.stack([e[k] for e in lat]) for k in lat[0]}
        out.update(self._text(records))
        n_prior = sum(r.prior for r in records)
        if n_prior:  # loss = mean over instance images + prior_weight * mean over class images
            n = len(records) - n_prior
            out["sample_weight"] = torch.tensor([self.prior_weight / n_prior if r.prior else 1.0 / n
                                                 for r in records])
        return out

    def batches(self, batch_size: int, generator: torch.Generator, shuffle: bool) -> Iterator[list[Record]]:
        """One epoch of same-bucket batches of instance images, in a seeded order.

        With prior preservation each batch also carries as many class images of its bucket, taken
        in a seeded order that cycles through them (an epoch is one pass over the instance images).
        """
        groups = []
        instance = self._by_bucket(prior=False)
        for bucket in sorted(instance):
            recs = _ordered(instance[bucket], generator, shuffle)
            groups += [recs[i:i + batch_size] for i in range(0, len(recs), batch_size)]
        classes = {bucket: itertools.cycle(_ordered(recs, generator, shuffle))
                   for bucket, recs in sorted(self._by_bucket(prior=True).items())}
        for group in _ordered(groups, generator, shuffle):
            cycle = classes.get(group[0].bucket)
            yield group + [next(cycle) for _ in group] if cycle is not None else group

    def _by_bucket(self, prior: bool) -> dict[tuple[int, int], list[Record]]:
        """The instance (or class) records of each bucket, in record order."""
        out: dict[tuple[int, int], list[Record]] = {}
        for r in self.records:
            if r.prior == prior:
                out.setdefault(r.bucket, []).append(r)
        return out


def _ordered(items: list, generator: torch.Generator, shuffle: bool) -> list:
    order = torch.randperm(len(items), generator=generator).tolist() if shuffle else range(len(items))
    return [items[i] for i in order]


def _bar(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False)


def free_device_memory(device: Optional[torch.device]) -> None:
    import gc

    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
