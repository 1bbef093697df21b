"""FluxPipeline as vramfit's generate path drives every family's pipeline.

generate.py asks a pipeline for (prompt, negative, pooled, negative pooled) embeddings, starts it
from noise of the denoiser's in_channels at the VAE's scale and decodes the latents it returns
itself. Flux's pipeline returns (prompt, pooled, text ids), packs its latents and returns them
packed; this subclass answers in generate's terms: no negative embeddings (Flux.1 is guidance-
distilled: guidance_scale feeds its guidance embedding, a negative prompt is refused), the
start's first 16 channels are the latent image (packed here), and latents come back unpacked.
kohya Flux LoRAs are read here (models/flux/kohya.py), at any width.
"""
from __future__ import annotations

from pathlib import Path

from diffusers import FluxPipeline
from safetensors.torch import load_file

from vramfit.formats.lora import KOHYA_UNET, kohya_text_encoders_to_diffusers
from vramfit.models.flux.kohya import from_kohya_flux
from vramfit.models.flux.objective import pack


class VramfitFluxPipeline(FluxPipeline):
    """FluxPipeline speaking generate.py's prompt and latent conventions (see the module)."""

    def encode_prompt(self, prompt, prompt_2=None, device=None, num_images_per_prompt: int = 1,
                      prompt_embeds=None, pooled_prompt_embeds=None, max_sequence_length: int = 512,
                      lora_scale=None, negative_prompt=None, do_classifier_free_guidance=None):
        """FluxPipeline's (prompt, pooled, text ids) when it asks itself; generate's four embeddings
        when asked as generate asks (with do_classifier_free_guidance)."""
        if negative_prompt:
            raise ValueError("Flux.1 models take no negative prompt (their guidance is distilled into "
                             "the model: --guidance sets it); leave --negative out")
        own = super().encode_prompt(prompt, prompt_2, device, num_images_per_prompt, prompt_embeds,
                                    pooled_prompt_embeds, max_sequence_length, lora_scale)
        if do_classifier_free_guidance is None:
            return own
        return own[0], None, own[1], None

    def __call__(self, *args, latents=None, height=None, width=None, output_type="pil", **kwargs):
        multiple = self.vae_scale_factor * 2
        for side, value in (("width", width), ("height", height)):
            if value is not None and int(value) % multiple:
                raise ValueError(f"{side} {value} is not a multiple of {multiple}, which Flux.1 needs "
                                 "(VAE factor 8 x 2x2 packing)")
        if latents is not None and latents.ndim == 4:
            channels = self.transformer.config.in_channels // 4
            latents = pack(latents[:, :channels])
        out = super().__call__(*args, latents=latents, height=height, width=width, output_type=output_type,
                               **kwargs)
        if output_type != "latent":
            return out
        images = out[0] if isinstance(out, tuple) else out.images
        h = 2 * (int(height) // (self.vae_scale_factor * 2))
        w = 2 * (int(width) // (self.vae_scale_factor * 2))
        unpacked = self._unpack_latents(images, h * self.vae_scale_factor, w * self.vae_scale_factor,
                                        self.vae_scale_factor)
        return (unpacked,) if isinstance(out, tuple) else type(out)(images=unpacked)

    def load_lora_weights(self, weights, adapter_name=None, **kwargs):
        """diffusers' loader, with kohya's BFL names converted first (its own kohya reader assumes
        the released 3072 width)."""
        state = load_file(str(weights)) if isinstance(weights, (str, Path)) else weights
        if isinstance(state, dict) and any(k.startswith(KOHYA_UNET) for k in state):
            unet = {k: v for k, v in state.items() if k.startswith(KOHYA_UNET)}  # CLIP-L's: lora_te1_
            weights = {**from_kohya_flux(unet, self.transformer.config),
                       **kohya_text_encoders_to_diffusers(state, "the kohya LoRA")}
        return super().load_lora_weights(weights, adapter_name=adapter_name, **kwargs)
