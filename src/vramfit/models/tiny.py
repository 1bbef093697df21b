"""What every tiny model (`tiny:<name>`, for tests and the demo) shares: its CLIP tokenizers
and the tiny T5 tokenizer.

Each family builds its own tiny models (models/<family>/tiny.py): a real single file of the real
classes, with tokenizer folders beside it, loaded through exactly the path a user's checkpoint
takes; architectures come from the JSON files shipped in `configs/` and weights are seeded, so
every machine builds the same file. The CLIP tokenizers written here are byte-level BPE
vocabularies (every byte, a handful of merges, CLIP's start/end tokens), so nothing is ever
downloaded.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from vramfit.formats.safetensors_io import write_text_atomic

_WORDS = ("a", "the", "of", "red", "blue", "green", "circle", "square", "photo", "on", "and", "with")
_MERGES = ["t h", "th e</w>", "o n</w>", "a n", "r e", "e d</w>"]  # 512 bytes + 6 merges + 2 specials = 520, the tiny encoders' vocab_size


def _byte_chars() -> list[str]:
    """The byte-to-unicode table of GPT-2/CLIP BPE: printable stand-ins for all 256 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_tiny_tokenizers(folder: Path) -> None:
    """Write tokenizer/ (pads with end-of-text) and tokenizer_2/ (pads with "!") as SDXL has them."""
    chars = _byte_chars()
    vocab: dict[str, int] = {}
    for token in [*chars, *(c + "</w>" for c in chars), *(m.replace(" ", "") for m in _MERGES)]:
        vocab.setdefault(token, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    for sub, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        d = folder / sub
        d.mkdir(parents=True, exist_ok=True)
        write_text_atomic(d / "vocab.json", json.dumps(vocab))
        write_text_atomic(d / "merges.txt", "#version: 0.2\n" + "\n".join(_MERGES) + "\n")
        config = {"model_max_length": 77, "pad_token": pad, "bos_token": "<|startoftext|>",
                  "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                  "tokenizer_class": "CLIPTokenizer"}
        write_text_atomic(d / "tokenizer_config.json", json.dumps(config))


def t5_vocab() -> list[tuple[str, float]]:
    """Unigram pieces and scores: T5's three specials at ids 0-2, the word boundary, whole
    words, then every printable character with and without a leading boundary."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0 - 0.01 * i) for i, w in enumerate(_WORDS)]
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab += [("\u2581" + c, -5.0) for c in chars] + [(c, -6.0) for c in chars]
    return vocab


def write_t5_tokenizer(folder: Path) -> None:
    """Write a T5 tokenizer (tokenizer.json + tokenizer_config.json) that
    ``T5TokenizerFast.from_pretrained(folder)`` loads: pad id 0, eos id 1, unk id 2."""
    # heavy: diffusers/transformers classes (~2 s), kept off `vramfit plan` and pre-load checks
    from transformers import T5TokenizerFast

    tok = T5TokenizerFast(vocab=t5_vocab(), extra_ids=0, model_max_length=512)
    Path(folder).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
