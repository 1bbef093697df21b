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

import gc
import itertools
import logging
import random
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from tqdm.auto import tqdm

from vramfit.config.schema import CacheConfig, DataConfig
from vramfit.data.buckets import assign_bucket, fit_to_bucket, image_to_tensor, make_buckets
from vramfit.data.cache import DiskCache, latent_key, text_key
from vramfit.data.fingerprint import digest, file_digest
from vramfit.data.scan import Item, load_image
from vramfit.models.adapter import Family, ModelBundle
from vramfit.memory.vae_tiling import vae_tile

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


class CacheEntriesLost(ValueError):
    """Every micro-batch of an epoch met a damaged or missing cache entry while training."""


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
        self.to_cache = {"latents": 0, "text": 0}  # entries the cache stage writes (stats: those written)
        self._skipped_in_a_row = 0
        self._named: set[str] = set()  # items whose unusable entry was warned about

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
            # tiles of another side encode differently: the key holds the side (False untiled)
            tiling = self.cache_cfg.vae_tiling and vae_tile(self.bundle.vae.config.sample_size)
            for r in self.records:
                crop = ("random", r.crop_seed) if self.data_cfg.random_crop else ("center",)
                r.latent_key = latent_key(r.image_digest, r.bucket, crop, vae_id, self.cache_cfg.vae_dtype,
                                          store, tiling)
        if self.cache_cfg.text:
            text_id = self.identities.get("text") or self.family.encoder_identity(self.bundle, "text")
            for r in self.records:
                r.text_key = text_key(r.item.caption, text_id, store)

    def cache_latents(self, progress: bool = False) -> None:
        self.cache.clean_stale("latents", [r.latent_key for r in self.records])
        missing = [r for r in self.records if not self.cache.has("latents", r.latent_key)]
        self.stats["latents_reused"] = len(self.records) - len(missing)
        todo = self.share(missing) if missing else missing
        self.to_cache["latents"], self.stats["latents_cached"] = len(todo), 0
        if not todo:
            return
        self.bundle.vae.to(self.device)
        for r in _bar(todo, "cache latents", progress):
            enc = encode_item_image(self.family, self.bundle, r, self.data_cfg, self.cache_cfg, self.device)
            self.cache.put("latents", r.latent_key, enc, {"vramfit.item": r.item.key})
            self.stats["latents_cached"] += 1
        self.bundle.vae.to("cpu")

    def cache_text(self, progress: bool = False) -> None:
        self.cache.clean_stale("text", [r.text_key for r in self.records])
        pending: dict[str, str] = {}
        for r in self.records:
            if r.text_key not in pending and not self.cache.has("text", r.text_key):
                pending[r.text_key] = r.item.caption
        self.stats["text_reused"] = len({r.text_key for r in self.records}) - len(pending)
        keys = self.share(list(pending)) if pending else []
        self.to_cache["text"], self.stats["text_cached"] = len(keys), 0
        for start in _bar(range(0, len(keys), TEXT_CHUNK), "cache text", progress):
            chunk = keys[start:start + TEXT_CHUNK]
            out = self.family.encode_text(self.bundle, [pending[k] for k in chunk], self.device,
                                          DTYPES[self.cache_cfg.dtype])
            for i, key in enumerate(chunk):
                self.cache.put("text", key, {k: v[i] for k, v in out.items()}, {})
                self.stats["text_cached"] += 1

    # ---- batches -----------------------------------------------------------------------------
    def _latent(self, r: Record) -> Optional[dict[str, torch.Tensor]]:
        """The item's latent entry; encoded again (and written back) when it is unusable and the
        VAE is loaded; None when it is unusable and the VAE is not."""
        if not self.cache_cfg.latents:
            return encode_item_image(self.family, self.bundle, r, self.data_cfg, self.cache_cfg, self.device)
        entry = self.cache.get("latents", r.latent_key)
        if entry is not None or self.bundle.vae is None:
            return entry
        log.warning("latent cache entry of %s is damaged or gone; encoding it again", r.item.key)
        vae_device = next(self.bundle.vae.parameters()).device  # where the cache stage left it
        entry = encode_item_image(self.family, self.bundle, r, self.data_cfg, self.cache_cfg, vae_device)
        self._write_back("latents", r.latent_key, entry, {"vramfit.item": r.item.key})
        return entry

    def _text(self, records: list[Record]) -> Optional[dict[str, torch.Tensor]]:
        """The records' text entries stacked; encoded again as for `_latent`; None when one is
        unusable and the text encoders are not loaded."""
        if self.cache_cfg.text:
            entries = [self.cache.get("text", r.text_key) for r in records]
            if all(e is not None for e in entries):
                return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}
            if not self.bundle.text_encoders:
                return None
            log.warning("text cache entries of %s are damaged or gone; encoding them again",
                        ", ".join(r.item.key for r, e in zip(records, entries) if e is None))
        out = self.family.encode_text(self.bundle, [r.item.caption for r in records], self.device,
                                      DTYPES[self.cache_cfg.dtype])
        if self.cache_cfg.text:
            for i, (r, e) in enumerate(zip(records, entries)):
                if e is None:
                    self._write_back("text", r.text_key, {k: v[i] for k, v in out.items()}, {})
        return out

    def _write_back(self, kind: str, key: str, entry: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        try:
            self.cache.put(kind, key, entry, meta)
            self.stats["cache_entries_rebuilt"] = self.stats.get("cache_entries_rebuilt", 0) + 1
        except OSError as exc:  # training goes on with the entry in memory; the next run writes it
            log.warning("could not write the rebuilt cache entry %s back (%s)", self.cache.path(kind, key),
                        exc)

    def batch(self, records: list[Record]) -> Optional[dict[str, torch.Tensor]]:
        """The micro-batch's tensors, or None when it is to be skipped (an unusable cache entry that
        cannot be encoded again now); raises CacheEntriesLost when none is usable any more."""
        lat = [self._latent(r) for r in records]
        text = self._text(records) if all(e is not None for e in lat) else None
        if text is None:
            return self._skip(records, lat)
        self._skipped_in_a_row = 0
        out = {k: torch.stack([e[k] for e in lat]) for k in lat[0]}
        out.update(text)
        n_prior = sum(r.prior for r in records)
        if n_prior:  # loss = mean over instance images + prior_weight * mean over class images
            n = len(records) - n_prior
            out["sample_weight"] = torch.tensor([self.prior_weight / n_prior if r.prior else 1.0 / n
                                                 for r in records])
        return out

    def _skip(self, records: list[Record], lat: list) -> None:
        self.stats["micro_batches_skipped"] = self.stats.get("micro_batches_skipped", 0) + 1
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= 2 * len(self.records):  # a usable one would have come within two epochs
            raise CacheEntriesLost(
                f"every micro-batch of two epochs met a damaged or missing cache entry in {self.cache.root} "
                "(was the cache removed or changed while training?); training cannot go on")
        bad = [(r, "latents", r.latent_key) if e is None else (r, "text", r.text_key)
               for r, e in zip(records, lat)
               if e is None or (self.cache_cfg.text and not self.cache.path("text", r.text_key).is_file())]
        new = [(r, kind, key) for r, kind, key in bad if r.item.key not in self._named]
        if new:
            self._named.update(r.item.key for r, _, _ in new)
            log.warning("skipping a micro-batch (%s): its cache entries are damaged or gone and the encoders "
                        "are not loaded while training: %s. The next run's cache stage rebuilds them; until "
                        "then each micro-batch that holds them is skipped",
                        ", ".join(r.item.key for r in records),
                        "; ".join(f"the {kind} entry of {r.item.key} ({self.cache.path(kind, key)})"
                                  for r, kind, key in new))
        return None

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

    return tqdm(iterable, desc=desc, leave=False)


def free_device_memory(device: Optional[torch.device]) -> None:
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
