"""What bf16 weights lose, and what stochastic rounding gives back: a student UNet trained toward
its teacher. Not run in CI.

A UNet of a real architecture (default: SSD-1B's, from vramfit's shipped config; --tiny: the
tiny SDXL UNet, on the CPU) gets random weights: the teacher. The student starts as the teacher
plus a small seeded perturbation of every weight (--perturb times each tensor's standard
deviation) and is trained toward the teacher's outputs on fixed random inputs (latents,
timesteps, text embeddings, time ids) with an MSE loss, for --steps steps, with vramfit's own
optimizers (optim/build.py) at each learning rate, in three weight precisions:

  fp32        fp32 master weights, forward under bf16 autocast (vramfit's mixed_bf16)
  bf16_rtn    bf16 weights, updates written back rounded to nearest (stochastic_rounding off)
  bf16_sr     bf16 weights, updates written back with stochastic rounding (vramfit's default)

Every case sees the same inputs and the same start (the bf16 cases start from it rounded to
nearest). Reported per case: the loss at the start and after the last step (a no-grad forward
in the case's own precision), its ratio to the fp32-master case's, and seconds per step. The
JSON is rewritten after each case, so a run cut short keeps what it finished. (Distance to the
teacher's weights is not reported: with fixed inputs the loss falls along directions that do
not lead back to the teacher, so that distance hardly moves in any case.)

usage: python bench/precision.py --out DIR [--tiny] [--steps N] [--lrs 1e-6 1e-5]
                                 [--optimizers adafactor adamw] [--latent 64]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PRECISIONS = ("fp32", "bf16_rtn", "bf16_sr")


def quiet_diffusers() -> None:
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # each .to(bf16) warns about modules kept in fp32: none here


def log(msg: str) -> None:
    print(time.strftime("[%H:%M:%S] ", time.gmtime()) + msg, flush=True)


def build_unet(name: str, device: torch.device):
    from diffusers import UNet2DConditionModel

    from vramfit.models.parts import shipped_config

    cfg = shipped_config(name)
    torch.manual_seed(0)
    with torch.device(device):
        return UNet2DConditionModel(**cfg), cfg


def fixed_inputs(cfg: dict, batch: int, latent: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    side = latent * 8
    inputs = {
        "sample": torch.randn(batch, cfg["in_channels"], latent, latent, generator=g),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, 77, cfg["cross_attention_dim"], generator=g),
        "text_embeds": torch.randn(batch, pooled, generator=g),
        "time_ids": torch.tensor([[side, side, 0, 0, side, side]] * batch, dtype=torch.float32),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def predict(unet, inputs: dict, dtype: torch.dtype, autocast: bool) -> torch.Tensor:
    device = inputs["sample"].device
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else torch.autocast(device.type, enabled=False)
    with ctx:
        return unet(inputs["sample"].to(dtype), inputs["timestep"], inputs["encoder_hidden_states"].to(dtype),
                    added_cond_kwargs={"text_embeds": inputs["text_embeds"].to(dtype),
                                       "time_ids": inputs["time_ids"].to(dtype)}).sample.float()


def perturbed(teacher: dict, scale: float) -> dict:
    g = torch.Generator().manual_seed(2)
    out = {}
    for name, w in teacher.items():
        noise = torch.randn(w.shape, generator=g).to(w.device)
        out[name] = w + scale * (w.float().std() if w.numel() > 1 else w.abs().clamp(min=1e-3)) * noise
    return out


def run_case(unet, start: dict, inputs: dict, target: torch.Tensor, optimizer: str, lr: float,
             precision: str, steps: int) -> dict:
    from vramfit.config.schema import TrainConfig
    from vramfit.optim.build import build_optimizer

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    autocast = precision == "fp32"
    unet.to(torch.float32).load_state_dict(start)
    unet.to(dtype)
    cfg = TrainConfig(optimizer=optimizer, lr=lr, stochastic_rounding=precision == "bf16_sr", seed=0)
    opt = build_optimizer(unet.parameters(), cfg)
    with torch.no_grad():
        loss_start = float((predict(unet, inputs, dtype, autocast) - target).pow(2).mean())
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = (predict(unet, inputs, dtype, autocast) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if inputs["sample"].is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        loss_end = float((predict(unet, inputs, dtype, autocast) - target).pow(2).mean())
    del opt
    return {"optimizer": optimizer, "lr": lr, "precision": precision, "steps": steps,
            "loss_start": loss_start, "loss_end": loss_end, "seconds_per_step": seconds / max(steps, 1)}


def table(results: list[dict]) -> str:
    """Markdown; `vs fp32` is the loss after N steps over the fp32-master case's (same optimizer, lr)."""
    fp32 = {(r["optimizer"], r["lr"]): r["loss_end"] for r in results if r["precision"] == "fp32"}
    rows = ["| optimizer | lr | weights | loss at start | loss after N | vs fp32 | s/step |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        ref = fp32.get((r["optimizer"], r["lr"]))
        ratio = f"{r['loss_end'] / ref:.3f}" if ref else "-"
        rows.append(f"| {r['optimizer']} | {r['lr']:g} | {r['precision']} | {r['loss_start']:.4g} | "
                    f"{r['loss_end']:.4g} | {ratio} | {r['seconds_per_step']:.3f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny SDXL UNet on the CPU")
    ap.add_argument("--steps", type=int, default=None, help="default 40 (tiny: 30)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--optimizers", nargs="+", default=["adafactor", "adamw"],
                    choices=["adafactor", "adamw", "adamw8bit"])
    ap.add_argument("--latent", type=int, default=None, help="latent side (default 64; tiny: 8)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--perturb", type=float, default=0.05, help="perturbation, times each tensor's std")
    args = ap.parse_args()
    quiet_diffusers()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    steps = args.steps or (30 if args.tiny else 40)
    latent = args.latent or (8 if args.tiny else 64)
    unet, cfg = build_unet("tiny_sdxl_unet" if args.tiny else "ssd1b_unet", device)
    unet.requires_grad_(True)
    n_params = sum(p.numel() for p in unet.parameters())
    log(f"{'tiny SDXL' if args.tiny else 'SSD-1B'} UNet, {n_params / 1e6:.1f}M parameters, on {device}; "
        f"latents {latent}x{latent}, batch {args.batch}, {steps} steps per case")
    inputs = fixed_inputs(cfg, args.batch, latent, device)
    with torch.no_grad():
        target = predict(unet, inputs, torch.float32, autocast=False)
        start = perturbed(unet.state_dict(), args.perturb)  # fresh tensors; the teacher is not kept
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("precision_tiny_cpu.json" if args.tiny else "precision.json")
    meta = {"model": "tiny_sdxl_unet" if args.tiny else "ssd1b_unet", "device": str(device),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "params": n_params,
            "latent": latent, "batch": args.batch, "steps": steps, "perturb": args.perturb,
            "torch": torch.__version__}
    results: list[dict] = []
    for optimizer in args.optimizers:
        for lr in args.lrs:
            for precision in PRECISIONS:
                results.append(run_case(unet, start, inputs, target, optimizer, lr, precision, steps))
                r = results[-1]
                log(f"{optimizer} lr {lr:g} {precision}: loss {r['loss_start']:.6g} -> {r['loss_end']:.6g}, "
                    f"{r['seconds_per_step']:.3f} s/step")
                path.write_text(json.dumps({"meta": meta, "results": results, "table": table(results)}, indent=2))
    print(table(results))
    log(f"written {path}")


if __name__ == "__main__":
    main()
