"""Count the activation memory of sampling (no gradients) on the meta device: no GPU, no compute.

A sample grid (train/samples.py) runs the denoiser on both halves of guidance at once, then the
VAE decodes one image. Their weights are counted exactly by the planner; what it needs from here
is the peak of the tensors made while they run, per element, for its `SAMPLE_WORK` and
`VAE_DECODE_BYTES_PER_PIXEL`. This builds the shipped architectures on the meta device, calls them
under a dispatch mode that adds each new storage's bytes while a tensor holds it, and prints the
peak over the call; the weights, buffers and inputs (and views of them) are left out. Attention is counted as a fused kernel (its output only),
as flash attention runs it on a GPU; the math fallback would add the score matrices.

usage: python bench/count_sample_memory.py [--size 1024] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages that the dispatched ops' outputs hold, but for
    `external` storages (weights, buffers, inputs: a transposed weight is a view of one)."""

    def __init__(self, external: set[int]):
        super().__init__()
        self.external = external
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.external:
                    continue
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


def _fused_attention(query, key, value, *args, **kwargs):  # torch's names: diffusers' dispatch passes them so
    return torch.empty(query.shape[:-1] + (value.shape[-1],), dtype=query.dtype, device=query.device)


def _peak(call, module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    external = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers(), *inputs]}
    counter = LiveBytes(external)
    with torch.no_grad(), counter:
        call()
    return counter.peak


def shipped(name: str) -> dict:
    """A shipped architecture's config (src/vramfit/models/configs), as its diffusers class takes it."""
    from vramfit.models.parts import shipped_config

    return {k: v for k, v in shipped_config(name).items() if not k.startswith("_")}


def denoiser_call(name: str, batch: int, lat: int, dtype: torch.dtype):
    """(model, call, inputs) of a shipped denoiser ("ssd1b_unet", "sdxl_unet",
    "sd3_medium_transformer" or "flux1_dev_transformer") built where torch's default device is, and
    one forward of `batch` items of `lat` x `lat` latents on it."""
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel

    cfg = shipped(name)
    if name.startswith("flux"):
        return _flux_call(cfg, batch, lat, dtype)
    if name.endswith("_unet"):
        model = UNet2DConditionModel(**cfg).to(dtype)
        x = torch.empty(batch, 4, lat, lat, dtype=dtype)
        ctx = torch.empty(batch, 77, cfg["cross_attention_dim"], dtype=dtype)
        added = dict(text_embeds=torch.empty(batch, 1280, dtype=dtype), time_ids=torch.empty(batch, 6, dtype=dtype))
        t = torch.tensor([500] * batch)
        return model, lambda: model(x, t, ctx, added_cond_kwargs=added), (x, t, ctx, *added.values())
    model = SD3Transformer2DModel(**cfg).to(dtype)
    x = torch.empty(batch, cfg["in_channels"], lat, lat, dtype=dtype)
    text = torch.empty(batch, 154, cfg["joint_attention_dim"], dtype=dtype)
    pooled = torch.empty(batch, cfg["pooled_projection_dim"], dtype=dtype)
    t = torch.tensor([500.0] * batch)
    return (model, lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, pooled_projections=pooled),
            (x, t, text, pooled))


def _flux_call(cfg: dict, batch: int, lat: int, dtype: torch.dtype):
    """A Flux.1 transformer's forward as models/flux/family.py calls it: packed latents (a token
    per 2x2 patch of 16 channels), the variant's T5 tokens, CLIP-L's pooled vector, dev's guidance."""
    from diffusers import FluxTransformer2DModel

    from vramfit.models.flux.objective import image_ids
    from vramfit.models.flux.variants import default_t5_tokens

    model = FluxTransformer2DModel(**cfg).to(dtype)
    t5 = default_t5_tokens(cfg)
    x = torch.empty(batch, (lat // 2) ** 2, cfg["in_channels"], dtype=dtype)
    text = torch.empty(batch, t5, cfg["joint_attention_dim"], dtype=dtype)
    pooled = torch.empty(batch, cfg["pooled_projection_dim"], dtype=dtype)
    t = torch.empty(batch, dtype=dtype)
    guidance = torch.empty(batch, dtype=dtype) if cfg.get("guidance_embeds") else None
    txt_ids, img_ids = torch.empty(t5, 3, dtype=dtype), image_ids(lat, lat).to(dtype)
    inputs = (x, text, pooled, t, txt_ids, img_ids) + ((guidance,) if guidance is not None else ())
    return (model, lambda: model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled,
                                 timestep=t, guidance=guidance, txt_ids=txt_ids, img_ids=img_ids,
                                 return_dict=False),
            inputs)


# name: (shipped config, family, text tokens its `activations` counts; None: the variant's T5 tokens)
DENOISERS = {"ssd1b": ("ssd1b_unet", "sdxl", 0), "sdxl": ("sdxl_unet", "sdxl", 0),
             "sd3m": ("sd3_medium_transformer", "sd3", 77),
             "flux1_dev": ("flux1_dev_transformer", "flux", None)}


@contextlib.contextmanager
def fused_attention():
    """torch's scaled_dot_product_attention counted as a fused kernel while inside."""
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def count_denoisers(size: int, dtype: torch.dtype, names=tuple(DENOISERS)) -> dict:
    """{name: the sampling forward's peak} of the `names` of DENOISERS at `size` x `size` pixels,
    both halves of guidance at once (batch 2), and its bytes per element of `work` per image."""
    from vramfit.models.flux.variants import default_t5_tokens
    from vramfit.models.registry import FAMILIES

    lat, results = size // 8, {}
    with fused_attention(), torch.device("meta"):
        for name in names:
            model_name, family, tokens = DENOISERS[name]
            model, call, inputs = denoiser_call(model_name, 2, lat, dtype)
            peak = _peak(call, model, *inputs)
            tokens = default_t5_tokens(shipped(model_name)) if tokens is None else tokens
            work = FAMILIES[family].activations(shipped(model_name), lat, lat, tokens).work
            results[name] = dict(denoiser_batch2_gib=peak / GIB,
                                 bytes_per_work_element_per_image=peak / (2 * work))
    return results


def main() -> None:
    from diffusers import AutoencoderKL

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    lat = args.size // 8
    results = count_denoisers(args.size, dtype)
    with fused_attention(), torch.device("meta"):
        for name in ("sdxl_vae", "sd3_vae", "flux_vae"):
            vae = AutoencoderKL(**shipped(name)).to(dtype)
            z = torch.empty(1, vae.config.latent_channels, lat, lat, dtype=dtype)
            peak = _peak(lambda: vae.decode(z), vae, z)
            results[name] = dict(decode_gib=peak / GIB, bytes_per_pixel=peak / args.size**2)
    print(json.dumps(dict(size=args.size, dtype=args.dtype, **results), indent=1))


if __name__ == "__main__":
    main()
