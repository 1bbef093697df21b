"""Key maps between single-file checkpoint layouts (SGM/LDM/OpenCLIP) and diffusers/transformers."""
