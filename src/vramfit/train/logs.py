"""Progress bar, TensorBoard and (when asked for and installed) wandb logging of a run.

Every step's time and images per second (batch x accumulation / step time) go to the progress
line, TensorBoard and wandb; without a progress bar a log line reports them about ten times a run,
and the end of training logs the median (the first step, with its warm-up, left out).
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from vramfit.config.schema import RunConfig

log = logging.getLogger("vramfit")


class RunLogger:
    def __init__(self, cfg: RunConfig, out: Path, progress: bool, device: torch.device, start_step: int = 0,
                 *, world: int = 1, main: bool = True):
        self.device, self.main = device, main
        # The global batch: every one of `world` ranks trains batch x accumulation per step; only
        # the main rank writes TensorBoard and wandb.
        self.images_per_step = cfg.train.batch_size * cfg.train.grad_accum * world
        self.bar = None
        if progress:
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True)
        self.tb = None
        if cfg.logging.tensorboard and main:
            self.tb = SummaryWriter(log_dir=str(out / "logs"))
        self.wandb = None
        if cfg.logging.wandb and main:
            # optional: wandb
            import wandb

            self.wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(out),
                                    config=cfg.model_dump(mode="json"))
        self.total = cfg.train.steps
        self.every = max(1, (cfg.train.steps - start_step) // 10)
        self.seconds: list[float] = []
        self.last = time.perf_counter()

    def step(self, step: int, loss: float, lr: float) -> None:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.seconds.append(seconds)
        rate = self.images_per_step / max(seconds, 1e-9)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        if self.bar is not None:
            post = {"loss": f"{loss:.4f}", "s/step": f"{seconds:.2f}", "img/s": f"{rate:.2f}"}
            if peak is not None:
                post["peak"] = f"{peak:.2f}G"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
        elif self.main and (len(self.seconds) % self.every == 0 or step == self.total):
            log.info("step %d/%d: loss %.4f, %.3f s/step, %.2f img/s%s", step, self.total, loss, seconds, rate,
                     f", peak {peak:.2f} GiB" if peak is not None else "")
        if self.tb is not None:
            self.tb.add_scalar("train/loss", loss, step)
            self.tb.add_scalar("train/lr", lr, step)
            self.tb.add_scalar("train/step_seconds", seconds, step)
            self.tb.add_scalar("train/images_per_second", rate, step)
        if self.wandb is not None:
            self.wandb.log({"loss": loss, "lr": lr, "step_seconds": seconds, "images_per_second": rate}, step=step)

    def validation(self, step: int, loss: float, seconds: float) -> None:
        """The validation loss of `step` (its time is left out of the next step's)."""
        if self.main:
            message = f"step {step}: validation loss {loss:.4f} ({seconds:.1f} s)"
            if self.bar is not None:
                self.bar.write(message)
            else:
                log.info("%s", message)
        if self.tb is not None:
            self.tb.add_scalar("validation/loss", loss, step)
        if self.wandb is not None:
            self.wandb.log({"validation_loss": loss}, step=step)
        self.last = time.perf_counter()

    def median_step(self) -> float | None:
        """Median seconds per step, the first (warm-up) step left out when there are others."""
        times = self.seconds[1:] or self.seconds
        return statistics.median(times) if times else None

    def close(self) -> None:
        if self.bar is not None:  # first, so that the line below comes after the bar, not inside it
            self.bar.close()
        median = self.median_step()
        if median and self.main:
            log.info("trained %d steps: median %.3f s/step, %.2f images/s", len(self.seconds), median,
                     self.images_per_step / median)
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
