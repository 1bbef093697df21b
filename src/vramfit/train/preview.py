"""`vramfit data`: what a run would train, read from the config and the datasets, with no weight
loaded, nothing trained and no cache entry written.

Per dataset: the usable, skipped and ignored files, how often an epoch trains it, what is held out,
its buckets, and its captions' lengths in tokens of each tokenizer training uses (only the
tokenizers are read from the model). Then the epoch in micro-batches, the steps train.epochs
derives, and the cache entries the run will hold. The numbers come from the same code a run uses
(make_records, TrainingData, the loop's epoch order, EpochClock), so the preview cannot drift from
the run: the contact sheet shows the first epoch's draws with their captions as trained.
The model is resolved as a run resolves it (a tiny model is written, a repo id fetched) for its
tokenizers only.
"""
from __future__ import annotations

import base64
import html
import itertools
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from PIL import Image
from tqdm.auto import tqdm

from vramfit.config.rules import TRAINED_ENCODERS_KEY
from vramfit.config.schema import DatasetConfig, RunConfig
from vramfit.data import contact_sheet, masks
from vramfit.data.buckets import fit_to_bucket
from vramfit.data.datasets import scan_datasets
from vramfit.data.scan import Problem, load_image
from vramfit.formats.safetensors_io import atomic_file, write_text_atomic
from vramfit.models.adapter import Family
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.data import Draw, Record, TrainingData, make_records
from vramfit.train.epochs import EpochClock
from vramfit.train.loop import epoch_batches
from vramfit.train.setup import cache_root
from vramfit.train.state import Progress

BAR = 30  # characters of the longest bar of a bucket histogram
Bucket = tuple[int, int]


@dataclass
class TokenStats:
    """Caption lengths in one tokenizer's tokens (special tokens included, as the encoder sees them)."""

    tokenizer: str
    limit: int  # the tokens its encoder keeps
    lengths: list[int]

    @property
    def over(self) -> int:
        return sum(n > self.limit for n in self.lengths)

    def summary(self) -> tuple[int, str, int]:
        """min, median and max (0 without captions)."""
        lengths = self.lengths or [0]
        return min(lengths), f"{statistics.median(lengths):g}", max(lengths)

    def line(self) -> str:
        low, median, high = self.summary()
        return (f"{self.tokenizer}: min {low} / median {median} / max {high}; "
                f"{self.over} over its limit of {self.limit}")


@dataclass
class DatasetPreview:
    """What one dataset brings to the run."""

    where: str
    path: str
    config: DatasetConfig
    usable: int
    held_out: int
    per_epoch: int  # draws of its images in the first epoch
    buckets: Counter  # its trained (not held-out) images per bucket
    skipped: list[Problem]
    ignored: list[Problem]
    variants: int  # caption variants of its images (what its text cache entries hold)
    tokens: list[TokenStats] = field(default_factory=list)

    @property
    def times(self) -> str:
        d = self.config
        if d.weight is not None:
            return f"weight {d.weight:g}"
        return f"repeats {d.repeats or 1}"


@dataclass
class Preview:
    """The whole preview: per dataset, the totals, the cache entries, the first epoch's tiles."""

    name: str
    datasets: list[DatasetPreview]
    batch_size: int
    micro_batches: int  # of the first epoch
    buckets: dict[Bucket, int]  # images the first epoch trains per bucket (class images not counted)
    class_draws: int  # class images the first epoch's batches carry
    steps: str  # what train.steps is, or train.epochs derives
    text_entries: str
    latent_entries: str
    notes: list[str]
    rows: list[contact_sheet.Row]

    def micro_batches_of(self, bucket: Bucket) -> int:
        return math.ceil(self.buckets[bucket] / self.batch_size)


def preview(cfg: RunConfig, per_bucket: int, progress: bool, name: str = "config") -> Preview:
    """Scan the datasets and work out what a run of `cfg` trains (no model weights are read)."""
    scanned = scan_datasets(cfg)
    records = make_records(scanned, cfg.train.seed)
    # Cache keys as the run assigns them, with a stand-in for the encoders' identity (which needs
    # their weights): the counts of distinct entries are the run's.
    keys = cfg.cache.model_copy(update={"latents": True, "text": True, "vae_tiling": False})
    data = TrainingData(None, None, records, keys, None, None, seed=cfg.train.seed,
                        prior_weight=cfg.prior.loss_weight, identities={"vae": "preview", "text": "preview"})
    data.assign_keys()
    notes: list[str] = []
    draws: list[Draw] = []
    batch = cfg.train.batch_size
    if data.trained:
        first = data.epoch_length(0, batch)
        order = epoch_batches(data, cfg.train, Progress(), cfg.data.shuffle)  # the loop's own order
        draws = [d for group in itertools.islice(order, first) for d in group]
    else:
        notes.append("nothing trains: every image is held out for validation")
    per_epoch = Counter(d.record.dataset for d in draws)
    family, tokenizers = _tokenizers(cfg, notes)
    short = not cfg.data.datasets and not cfg.data.kohya
    datasets = []
    for ds in scanned:
        mine = [r for r in records if r.dataset == ds.index]
        captions = [c for r in mine for c in r.captions]
        datasets.append(DatasetPreview(
            where=f"data.path ({ds.config.label!r})" if short else ds.where, path=ds.config.path,
            config=ds.config, usable=len(ds.result.items), held_out=sum(r.validation for r in mine),
            per_epoch=per_epoch[ds.index], buckets=Counter(r.bucket for r in mine if not r.validation),
            skipped=ds.result.problems, ignored=ds.result.ignored, variants=len(captions),
            tokens=[_token_stats(tok, captions, progress) for tok in tokenizers]))
    trained = [d for d in draws if not d.record.prior]
    if cfg.prior.class_prompt:
        notes.append(f"[prior] class images ({cfg.prior.class_dir or 'output.dir/class_images'}; the missing "
                     "ones generated by the base model) join the batches at train time; not shown here")
    return Preview(
        name=name, datasets=datasets, batch_size=batch, micro_batches=data.epoch_length(0, batch),
        buckets=dict(sorted(Counter(d.record.bucket for d in trained).items())),
        class_draws=len(draws) - len(trained), steps=_steps(cfg, data),
        text_entries=_text_entries(cfg, data, bool(family and family.has_t5 and cfg.model.t5_precision != "none")),
        latent_entries=_latent_entries(cfg, data), notes=notes,
        rows=_rows(draws, {ds.index: ds.config.label for ds in scanned}, per_bucket, batch, progress, notes))


def _tokenizers(cfg: RunConfig, notes: list[str]) -> tuple[Optional[Family], list[Any]]:
    """The model's family and the tokenizers a run of `cfg` encodes captions with; none (and a note
    saying why) when the model or its tokenizers cannot be found."""
    try:
        source = resolve_source(cfg.model, cache_root(cfg), weights=False)  # a repo id: no weights fetched
        family = detect_family(source, cfg.model.family)
        tokenizers = family.caption_tokenizers(source, cfg)
    except (ValueError, OSError) as exc:
        notes.append(f"caption tokens not counted: {exc}")
        return None, []
    problems = family.config_problems(cfg)
    if problems:
        notes.append(f"train would refuse this config for this {family.name} model: " + "; ".join(problems))
    return family, tokenizers


def _token_stats(tokenizer: Any, captions: list[str], progress: bool) -> TokenStats:
    distinct = sorted(set(captions))
    length = {}
    for start in tqdm(range(0, len(distinct), 1024), desc="count caption tokens", leave=False,
                      disable=not progress):
        chunk = distinct[start:start + 1024]
        for text, ids in zip(chunk, tokenizer(chunk, truncation=False).input_ids):
            length[text] = len(ids)
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "tokenizer")).name
    kind = type(tokenizer).__name__.removesuffix("Fast").removesuffix("Tokenizer") or type(tokenizer).__name__
    return TokenStats(f"{folder} ({kind})", int(tokenizer.model_max_length), [length[c] for c in captions])


def _steps(cfg: RunConfig, data: TrainingData) -> str:
    accum, first = cfg.train.grad_accum, data.epoch_length(0, cfg.train.batch_size)
    if not first:
        return "no micro-batch in the first epoch: nothing to train"
    if cfg.train.epochs is not None:
        clock = EpochClock(data, cfg.train.batch_size, accum)
        epochs = cfg.train.epochs
        return (f"train.epochs = {epochs}: {clock.end(epochs - 1)} micro-batches at grad_accum {accum}: "
                f"train.steps = {clock.steps_for(epochs)}")
    steps = cfg.train.steps
    return (f"train.steps = {steps} (train.epochs not set): {steps * accum} micro-batches at grad_accum "
            f"{accum}, about {steps * accum / first:.3g} epochs")


def _text_entries(cfg: RunConfig, data: TrainingData, t5: bool) -> str:
    """The text cache entries the run makes; `t5`: the model has a T5 it loads (while the CLIP
    encoders train, its outputs alone are cached: train/data.py's "frozen text")."""
    entries = data.text_entries()
    empty = " and the empty caption of caption_dropout" if data.empty_key else ""
    what = f"{len(entries)}: {len(entries) - bool(data.empty_key)} distinct caption variants{empty}"
    trained = TRAINED_ENCODERS_KEY.get(cfg.text_encoder_training)
    if trained and t5:
        return (f"{what}, T5's outputs only, where the model has a T5 ({trained}: the CLIP encoders train "
                "and encode every caption each step)")
    if trained:  # cache.text is turned off for them where the run resolves (fit/resolve.py)
        return f"none ({trained}: the text encoders train, every caption is encoded each step: {what})"
    return what if cfg.cache.text else f"none (cache.text = false; encoded while training: {what})"


def _latent_entries(cfg: RunConfig, data: TrainingData) -> str:
    entries = data.latent_entries()
    mirrored = len({key for _, flipped, key in entries if flipped})
    plain = len({key for _, flipped, key in entries if not flipped})
    what = f"{plain + mirrored}: {plain} as the images are"
    what += f", {mirrored} mirrored (flip)" if mirrored else ""
    return what if cfg.cache.latents else f"none (cache.latents = false; encoded while training: {what})"


# ---- the contact sheet --------------------------------------------------------------------------
def _rows(draws: list[Draw], labels: dict[int, str], per_bucket: int, batch: int, progress: bool,
          notes: list[str]) -> list[contact_sheet.Row]:
    """Per bucket, its first `per_bucket` draws of distinct images in the first epoch, as tiles."""
    if per_bucket <= 0:
        return []
    chosen: dict[Bucket, list[Draw]] = {}
    seen: set[int] = set()
    for d in draws:
        picks = chosen.setdefault(d.record.bucket, [])
        if len(picks) < per_bucket and id(d.record) not in seen:
            picks.append(d)
            seen.add(id(d.record))
    counts = Counter(d.record.bucket for d in draws if not d.record.prior)
    rows = []
    bar = tqdm(total=sum(len(p) for p in chosen.values()), desc="contact sheet", leave=False,
               disable=not progress)
    for bucket in sorted(chosen):
        n = counts[bucket]
        row = contact_sheet.Row(f"bucket {bucket[0]}x{bucket[1]}: {_n(n, 'image')} in the first epoch, "
                                f"{_n(math.ceil(n / batch), 'micro-batch')}")
        for d in chosen[bucket]:
            try:
                row.tiles.append(tile(d, labels.get(d.record.dataset, "[prior]")))
            except Exception as exc:  # PIL raises many types for a file changed since the scan
                notes.append(f"contact sheet: {d.item.key} left out: {exc}")
            bar.update()
        rows.append(row)
    bar.close()
    return rows


def tile(draw: Draw, label: str, cell: int = contact_sheet.CELL) -> contact_sheet.Tile:
    """The draw's thumbnail, fitted to its bucket as training fits the image (crop included, a random
    crop from the image's own seed at thumbnail scale), with its loss mask where it trains masked."""
    r = draw.record
    scale = cell / max(r.bucket)
    box = (max(1, round(r.bucket[0] * scale)), max(1, round(r.bucket[1] * scale)))
    image = _shrunk(load_image(r.item.path), box)
    image, _ = fit_to_bucket(image, box, random_crop=r.spec.random_crop, rng=_crop_rng(r))
    mask = _mask(r)
    if mask is not None:
        mask, _ = fit_to_bucket(_shrunk(mask, box), box, random_crop=r.spec.random_crop, rng=_crop_rng(r))
    return contact_sheet.Tile(image, label, draw.caption, draw.flipped, mask,
                              ("class image",) if r.prior else ())


def _crop_rng(r: Record) -> Optional[random.Random]:
    return random.Random(r.crop_seed) if r.spec.random_crop else None


def _shrunk(image: Image.Image, box: Bucket) -> Image.Image:
    """`image` reduced by a whole factor that still leaves it twice the size that covers `box`
    (fit_to_bucket's crop keeps its proportions; the full-size resample is skipped)."""
    factor = int(min(image.width / box[0], image.height / box[1]) // 2)
    return image.reduce(factor) if factor >= 2 else image


def _mask(r: Record) -> Optional[Image.Image]:
    """The record's loss weight as an "L" image (masks folder or alpha; mask_min_weight lifts 0), or
    None where it trains unmasked."""
    d = r.spec
    if d.masks is not None:
        found = masks.find_mask(Path(r.item.path), Path(d.path).expanduser(), Path(d.masks).expanduser())
        mask = masks.load_mask(found) if found is not None else None
    else:
        mask = masks.alpha_of(Path(r.item.path)) if d.alpha_mask else None
    if mask is None or not d.mask_min_weight:
        return mask
    floor = d.mask_min_weight
    return mask.point(lambda v: round(255 * floor + (1 - floor) * v))


def sheet_image(p: Preview) -> Image.Image:
    per = max([len(r.tiles) for r in p.rows] + [0])
    heading = f"vramfit data {p.name}: the first epoch, up to {per} images a bucket"
    return contact_sheet.render(p.rows, heading)


# ---- the reports --------------------------------------------------------------------------------
def _histogram(counts: dict[Bucket, int], indent: str, extra=None) -> list[str]:
    top = max(counts.values(), default=0)
    lines = []
    for (w, h), n in sorted(counts.items()):
        bar = "#" * max(1, round(BAR * n / top)) if n else ""
        tail = f" {extra((w, h)):>14}" if extra else ""
        lines.append(f"{indent}{f'{w}x{h}':>11} {n:>7}{tail}  {bar}")
    return lines


def text_report(p: Preview) -> str:
    lines = []
    for d in p.datasets:
        lines.append(f"{d.where}: {d.path}")
        if d.config.regularization:
            lines.append(f"  regularization: yes, {d.usable} class images; {d.per_epoch} go into the first "
                         "epoch's batches (as many as the other datasets' images of their bucket)")
        else:
            lines.append(f"  usable images: {d.usable}; {d.times}: {_n(d.per_epoch, 'image')} an epoch"
                         + (" (the first; it varies with a fractional weight)" if d.config.weight else ""))
            lines.append("  regularization: no")
        lines.append(f"  held out (validation): {d.held_out}"
                     + (" (the whole dataset: validation = true)" if d.config.validation else ""))
        for what, problems in (("skipped", d.skipped), ("ignored", d.ignored)):
            lines.append(f"  {what}: {len(problems)}")
            lines += [f"    {q.path}: {q.reason}" for q in problems]
        lines.append("  buckets (trained images):")
        lines += _histogram(dict(d.buckets), "  ") or ["    none"]
        if d.tokens:
            lines.append(f"  caption tokens ({d.variants} caption variants):")
            lines += [f"    {t.line()}" for t in d.tokens]
        lines.append("")
    images, batches = _n(sum(p.buckets.values()), "image"), _n(p.micro_batches, "micro-batch")
    lines.append(f"the first epoch: {images} in {batches} at train.batch_size {p.batch_size}"
                 + (f", with {_n(p.class_draws, 'class image')}" if p.class_draws else ""))
    lines.append(f"{'bucket':>11} {'images':>7} {'micro-batches':>14}")
    lines += _histogram(p.buckets, "", p.micro_batches_of)
    lines.append(p.steps)
    lines.append(f"text cache entries: {p.text_entries}")
    lines.append(f"latent cache entries: {p.latent_entries}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("ch") else "s")


def _e(text: object) -> str:
    return html.escape(str(text))


def _table(head: tuple[str, ...], rows: list[tuple]) -> str:
    cells = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def html_report(p: Preview) -> str:
    """The report as one self-contained page: tables, and the tiles as embedded PNGs."""
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>vramfit data {_e(p.name)}</title>",
           "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin:.4em 0}"
           "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}figure{display:inline-block;"
           "vertical-align:top;width:170px;margin:4px}figcaption{font-size:12px}.meta{color:#666}"
           "</style></head><body>", f"<h1>vramfit data {_e(p.name)}</h1>"]
    for d in p.datasets:
        out.append(f"<h2>{_e(d.where)}</h2><p>{_e(d.path)}</p>")
        facts = [("usable images", d.usable), ("how often", d.times),
                 ("images in the first epoch", d.per_epoch), ("held out (validation)", d.held_out),
                 ("regularization", "yes" if d.config.regularization else "no"),
                 ("skipped", len(d.skipped)), ("ignored", len(d.ignored))]
        out.append(_table(("dataset", d.config.label), facts))
        if d.skipped or d.ignored:
            out.append(_table(("file", "skipped or ignored because"),
                              [(q.path, q.reason) for q in (*d.skipped, *d.ignored)]))
        buckets = [(f"{w}x{h}", n) for (w, h), n in sorted(d.buckets.items())]
        out.append(_table(("bucket", "trained images"), buckets))
        if d.tokens:
            out.append(_table(("tokenizer", "min", "median", "max", "limit", "over the limit"),
                              [(t.tokenizer, *t.summary(), t.limit, t.over) for t in d.tokens]))
    out.append("<h2>the run</h2>")
    out.append(_table(("bucket", "images in the first epoch", "micro-batches"),
                      [(f"{w}x{h}", n, p.micro_batches_of((w, h))) for (w, h), n in p.buckets.items()]))
    run = [("micro-batches in the first epoch", p.micro_batches), ("train.batch_size", p.batch_size),
           ("steps", p.steps), ("text cache entries", p.text_entries),
           ("latent cache entries", p.latent_entries)]
    out.append(_table(("the run", ""), run))
    out += [f"<p class='meta'>note: {_e(n)}</p>" for n in p.notes]
    for row in p.rows:
        out.append(f"<h3>{_e(row.title)}</h3><div>")
        for t in row.tiles:
            data = base64.b64encode(contact_sheet.png_bytes(t.picture())).decode("ascii")
            out.append(f"<figure><img src='data:image/png;base64,{data}' alt=''><figcaption>"
                       f"<span class='meta'>{_e(t.heading)}</span><br>{_e(t.shown_caption)}"
                       "</figcaption></figure>")
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)


def write_file(path: Path, option: str, data: bytes | str) -> None:
    """Write one output of the preview whole (or not at all); a path that cannot be written is a
    one-line error naming `option` (what set the path) and the path."""
    if path.is_dir():
        example = path / ("data-preview.html" if isinstance(data, str) else "data-preview.png")
        raise ValueError(f"{option}: {path} is a folder; give a file name, e.g. {example}")
    try:
        if isinstance(data, str):
            write_text_atomic(path, data)
        else:
            with atomic_file(path) as fh:
                fh.write(data)
    except OSError as exc:
        raise ValueError(f"{option}: cannot write {path} ({exc.strerror or exc})") from None
