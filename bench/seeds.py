"""The seed recipes and the stock "fast" configuration, re-created with stock parts, and the
FLOP count of one training step of each workload.

Adapted from the project's reference script (../shared/reference/seed_baseline.py): the same
cases, built here from the architecture configs vramfit ships (so seed and vramfit rows train the
same architecture), with the reference workloads in one table. Random weights: memory and speed
of training do not depend on the weight values. Each call measures one case in this fresh
process and prints one JSON line.

usage: python bench/seeds.py WORKLOAD CASE [--tiny] [--steps N]
       python bench/seeds.py WORKLOAD flops [--tiny]

Cases (see seed-baselines.md):
  unet workloads (ssd1b, sdxl): seed (bf16 weights, gradient checkpointing, transformers'
    Adafactor), fused (the same with the step per parameter inside backward), fast (fp32 master
    weights, bf16 autocast, fused torch AdamW, no checkpointing)
  sd3 LoRA workloads: seed (VAE encoding every step, 8-bit AdamW, checkpointing), cached (latents
    cached), fast (cached, no checkpointing)
  sd3 full fine-tune: fused (Adafactor inside backward, bf16, checkpointing), fast (as above)
  flux LoRA: stock (diffusers' train_dreambooth_lora_flux.py defaults: bf16 transformer and VAE,
    VAE encoding every step, fp32 LoRA on the attention projections, torch AdamW, no
    checkpointing, guidance 3.5, 512 T5 tokens precomputed), stock_ckpt (the same with the script's
    --gradient_checkpointing, where the stock one does not fit the GPU); cuDNN's fused attention
    left out of torch's choices, as vramfit does (train/setup.py `use_attention_kernels`): with it,
    torch 2.11 / CUDA 13 faults on Flux.1's attention on an H100 and the recipe cannot run at all
8-bit AdamW is bitsandbytes' where it is installed (and CUDA is there), else torchao's AdamW8bit;
the row says which.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from contextlib import nullcontext
from typing import Callable, Optional

import torch

# Reference workloads. kind: the model; res/batch: the training shape; mode: full or lora.
WORKLOADS = {
    "ssd1b": dict(kind="unet", layout="ssd1b", res=1024, batch=1, mode="full",
                  title="SSD-1B full fine-tune, 1024, batch 1"),
    "sdxl": dict(kind="unet", layout="sdxl", res=1024, batch=1, mode="full",
                 title="SDXL full fine-tune, 1024, batch 1"),
    "sd3_lora512": dict(kind="sd3", layout="sd3m", res=512, batch=4, mode="lora",
                        title="SD3-Medium LoRA r4, 512, batch 4"),
    "sd3_lora1024": dict(kind="sd3", layout="sd3m", res=1024, batch=1, mode="lora",
                         title="SD3-Medium LoRA r4, 1024, batch 1"),
    "sd3_full": dict(kind="sd3", layout="sd3m", res=1024, batch=1, mode="full",
                     title="SD3-Medium full fine-tune, 1024, batch 1"),
    "flux_lora1024": dict(kind="flux", layout="flux1dev", res=1024, batch=1, mode="lora", rank=16,
                          title="Flux.1-dev LoRA r16, 1024, batch 1"),
}
# Seed cases per workload; the first is the seed recipe the memory-saving targets compare with,
# "fast" the stock configuration the fastest vramfit configuration compares with.
SEED_CASES = {"ssd1b": ["seed", "fused", "fast"], "sdxl": ["seed", "fused", "fast"],
              "sd3_lora512": ["seed", "cached", "fast"], "sd3_lora1024": ["cached", "fast"],
              "sd3_full": ["fused", "fast"], "flux_lora1024": ["stock", "stock_ckpt"]}
TINY_RES = 64
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
CONTEXT_TOKENS = 154  # SD3: 77 CLIP + 77 T5 tokens (max_sequence_length 77, as the write-up)
FLUX_TOKENS = 512  # Flux.1-dev: T5 tokens (the diffusers script's max_sequence_length)
FLUX_GUIDANCE = 3.5


def configs(layout: str, tiny: bool) -> tuple[dict, Optional[dict]]:
    """(denoiser config, VAE config) shipped with vramfit; the VAE only for SD3's live-VAE seed."""
    from vramfit.models.parts import shipped_config

    pre = "tiny_" if tiny else ""
    if layout == "flux1dev":
        return (shipped_config("tiny_flux_transformer" if tiny else "flux1_dev_transformer"),
                shipped_config(f"{pre}flux_vae"))
    if layout == "sd3m":
        return (shipped_config("tiny_sd3_transformer" if tiny else "sd3_medium_transformer"),
                shipped_config(f"{pre}sd3_vae"))
    return shipped_config(f"{pre}{layout}_unet"), None


class Bench:
    """One case: the model, its inputs, its optimizer, timed steps and peak memory."""

    def __init__(self, workload: str, tiny: bool, device: str):
        self.w = dict(WORKLOADS[workload], name=workload)
        self.tiny, self.device = tiny, device
        self.res = TINY_RES if tiny else self.w["res"]
        self.bs = self.w["batch"]
        self.cfg, self.vae_cfg = configs(self.w["layout"], tiny)

    # -- models ------------------------------------------------------------------------------
    def build(self, dtype: torch.dtype, device: Optional[str] = None) -> torch.nn.Module:
        from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

        cls = {"sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel}.get(self.w["kind"], UNet2DConditionModel)
        torch.manual_seed(0)
        with torch.device(device or self.device):
            model = cls(**self.cfg)
        return model.to(dtype)

    def add_lora(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        from peft import LoraConfig

        model.requires_grad_(False)
        rank = self.w.get("rank", 4)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                     target_modules=LORA_TARGETS))
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # LoRA weights in fp32 over the bf16 base, as the write-up's script
            p.data = p.data.float()
        return params

    # -- inputs ------------------------------------------------------------------------------
    def latents(self, device: str, dtype: torch.dtype) -> torch.Tensor:
        ch = self.cfg["in_channels"] // (4 if self.w["kind"] == "flux" else 1)  # Flux: 2x2-packed channels
        lat = self.res // 8
        return torch.randn(self.bs, ch, lat, lat, device=device, dtype=dtype)

    def forward(self, model, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The denoiser on noisy latents x with random conditioning of the right shapes."""
        dev, bs = x.device, x.shape[0]
        if self.w["kind"] == "flux":
            return self.flux_forward(model, x, dtype)
        if self.w["kind"] == "sd3":
            sig = torch.rand(bs, device=dev)
            return model(hidden_states=x, timestep=sig * 1000,
                         encoder_hidden_states=torch.randn(bs, CONTEXT_TOKENS, self.cfg["joint_attention_dim"],
                                                           device=dev, dtype=dtype),
                         pooled_projections=torch.randn(bs, self.cfg["pooled_projection_dim"], device=dev,
                                                        dtype=dtype)).sample
        pooled = self.cfg["projection_class_embeddings_input_dim"] - 6 * self.cfg["addition_time_embed_dim"]
        res = self.res
        added = dict(text_embeds=torch.randn(bs, pooled, device=dev, dtype=dtype),
                     time_ids=torch.tensor([[res, res, 0, 0, res, res]] * bs, device=dev, dtype=dtype))
        return model(x, torch.randint(0, 1000, (bs,), device=dev),
                     torch.randn(bs, 77, self.cfg["cross_attention_dim"], device=dev, dtype=dtype),
                     added_cond_kwargs=added).sample

    def flux_forward(self, model, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Flux's transformer on 2x2-packed latents, with its position ids and the dev guidance; the
        prediction unpacked to the latents' shape."""
        dev, (bs, ch, h, w) = x.device, x.shape
        packed = x.view(bs, ch, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(bs, h * w // 4, ch * 4)
        img_ids = torch.zeros(h // 2, w // 2, 3, device=dev)
        img_ids[..., 1] += torch.arange(h // 2, device=dev)[:, None]
        img_ids[..., 2] += torch.arange(w // 2, device=dev)[None, :]
        guidance = torch.full((bs,), FLUX_GUIDANCE, device=dev) if self.cfg.get("guidance_embeds") else None
        out = model(hidden_states=packed, timestep=torch.rand(bs, device=dev), guidance=guidance,
                     encoder_hidden_states=torch.randn(bs, FLUX_TOKENS, self.cfg["joint_attention_dim"],
                                                       device=dev, dtype=dtype),
                     pooled_projections=torch.randn(bs, self.cfg["pooled_projection_dim"], device=dev, dtype=dtype),
                     img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(FLUX_TOKENS, 3, device=dev)).sample
        return out.view(bs, h // 2, w // 2, ch, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(bs, ch, h, w)

    # -- one case ----------------------------------------------------------------------------
    def run(self, case: str, steps: int) -> dict:
        fast = case == "fast"
        stock = case in ("stock", "stock_ckpt")  # the diffusers Flux script's defaults (+ its checkpointing flag)
        dtype = torch.float32 if fast and self.w["mode"] == "full" else torch.bfloat16
        model = self.build(dtype)
        n_params = sum(p.numel() for p in model.parameters())
        info: dict = {}
        if stock:
            opt = torch.optim.AdamW(self.add_lora(model), lr=1e-4, weight_decay=1e-4)
            info["optimizer"] = "torch AdamW"
        elif self.w["mode"] == "lora":
            opt, info["optimizer"] = adam8bit(self.add_lora(model), self.device)
        elif fast:
            cuda = self.device == "cuda"
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
            info["optimizer"] = "torch AdamW, fused" if cuda else "torch AdamW"
        elif case == "fused":
            fuse_adafactor(model)
            opt, info["optimizer"] = None, "transformers Adafactor, per parameter inside backward"
        else:
            opt, info["optimizer"] = adafactor(model.parameters()), "transformers Adafactor"
        if not (fast or case == "stock"):
            model.enable_gradient_checkpointing()
        model.train()
        vae = self.live_vae() if (case == "seed" and self.w["kind"] == "sd3") or stock else None
        mixed = fast and self.w["mode"] == "full"  # fp32 master weights under bf16 autocast
        autocast = torch.autocast(self.device, dtype=torch.bfloat16) if mixed else nullcontext()
        in_dtype = torch.bfloat16

        def step() -> None:
            x = self.encode(vae) if vae is not None else self.latents(self.device, in_dtype)
            noise = torch.randn_like(x)
            with autocast:
                pred = self.forward(model, x + noise, in_dtype)
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)

        try:
            times = timed_steps(step, steps, self.device)
        except RuntimeError as exc:  # a recipe that does not run here is a row too: what failed, at what peak
            return dict(case=case, params_m=round(n_params / 1e6, 1), error=f"{type(exc).__name__}: {exc}"[:600],
                        **info, **peak(self.device))
        return dict(case=case, params_m=round(n_params / 1e6, 1), images_per_step=self.bs, steps=steps,
                    step_times=[round(t, 4) for t in times], step_s=round(statistics.median(times[1:] or times), 4),
                    **info, **peak(self.device))

    def live_vae(self) -> torch.nn.Module:
        from diffusers import AutoencoderKL

        with torch.device(self.device):
            vae = AutoencoderKL(**self.vae_cfg)  # fp32, as the diffusers SD3 script runs it
        vae.requires_grad_(False)
        return vae.to(torch.bfloat16) if self.w["kind"] == "flux" else vae  # the Flux script: weight dtype

    def encode(self, vae) -> torch.Tensor:
        with torch.no_grad():
            px = torch.randn(self.bs, 3, self.res, self.res, device=self.device, dtype=vae.dtype)
            return vae.encode(px).latent_dist.sample().to(torch.bfloat16)

    # -- FLOPs -------------------------------------------------------------------------------
    def count_flops(self) -> dict:
        """FLOPs of one training step (forward + backward, no recomputation: model FLOPs), counted
        by FlopCounterMode on the meta device (no memory, no time); on the case's device if an op
        has no meta kernel."""
        from torch.utils.flop_counter import FlopCounterMode

        for device in ("meta", self.device):
            try:
                model = self.build(torch.bfloat16, device)
                if self.w["mode"] == "lora":
                    self.add_lora(model)
                x = self.latents(device, torch.bfloat16)
                with FlopCounterMode(display=False) as fwd:
                    pred = self.forward(model, x, torch.bfloat16)
                with FlopCounterMode(display=False) as bwd:
                    pred.float().pow(2).mean().backward()
                return dict(counted_on=device, fwd_tflop=fwd.get_total_flops() / 1e12,
                            train_tflop=(fwd.get_total_flops() + bwd.get_total_flops()) / 1e12)
            except (NotImplementedError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
        raise RuntimeError(f"FLOP count failed: {error}")


def adafactor(params, lr: float = 4e-7):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def fuse_adafactor(model: torch.nn.Module) -> dict:
    """Per-parameter Adafactor step inside backward; each gradient freed at once."""
    opts = {}
    for p in model.parameters():
        if p.requires_grad:
            opts[p] = adafactor([p])

            def hook(t):
                opts[t].step()
                t.grad = None

            p.register_post_accumulate_grad_hook(hook)
    return opts


def adam8bit(params, device: str):
    """bitsandbytes' AdamW8bit (the write-up's --use_8bit_adam) where it can run, else torchao's."""
    if device == "cuda":
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=1e-4), "bitsandbytes AdamW8bit"
        except ImportError:
            pass
    from torchao.optim import AdamW8bit

    why = "bitsandbytes not installed" if device == "cuda" else "CPU run"
    return AdamW8bit(params, lr=1e-4), f"torchao AdamW8bit ({why})"


def timed_steps(step: Callable[[], None], steps: int, device: str) -> list[float]:
    reset(device)
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak(device: str) -> dict:
    if device != "cuda":
        return dict(peak_allocated=None, peak_reserved=None)
    return dict(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("case")
    ap.add_argument("--tiny", action="store_true", help="tiny models at 64x64 on the CPU")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    bench = Bench(args.workload, args.tiny, device)
    if device == "cuda" and WORKLOADS[args.workload]["kind"] == "flux":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.case == "flops":
        result = bench.count_flops()
    elif args.case in SEED_CASES[args.workload]:
        result = bench.run(args.case, args.steps)
    else:
        raise SystemExit(f"unknown case {args.case!r} for {args.workload}; one of {SEED_CASES[args.workload]} or flops")
    result.update(workload=args.workload, device=device, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name() if device == "cuda" else None)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
