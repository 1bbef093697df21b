"""vramfit: fine-tune text-to-image diffusion models inside the GPU memory you have."""
__version__ = "0.1.0"
