"""The run's datasets: from [data] (one folder), [[data.datasets]] or a kohya config, each scanned.

Every dataset is a DatasetConfig with all its keys resolved ([data]'s values fill what it leaves
out). A kohya dataset TOML or train_data_dir (data.kohya) is read here, in the data layer, so the
config stays pure data and the resolved datasets are the same objects a vramfit config gives.
`dataset_problems` is what the commands check before any weight loads: missing folders, two
datasets on one folder, a kohya config vramfit cannot follow, each naming the dataset and key.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from vramfit.config.schema import DATASET_DEFAULTS, DataConfig, DatasetConfig, RunConfig, inherit
from vramfit.data import masks
from vramfit.data.kohya import KohyaImport, KohyaImportError, kohya_datasets
from vramfit.data.scan import Problem, ScanResult, scan_dataset

log = logging.getLogger("vramfit.data")


@dataclass
class ScannedDataset:
    """One dataset's resolved config and what its scan found."""

    index: int
    config: DatasetConfig
    result: ScanResult
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = f"data.datasets[{self.index}]"

    @property
    def where(self) -> str:
        """How messages name the dataset: its key and its name."""
        return f"{self.key} ({self.config.label!r})"


def read_kohya(data: DataConfig) -> Optional[KohyaImport]:
    """data.kohya (and data.kohya_reg) read; None without it. Raises KohyaImportError."""
    if not data.kohya:
        return None
    return kohya_datasets(Path(data.kohya).expanduser(), Path(data.kohya_reg).expanduser() if data.kohya_reg else None)


def dataset_configs(data: DataConfig, kohya: Optional[KohyaImport] = None) -> list[DatasetConfig]:
    """The run's datasets, resolved; data.kohya is read here unless `kohya` is that already read
    (KohyaImportError when vramfit cannot follow it)."""
    if not data.kohya:
        return data.dataset_list()
    found = kohya or read_kohya(data)
    for note in found.notes:
        log.warning("data.kohya: %s", note)
    base = {k: getattr(data, k) for k in DATASET_DEFAULTS}
    out = []
    for i, entry in enumerate(found.datasets):
        try:
            out.append(inherit(DatasetConfig(**entry), base))
        except ValidationError as exc:
            what = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise KohyaImportError(f"data.kohya ({data.kohya}): dataset {i + 1} ({entry.get('path')}): {what}")
    return out


def dataset_problems(cfg: RunConfig) -> list[str]:
    """What is wrong with the datasets that the schema cannot see: folders that are not there, two
    datasets on one folder, a kohya config vramfit cannot follow."""
    try:
        found = read_kohya(cfg.data)
        configs = dataset_configs(cfg.data, found)
    except (KohyaImportError, OSError) as exc:
        return [str(exc)]
    problems = []
    if found is not None:
        size = found.train.get("batch_size")
        if size is not None and size != cfg.train.batch_size:
            problems.append(f"data.kohya: {cfg.data.kohya} sets batch_size = {size}, the run's train.batch_size "
                            f"is {cfg.train.batch_size}: set train.batch_size = {size} (one batch size a run)")
    seen: dict[str, str] = {}
    short = not cfg.data.datasets and not cfg.data.kohya
    for i, d in enumerate(configs):
        # config.load names a data.datasets entry by its name too; a kohya one is named here
        key = "data" if short else f"data.datasets[{i}]" if cfg.data.datasets else f"data.kohya ({d.label!r})"
        folder = Path(d.path).expanduser()
        if not folder.is_dir():  # the short form's data.path and data.metadata: config/load.py check_paths
            if not short:
                problems.append(f"{key}.path: {d.path} is {'not a folder' if folder.exists() else 'not there'}")
            continue
        real = os.path.realpath(folder)
        if real in seen:
            problems.append(f"{key}.path: {d.path} is the folder of {seen[real]} too; a folder is one dataset "
                            "(give it more repeats instead of a second entry)")
        seen.setdefault(real, key)
        if d.masks is not None and not Path(d.masks).expanduser().is_dir():
            problems.append(f"{key}.masks: {d.masks} is not a folder")
        elif d.masks is not None and Path(os.path.realpath(Path(d.masks).expanduser())).is_relative_to(real):
            problems.append(f"{key}.masks: {d.masks} lies inside the dataset's folder {d.path}, whose images "
                            "it would join; keep the masks in a folder of their own")
        if d.metadata is not None and not short:
            meta = Path(d.metadata).expanduser()
            if not meta.is_file() and not (folder / d.metadata).is_file():
                problems.append(f"{key}.metadata: {d.metadata} does not exist")
    if configs and all(d.validation for d in configs):
        problems.append("data.datasets: every dataset is a validation dataset; nothing would train")
    return problems


def scan_datasets(cfg: RunConfig) -> list[ScannedDataset]:
    """Scan every dataset (skipped and ignored entries are logged, naming the dataset); raises when
    one has no usable image, naming it."""
    out = []
    short = not cfg.data.datasets and not cfg.data.kohya
    for i, d in enumerate(dataset_configs(cfg.data)):
        result = scan_one(d)
        scanned = ScannedDataset(i, d, result)
        label = "" if short else f"{scanned.where}: "
        for p in result.problems:
            log.warning("%sskipping %s: %s", label, p.path, p.reason)
        for p in result.ignored:
            log.warning("%signored: %s: %s", label, p.path, p.reason)
        if not result.items:
            raise ValueError(f"{'data.path' if short else scanned.where}: {result.nothing_usable(d.path)}")
        out.append(scanned)
    return out


def scan_one(d: DatasetConfig) -> ScanResult:
    """The scan of one dataset, masks checked where it trains masked."""
    root = Path(d.path).expanduser()
    folder = Path(d.masks).expanduser() if d.masks is not None else None

    def check(image: Path, root: Path, size: tuple[int, int]) -> Optional[str]:
        return masks.mask_problem(image, size, root, folder)
    caption = d.class_prompt if d.regularization else d.instance_prompt
    return scan_dataset(root, metadata=Path(d.metadata).expanduser() if d.metadata else None,
                        caption_extension=d.caption_extension, min_size=d.min_size, max_pixels=d.max_pixels,
                        instance_prompt=caption, default_caption=d.default_caption,
                        item_problem=check if folder is not None else None)


def combined(datasets: list[ScannedDataset]) -> ScanResult:
    """One ScanResult of every dataset (run.json, the summary); with several datasets each skipped
    or ignored path is prefixed by its dataset's name."""
    several = len(datasets) > 1
    out = ScanResult(source=datasets[0].result.source if datasets else "captions")
    for ds in datasets:
        out.items += ds.result.items
        for src, dst in ((ds.result.problems, out.problems), (ds.result.ignored, out.ignored)):
            dst += [Problem(f"{ds.config.label}/{p.path}", p.reason) if several else p for p in src]
    return out
