"""The tiny models (`tiny:<name>`) and their families, without torch: the config check and the
error messages read them before anything heavy is imported."""
from __future__ import annotations

import difflib

# Every tiny model and its family: the one list that messages, the config check and
# sources.py read. The SDXL-family ones are built in tiny.py, tiny:sd3 in tiny_sd3.py.
TINY_MODELS = {"sdxl": "sdxl", "ssd1b": "sdxl", "sd3": "sd3"}


def tiny_choices() -> str:
    """Every tiny model as model.path spells it, for messages: "tiny:sdxl, tiny:ssd1b, tiny:sd3"."""
    return ", ".join(f"tiny:{name}" for name in TINY_MODELS)


def unknown_tiny(path: str) -> str | None:
    """Why model.path `path` (tiny:<name>) names no tiny model, with the closest one; None if it does."""
    name = path.split(":", 1)[1]
    if name in TINY_MODELS:
        return None
    close = difflib.get_close_matches(name, list(TINY_MODELS), n=1, cutoff=0.6)
    hint = f"; did you mean tiny:{close[0]}?" if close else ""
    return f"{path} is not a tiny model{hint} (tiny models: {tiny_choices()})"

