"""Progress bar, TensorBoard and (when asked for and installed) wandb logging of a run."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from vramfit.config.schema import RunConfig


class RunLogger:
    def __init__(self, cfg: RunConfig, out: Path, progress: bool, device: torch.device, start_step: int = 0):
        self.device = device
        self.images_per_step = cfg.train.batch_size * cfg.train.grad_accum
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True)
        self.tb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "logs"))
        self.wandb = None
        if cfg.logging.wandb:
            import wandb

            self.wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(out),
                                    config=cfg.model_dump(mode="json"))
        self.last = time.perf_counter()

    def step(self, step: int, loss: float, lr: float) -> None:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        if self.bar is not None:
            post = {"loss": f"{loss:.4f}", "s/step": f"{seconds:.2f}",
                    "img/s": f"{self.images_per_step / max(seconds, 1e-9):.2f}"}
            if peak is not None:
                post["peak"] = f"{peak:.2f}G"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
        if self.tb is not None:
            self.tb.add_scalar("train/loss", loss, step)
            self.tb.add_scalar("train/lr", lr, step)
            self.tb.add_scalar("train/step_seconds", seconds, step)
        if self.wandb is not None:
            self.wandb.log({"loss": loss, "lr": lr, "step_seconds": seconds}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
