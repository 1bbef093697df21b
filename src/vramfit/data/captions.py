"""Caption variety that survives caching: tag shuffles with kept leading tags, several captions per
image, caption dropout.

A cached run trains on text encodings made before training, so every caption an image can be
trained with must be known then. Each image therefore gets a bounded list of variants (its
captions, and seeded shuffles of their tags), each cached once under its own content-addressed
key, and every draw picks one of them; dropout picks the empty caption, whose encoding is cached
once for the run. The picks are a function of (seed, epoch, position, image), so a resumed run
makes the same ones. Cost: one text-cache entry per distinct variant (`caption_variants` bounds it).
"""
from __future__ import annotations

import random

from vramfit.data.fingerprint import digest

EMPTY = ""  # the caption a dropped draw trains on


def split_tags(caption: str, separator: str) -> list[str]:
    """The caption's tags, stripped, empty ones left out."""
    return [t.strip() for t in caption.split(separator) if t.strip()]


def shuffle_tags(caption: str, keep_tokens: int, separator: str, rng: random.Random) -> str:
    """The caption with its tags after the first `keep_tokens` in a shuffled order."""
    tags = split_tags(caption, separator)
    kept, rest = tags[:keep_tokens], tags[keep_tokens:]
    rng.shuffle(rest)
    joiner = separator if separator.strip() == "" else f"{separator.strip()} "
    return joiner.join(kept + rest)


def variants(captions: list[str], *, shuffle: bool, keep_tokens: int, separator: str, count: int,
             seed: int, key: str) -> list[str]:
    """Up to `count` distinct captions to train an image with: each of its captions in turn, and with
    `shuffle` seeded shuffles of their tags (the first of each caption as written). Deterministic in
    (seed, key)."""
    out: list[str] = []
    attempts = 0
    while len(out) < count and attempts < 4 * count + len(captions):
        base = captions[attempts % len(captions)]
        turn = attempts // len(captions)
        if turn and not shuffle:
            break
        text = base if turn == 0 else shuffle_tags(base, keep_tokens, separator,
                                                     random.Random(digest(seed, key, attempts)))
        if text not in out:
            out.append(text)
        attempts += 1
    return out


def draw(seed: int, epoch: int, slot: int, key: str) -> random.Random:
    """The generator of one draw's picks (variant, dropout, flip): fixed by where it is trained."""
    return random.Random(digest("draw", seed, epoch, slot, key))
