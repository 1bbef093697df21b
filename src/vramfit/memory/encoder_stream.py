"""Streamed text encoders: while captions are encoded, an encoder's layers visit the GPU one at a time.

What is streamed. The transformer layers of a text encoder (T5's `encoder.block`, a CLIP text
model's `encoder.layers`): their parameters and buffers stay in CPU memory (pinned on
CUDA) and each layer is copied to the device just before it runs, the next one on a side CUDA
stream while the current one computes, and dropped as soon as it has run. The rest of the
encoder (token embedding, T5's final norm, CLIP's final norm and projection) is copied to the
device for the duration of the encoding and dropped after. Inference only (no autograd): no
weight is written, so nothing is copied back. Quantized layers (model.t5_precision int8, fp8,
nf4) stream their quantized storage (torchao tensor subclasses move as their parts).

Where a weight is. A module's parameter and buffer entries point at the device copies only while
the layer runs; otherwise (and after the encoding, also when it fails) at the original CPU
tensors, the *homes*, so the encoder object is unchanged for saving, fingerprints and the
unstreamed path. On CUDA the homes of the streamed layers are replaced by pinned copies the first
time (pinned memory copies asynchronously) and stay pinned.

Costs: every chunk of captions copies the whole encoder to the device once (host-to-GPU, about
9 GiB for T5-XXL in bf16, 4.6 GiB in int8: a few tenths of a second on PCIe 5, overlapped with
compute except the first layer), against the unstreamed path's one copy there and one back; the
first streamed encoding pins the encoder's layers in host memory (a second or two for T5-XXL,
and host memory that cannot be swapped out). On the device: the resident part, at most `window`
layers' copies in allocation (the running one and the prefetched one), plus one layer whose
memory the allocator keeps until the GPU has finished with it, and the activations of a chunk
as before. On CPU-only runs every layer is still copied into separate compute tensors, so tests
see the mechanism work and the result stays bitwise the same.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator, Optional

import torch
from torch import nn

from vramfit.memory import pinned
from vramfit.memory.accounting import CopyCounters, concrete_device, tensor_bytes

# T5EncoderModel; CLIPTextModelWithProjection; CLIPTextModel (transformers 5 has no text_model in it)
LAYER_LISTS = ("encoder.block", "text_model.encoder.layers", "encoder.layers")
WINDOW = 2  # layers with device copies at once: the one running and the next


def encoder_layers(encoder: nn.Module) -> list[nn.Module]:
    """The encoder's transformer layers in the order they run."""
    for path in LAYER_LISTS:
        try:
            layers = encoder.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise ValueError(f"{type(encoder).__name__}: no layer list at any of {LAYER_LISTS}; cannot stream it")


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s data (a quantized tensor subclass: its parts)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    return [p for name in flatten()[0] for p in plain_parts(getattr(t, name))]


def _map_parts(t: torch.Tensor, fn) -> torch.Tensor:
    """`t` rebuilt from fn(part) of each plain part, on the same device (pinning, cloning)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return fn(t)
    names, ctx = flatten()
    return type(t).__tensor_unflatten__({n: _map_parts(getattr(t, n), fn) for n in names}, ctx, t.size(), t.stride())


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if all(p.is_pinned() for p in plain_parts(t)):
        return t
    return _map_parts(t.detach(), lambda p: p if p.is_pinned() else pinned.copy_of(p, device))


def _copy_to(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    if t.device == device:  # CPU-only runs: a separate compute copy all the same
        return _map_parts(t.detach(), torch.clone)
    return t.detach().to(device, non_blocking=non_blocking)


@dataclass
class _Entry:
    """One parameter or buffer slot of a module, and the tensor that lives there between uses."""

    module: nn.Module
    kind: str  # "_parameters" | "_buffers"
    name: str
    home: torch.Tensor

    def point_at(self, t: torch.Tensor) -> None:
        if self.kind == "_parameters" and not isinstance(t, nn.Parameter):
            t = nn.Parameter(t, requires_grad=False)
        getattr(self.module, self.kind)[self.name] = t


@dataclass
class _Group:
    """The entries of one layer (or of the resident rest), with their compute copies while fetched."""

    entries: list[_Entry]
    nbytes: int = 0
    copies: Optional[dict[int, torch.Tensor]] = None  # id(home) -> device copy
    ready: Optional[object] = None  # CUDA event: the copy is done
    streams: set = field(default_factory=set)

    def homes(self) -> dict[int, torch.Tensor]:
        return {id(e.home): e.home for e in self.entries}


@dataclass
class EncoderStreamStats(CopyCounters):
    """Bytes of compute copies made by the streamer (on CPU: clones, counted alike); device_bytes
    counts the streamed layers' copies held now."""

    resident_bytes: int = 0
    largest_layer_bytes: int = 0


def _entries_here(module: nn.Module) -> list[_Entry]:
    return [_Entry(module, kind, name, t) for kind in ("_parameters", "_buffers")
            for name, t in getattr(module, kind).items() if t is not None]


def _entries(module: nn.Module) -> list[_Entry]:
    return [e for m in module.modules() for e in _entries_here(m)]


class EncoderStreamer:
    """Streams one text encoder's layers for the duration of a `with` block (module docstring)."""

    def __init__(self, encoder: nn.Module, device: torch.device, window: int = WINDOW):
        device = concrete_device(device)  # tensors report cuda:N; compare alike
        self.encoder, self.device, self.window = encoder, device, max(1, window)
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.stats = EncoderStreamStats()
        self.layers = encoder_layers(encoder)
        inside = {id(m) for layer in self.layers for m in layer.modules()}
        resident = [e for m in encoder.modules() if id(m) not in inside for e in _entries_here(m)]
        shared = {id(e.home) for e in resident}  # a tensor tied to the rest stays resident
        self.groups = [_Group([e for e in _entries(layer) if id(e.home) not in shared]) for layer in self.layers]
        self.resident = _Group(resident)
        for g in self.groups:
            g.nbytes = sum(tensor_bytes(t) for t in g.homes().values())
        self.resident.nbytes = sum(tensor_bytes(t) for t in self.resident.homes().values())
        self.stats.largest_layer_bytes = max((g.nbytes for g in self.groups), default=0)
        self.stats.resident_bytes = self.resident.nbytes
        self._live: list[int] = []  # layers with copies, oldest first
        self._freeing: deque = deque()  # CUDA events: the GPU is done with a dropped layer
        self._handles: list = []

    # ---- the with block -------------------------------------------------------------------------

    def __enter__(self) -> "EncoderStreamer":
        if self.cuda:
            self._pin_homes()
        self.resident.copies = {k: _copy_to(t, self.device, False) for k, t in self.resident.homes().items()}
        for e in self.resident.entries:
            e.point_at(self.resident.copies[id(e.home)])
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._begin, i)))
            self._handles.append(layer.register_forward_hook(partial(self._end, i), always_call=True))
        if self.groups:
            self._fetch(0)  # copied while the embedding runs
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for i in list(self._live):
            self._drop(i)
        for e in self.resident.entries:
            e.point_at(e.home)
        self.resident.copies = None

    def _pin_homes(self) -> None:
        for group in self.groups:
            replaced: dict[int, torch.Tensor] = {}  # id(old home) -> its pinned replacement
            for e in group.entries:
                key = id(e.home)
                if key not in replaced:
                    t = _pinned(e.home, self.device)
                    replaced[key] = e.home if t is e.home else \
                        nn.Parameter(t, requires_grad=False) if e.kind == "_parameters" else t
                e.home = replaced[key]
                getattr(e.module, e.kind)[e.name] = e.home

    # ---- per layer ------------------------------------------------------------------------------

    def _begin(self, i: int, module, args) -> None:
        if self.groups[i].copies is None:
            self._fetch(i)
        self._bind(i)
        for j in range(i + 1, min(i + self.window, len(self.groups))):
            if self.groups[j].copies is None:
                self._fetch(j)

    def _end(self, i: int, module, args, output) -> None:
        if self.groups[i].copies is not None:
            self._drop(i)

    def _fetch(self, i: int) -> None:
        while len(self._live) >= self.window:
            self._drop(self._live[0])
        # The CPU runs ahead of the GPU: without a limit the allocator would hold many layers
        # whose memory the GPU still reads. Wait until all dropped layers but the newest are free.
        while len(self._freeing) > 1:
            self._freeing.popleft().synchronize()
        group = self.groups[i]
        with torch.cuda.stream(self.side) if self.cuda else nullcontext():
            group.copies = {k: _copy_to(t, self.device, self.cuda) for k, t in group.homes().items()}
            if self.cuda:
                group.ready = torch.cuda.Event()
                group.ready.record(self.side)
        group.streams = set()
        self._live.append(i)
        self.stats.fetched(group.nbytes)

    def _bind(self, i: int) -> None:
        group = self.groups[i]
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            if stream not in group.streams:
                # compute waits for the copy; the allocator keeps the memory until compute is done
                stream.wait_event(group.ready)
                for t in group.copies.values():
                    for part in plain_parts(t):
                        part.record_stream(stream)
                group.streams.add(stream)
        for e in group.entries:
            e.point_at(group.copies[id(e.home)])

    def _drop(self, i: int) -> None:
        group = self.groups[i]
        for e in group.entries:
            e.point_at(e.home)
        if group.streams:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._freeing.append(done)
        group.copies = group.ready = None
        group.streams = set()
        self._live.remove(i)
        self.stats.released(group.nbytes)

    # ---- accounting -----------------------------------------------------------------------------

    def streamed_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


class HostLookup(nn.Module):
    """A token embedding left in CPU memory: the ids' rows are looked up there and only those rows
    move to the ids' device. The table is held outside the module tree, so `.to(device)` on the
    encoder passes it by."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self._table = (table,)

    @property
    def table(self) -> nn.Embedding:
        return self._table[0]

    @property
    def weight(self) -> torch.Tensor:  # read by models that ask their embedding for a dtype
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        home = self.table.weight.device
        return self.table(ids.to(home)).to(ids.device)


def keeps_embedding_on_host(encoder: nn.Module) -> bool:
    """T5's token table (32128 x 4096: 0.25 GiB in bf16, never quantized) stays in CPU memory while
    the rest of the encoder runs on the device; a CLIP's table is small and moves with it."""
    return type(encoder).__name__.startswith("T5") and isinstance(encoder.get_input_embeddings(), nn.Embedding)


@contextmanager
def encoder_on(encoder: nn.Module, device: torch.device, stream: bool) -> Iterator[Optional[EncoderStreamer]]:
    """`encoder` runnable on `device` inside the block: streamed layer by layer (memory.stream_encoders)
    or moved there whole, T5's token embedding excepted (`HostLookup`); afterwards its weights are
    back in CPU memory either way and the encoder is the module it was."""
    if stream:
        with EncoderStreamer(encoder, device) as streamer:
            yield streamer
        return
    table = encoder.get_input_embeddings() if keeps_embedding_on_host(encoder) else None
    holders = _holders_of(encoder, table) if table is not None else []
    if table is not None:
        table.to("cpu")
        lookup = HostLookup(table)
        for parent, name, _ in holders:
            setattr(parent, name, lookup)
    try:
        encoder.to(device)
        yield None
    finally:
        encoder.to("cpu")
        for parent, name, module in holders:
            setattr(parent, name, module)


def _holders_of(encoder: nn.Module, table: nn.Embedding) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every (parent, attribute, module) of `encoder` holding an embedding of `table`'s weight: T5
    keeps its token table twice (`shared` and `encoder.embed_tokens`, one tied weight), and not every
    transformers release's `set_input_embeddings` replaces both."""
    return [(parent, name, child) for parent in encoder.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Embedding) and child.weight is table.weight]
