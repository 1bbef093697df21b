"""Renaming a state dict's keys through a complete name map, which every single-file key map uses.

A conversion either accounts for every tensor or raises UnmappedKeysError, naming the keys the
map does not know and those it needs but the input lacks.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


class UnmappedKeysError(KeyError):
    """A state dict did not match the key set a conversion expects.

    ``unmapped`` holds input keys the map does not know; ``missing`` holds keys the map needs but the
    input lacks. Raised instead of dropping tensors, because a silently partial checkpoint loads
    "fine" with ``strict=False`` and then generates noise.
    """

    def __init__(self, what: str, unmapped: Iterable[str], missing: Iterable[str]):
        self.unmapped = sorted(unmapped)
        self.missing = sorted(missing)
        parts = [f"{what}: state dict does not match the expected layout."]
        for label, keys in (("unmapped", self.unmapped), ("missing", self.missing)):
            if keys:
                parts.append(f"{len(keys)} {label} key(s), first 10: {keys[:10]}")
        super().__init__(" ".join(parts))

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0])


def rename_exact(
    sd: Mapping[str, torch.Tensor], name_map: Mapping[str, str], *, what: str, strict: bool = True
) -> dict[str, torch.Tensor]:
    """Rename every key of ``sd`` through ``name_map``; raise if a key is unknown (or, when
    ``strict``, if a key of the map is absent from ``sd``)."""
    unmapped = [k for k in sd if k not in name_map]
    missing = [k for k in name_map if k not in sd] if strict else []
    if unmapped or missing:
        raise UnmappedKeysError(what, unmapped, missing)
    return {name_map[k]: v for k, v in sd.items()}
