"""Model families, sources (single file, diffusers folder, hub, tiny) and their loading."""
