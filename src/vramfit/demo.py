"""`vramfit demo`: the whole job on a built-in tiny model and generated images.

Generates a small captioned image set, caches it, fine-tunes tiny:ssd1b, saves a single file
and a memory report: the same code path as `vramfit train`, sized to run in about a minute on
two CPU cores (and on the GPU when there is one).
"""
from __future__ import annotations

from pathlib import Path

from vramfit.config import load_config
from vramfit.config.load import folder_problem
from vramfit.data.synth import make_synthetic_dataset

DEMO_SIZE = 128
DEMO_IMAGES = 16


def demo_overrides(output: Path, steps: int) -> list[str]:
    return [
        "model.path=tiny:ssd1b", f"data.path={output / 'images'}", f"data.resolution={DEMO_SIZE}",
        f"data.min_size={DEMO_SIZE}", "data.bucket_step=32", f"cache.dir={output / 'cache'}",
        f"train.steps={steps}", "train.grad_accum=2", "train.lr=1e-4", "train.optimizer=adafactor",
        "train.precision=full_bf16", "train.gradient_checkpointing=true", "train.lr_scheduler=cosine",
        f"train.warmup_steps={max(1, steps // 10)}", "save.formats=['single_file']",
        f"save.every_steps={max(1, steps // 2)}", f"output.dir={output / 'run'}", "save.name=tiny-ssd1b-demo",
    ]


def run_demo(output: Path, steps: int = 30, progress: bool = True):
    from vramfit.run import train_run

    output = Path(output)
    problem = folder_problem("--output", str(output))  # before anything is written or loaded
    if problem:
        raise ValueError(problem)
    images = output / "images"
    # each caption is written after its image: all captions there means a whole set (a stopped demo
    # may have left part of one, which is made again, the same)
    if not all((images / f"{i:04d}.txt").is_file() for i in range(DEMO_IMAGES)):
        make_synthetic_dataset(images, n=DEMO_IMAGES, size=DEMO_SIZE, seed=0)
    cfg = load_config(None, demo_overrides(output, steps))
    return train_run(cfg, progress=progress, warn_earlier=False)  # a demo starts over by design
