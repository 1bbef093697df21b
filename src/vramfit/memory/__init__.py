"""Memory techniques and measurement."""
