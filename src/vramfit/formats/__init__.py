"""Family-neutral file formats: safetensors IO, complete key renaming, the LDM VAE and
CLIP/OpenCLIP key maps, LoRA files."""
