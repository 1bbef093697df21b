"""Tiled VAE encoding (cache.vae_tiling): the image is encoded in overlapping tiles, one at a
time, so the encoder's activations are a tile's, not the whole image's. Cost: slower encoding
and slight seams where tiles meet. diffusers' AutoencoderKL does the tiling; this sets the tile
size, since its default would not tile at SDXL's resolutions."""
from __future__ import annotations


def vae_tile(sample_size) -> int:
    """The side in pixels of the tiles cache.vae_tiling encodes: half the VAE's sample_size (512 for
    SDXL's and SD3's VAE). diffusers' default, the whole sample_size, leaves an image of up to
    1024 px on a side untiled, so tiling would save nothing at SDXL's resolutions."""
    side = sample_size[0] if isinstance(sample_size, (list, tuple)) else sample_size
    return int(side) // 2


def set_vae_tiling(vae, tiling: bool) -> None:
    """Tile `vae`'s encoding in tiles of `vae_tile` (overlapping by diffusers' quarter), or not."""
    if not tiling:
        vae.disable_tiling()
        return
    side = vae_tile(vae.config.sample_size)
    vae.tile_sample_min_size = side
    vae.tile_latent_min_size = side // 2 ** (len(vae.config.block_out_channels) - 1)
    vae.enable_tiling()
