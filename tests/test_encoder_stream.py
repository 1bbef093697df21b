"""Streamed text encoders (memory/encoder_stream.py): same embeddings, it saves, the planner's
bytes, nf4 T5 on the CPU, and a CLI run whose text cache is shared with unstreamed runs.

On CPU the compute device is the home device, so the checks follow the copies: every copy the
streamer makes is tracked (weakly) from the moment it is made until it is freed, and every
module must compute with copies, never with the home tensors.
"""
from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import MemoryConfig, ModelConfig, RunConfig
from vramfit.memory import encoder_stream
from vramfit.memory.accounting import tensor_bytes
from vramfit.fit.model_facts import encoder_bytes, encoder_device_bytes, read_facts
from vramfit.memory.encoder_stream import WINDOW, EncoderStreamer, HostLookup, encoder_layers, encoder_on, plain_parts
from vramfit.memory.quantize import QuantizedLinear, storage_bytes
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source

CAPTIONS = ["a red circle on a blue background", "a green square", "two yellow stars"]
CASES = [("tiny:sd3", "bf16"), ("tiny:sd3", "int8"), ("tiny:sd3", "nf4"), ("tiny:sd3", "fp8"), ("tiny:sdxl", None)]
CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
TOL = {"rtol": 1e-2, "atol": 1e-2} if CUDA else {"rtol": 0, "atol": 0}


def _bundle(cache_root, model: str, precision, widen: bool = True):
    """A bundle as train/setup.py prepares it on the CPU (encoders widened to fp32, then T5 stored
    as model.t5_precision asks)."""
    source = resolve_source(ModelConfig(path=model), cache_root / "enc")
    family = detect_family(source)
    bundle = family.load(source)
    if widen:
        for enc in bundle.text_encoders:
            enc.to(torch.float32)
    if precision:
        bundle.extra["t5_precision"] = precision
    family.prepare_encoders(bundle)
    return family, bundle


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer now held by `module`'s sub-modules, each once."""
    seen, out = set(), []
    for m in module.modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _ptrs(t: torch.Tensor) -> set[int]:
    return {p.data_ptr() for p in plain_parts(t)}


@pytest.mark.parametrize("model,precision", CASES)
def test_same_embeddings_streamed_or_not(cache_root, model, precision):
    """Bitwise on CPU (streaming copies exactly); afterwards the encoders hold their own tensors."""
    family, bundle = _bundle(cache_root, model, precision)
    ref = family.encode_text(bundle, CAPTIONS, CPU, torch.float32)
    before = [[id(t) for t in _tensors(enc)] for enc in bundle.text_encoders]  # (.to() renews nf4's)
    bundle.extra["stream_encoders"] = True
    got = family.encode_text(bundle, CAPTIONS, CPU, torch.float32)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert [[id(t) for t in _tensors(enc)] for enc in bundle.text_encoders] == before


class _CopyTracker:
    """Wraps encoder_stream._copy_to: every compute copy the streamer makes is recorded with its
    bytes and followed until it is freed."""

    def __init__(self, monkeypatch):
        self.live: list[tuple[weakref.ref, int]] = []
        real = encoder_stream._copy_to

        def tracked(t, device, non_blocking):
            out = real(t, device, non_blocking)
            self.live.append((weakref.ref(out), tensor_bytes(out)))
            return out

        monkeypatch.setattr(encoder_stream, "_copy_to", tracked)

    def bytes_alive(self) -> int:
        return sum(n for ref, n in self.live if ref() is not None)


def _layout(encoder: torch.nn.Module) -> tuple[int, int, int]:
    """(bytes outside the layers, bytes of the largest layer, all bytes), from the model itself."""
    layers = encoder_layers(encoder)
    in_layers = {id(t) for layer in layers for t in _tensors(layer)}
    resident = sum(tensor_bytes(t) for t in _tensors(encoder) if id(t) not in in_layers)
    largest = max(sum(tensor_bytes(t) for t in _tensors(layer)) for layer in layers)
    return resident, largest, sum(tensor_bytes(t) for t in _tensors(encoder))


def _watch(encoder: torch.nn.Module, tracker: _CopyTracker, homes: set[int], seen: list, bad: list):
    """Hooks on every sub-module: the bytes of live copies at each call, and the modules that
    computed with a home tensor."""
    def check(name, module, *args):
        seen.append(tracker.bytes_alive())
        own = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        if not list(module.children()) and any(_ptrs(t) & homes for t in own):
            bad.append(name)
    return [h for name, m in encoder.named_modules() if name for h in
            (m.register_forward_pre_hook(lambda mod, args, name=name: check(name, mod)),
             m.register_forward_hook(lambda mod, args, out, name=name: check(name, mod)))]


@pytest.mark.parametrize("model,precision", CASES)
def test_encoding_holds_the_resident_part_and_a_window_of_layers(cache_root, monkeypatch, model, precision):
    """Through encode_text: while an encoder runs, its compute copies never exceed the part
    outside its layers plus WINDOW layers; no module computes with a home tensor; after
    encoding no copy is left."""
    family, bundle = _bundle(cache_root, model, precision)
    bundle.extra["stream_encoders"] = True
    tracker = _CopyTracker(monkeypatch)
    watched = []
    for enc in bundle.text_encoders:
        homes = set().union(*(_ptrs(t) for t in _tensors(enc)))
        seen, bad = [], []
        watched.append((enc, seen, bad, _watch(enc, tracker, homes, seen, bad)))
    family.encode_text(bundle, CAPTIONS, CPU, torch.float32)
    for enc, seen, bad, handles in watched:
        for h in handles:
            h.remove()
        resident, largest, total = _layout(enc)
        assert bad == []
        assert seen and max(seen) <= resident + WINDOW * largest
        assert max(seen) > resident  # layers were streamed in
        if len(encoder_layers(enc)) > WINDOW:
            assert max(seen) < total
    assert tracker.bytes_alive() == 0


@pytest.mark.parametrize("model,precision", [("tiny:sd3", "bf16"), ("tiny:sd3", "int8"), ("tiny:sdxl", None)])
def test_a_window_of_one_layer(cache_root, monkeypatch, model, precision):
    """With one layer at a time the peak of copies is the resident part and the largest layer,
    less than the whole encoder; the stream's own counters agree with the tracked copies."""
    _, bundle = _bundle(cache_root, model, precision)
    tracker = _CopyTracker(monkeypatch)
    for enc in bundle.text_encoders:
        ids = torch.randint(3, 60, (2, 16))
        with torch.no_grad():
            ref = enc(ids, output_hidden_states=True).hidden_states[-2]
        homes = set().union(*(_ptrs(t) for t in _tensors(enc)))
        seen, bad = [], []
        handles = _watch(enc, tracker, homes, seen, bad)
        with torch.no_grad(), EncoderStreamer(enc, CPU, window=1) as streamer:
            got = enc(ids, output_hidden_states=True).hidden_states[-2]
        for h in handles:
            h.remove()
        resident, largest, total = _layout(enc)
        assert torch.equal(ref, got) and bad == []
        assert resident < max(seen) <= resident + largest < total
        stats = streamer.stats
        assert stats.resident_bytes == resident and stats.largest_layer_bytes == largest
        assert stats.peak_device_bytes == largest and stats.device_bytes == 0
        assert stats.fetched_bytes == streamer.streamed_bytes() == total - resident  # each layer once
        assert tracker.bytes_alive() == 0


@pytest.mark.parametrize("precision", ["bf16", "int8", "nf4"])
def test_planner_bytes_of_a_streamed_t5(cache_root, precision):
    """fit/planner.py's streamed T5 (from header facts) against the streamer on the loaded
    encoder, one layer at a time (the tiny T5 has two): never below, at most 10% above (norms
    count as resident; the nf4 absmax estimate is above torchao's double-quantized one)."""
    _, bundle = _bundle(cache_root, "tiny:sd3", precision, widen=False)  # as on a GPU: T5 in bf16
    stats = EncoderStreamer(bundle.text_encoders[2], CPU, window=1).stats
    actual = stats.resident_bytes + stats.largest_layer_bytes
    model = ModelConfig(path="tiny:sd3", t5_precision=precision)
    facts = read_facts(RunConfig(model=model), cache_root / "enc")
    enc = next(e for e in facts.encoders if e.kind == "t5")
    predicted, _ = encoder_device_bytes(enc, model, MemoryConfig(stream_encoders=True), window=1)
    whole, _ = encoder_bytes(enc, precision)  # the whole encoder, token table included
    assert actual <= predicted <= 1.10 * actual
    assert predicted < 0.7 * whole


@pytest.mark.parametrize("precision", ["bf16", "nf4"])
def test_t5_token_table_stays_in_cpu_memory_while_the_rest_encodes(cache_root, precision):
    """Unstreamed encoding moves T5 to the device but its token table: the lookup runs in CPU memory,
    the output is the same, and afterwards the encoder is as it was (its table tied and saved).
    The planner leaves the table out of T5's device bytes (CUDA test below: the peak drops)."""
    _, bundle = _bundle(cache_root, "tiny:sd3", precision, widen=False)
    t5 = bundle.text_encoders[2]
    table = t5.get_input_embeddings()
    held = t5.encoder.embed_tokens  # the same module, or one of the same (tied) weight
    keys = set(t5.state_dict())
    ids = torch.randint(2, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = t5(ids)[0]
        moved = []
        with encoder_on(t5, CPU, False):
            looked_up = t5.get_input_embeddings()
            assert isinstance(looked_up, HostLookup) and looked_up.table is table
            assert table not in list(t5.modules())  # out of the tree that .to(device) walks
            looked_up.table.register_forward_hook(lambda m, i, o: moved.append(o.device))
            got = t5(ids)[0]
    assert moved == [CPU] and torch.equal(got, ref)
    assert t5.get_input_embeddings() is table and t5.encoder.embed_tokens is held
    assert held.weight is table.weight and set(t5.state_dict()) == keys
    model = ModelConfig(path="tiny:sd3", t5_precision=precision)
    facts = read_facts(RunConfig(model=model), cache_root / "enc")
    enc = next(e for e in facts.encoders if e.kind == "t5")
    assert enc.embedding_numel == table.weight.numel()
    whole, _ = encoder_device_bytes(enc, model, MemoryConfig())
    streamed_rest, _ = encoder_device_bytes(enc, model, MemoryConfig(stream_encoders=True), window=0)
    assert streamed_rest >= 2 * enc.embedding_numel  # streaming keeps the table with the resident part
    clip = next(e for e in facts.encoders if e.kind == "clip")
    assert encoder_device_bytes(clip, model, MemoryConfig())[0] == clip.stored_bytes  # CLIP moves whole
    assert whole < sum(tensor_bytes(t) for t in _tensors(t5))


def test_a_token_table_held_twice_stays_in_cpu_memory_in_both_places():
    """T5 built by transformers may hold its tied token table in two modules (`shared` and
    `encoder.embed_tokens`); both are looked up in CPU memory while the encoder is on the device,
    and both come back afterwards."""
    from transformers import T5Config, T5EncoderModel

    t5 = T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1,
                                 feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False))
    shared = t5.shared
    held = torch.nn.Embedding(64, 16)
    held.weight = shared.weight  # a second module over the same tied weight
    t5.encoder.embed_tokens = held
    with torch.no_grad(), encoder_on(t5, CPU, False):
        assert isinstance(t5.shared, HostLookup) and t5.encoder.embed_tokens is t5.shared
        assert all(m is not shared and m is not held for m in t5.modules())
        t5(torch.randint(2, 64, (1, 5)))
    assert t5.shared is shared and t5.encoder.embed_tokens is held


def test_nf4_t5_runs_on_the_cpu_through_torchao(cache_root):
    """No bitsandbytes: every T5 linear becomes a torchao NF4 QuantizedLinear, the tokens stay
    close to bf16 (stated tolerance for the random tiny T5: 25% relative Frobenius error; 4-bit
    rounding compounds through its layers) and storage is under 40% of bf16."""
    family, bf16 = _bundle(cache_root, "tiny:sd3", "bf16", widen=False)
    _, nf4 = _bundle(cache_root, "tiny:sd3", "nf4", widen=False)
    linears = [m for m in nf4.text_encoders[2].modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert linears and all(isinstance(m, QuantizedLinear) and m.method == "nf4" for m in linears)
    ref = family.encode_text(bf16, CAPTIONS, CPU, torch.float32)["prompt_embeds"][:, 77:]
    out = family.encode_text(nf4, CAPTIONS, CPU, torch.float32)["prompt_embeds"][:, 77:]
    assert ((out - ref).norm() / ref.norm()).item() < 0.25
    assert storage_bytes(nf4.text_encoders[2]) < 0.4 * storage_bytes(bf16.text_encoders[2])


def test_streamed_training_run_shares_the_text_cache(images, tmp_path, cache_root, capsys):
    """`vramfit train` on tiny:sd3 with memory.stream_encoders=true; an unstreamed `vramfit cache`
    then finds every text entry already there (same keys), and a fresh unstreamed cache holds
    the same entries bit for bit."""
    streamed_cache, plain_cache = cache_root / "stream-text", cache_root / "plain-text"
    out = tmp_path / "run"
    assert main(train_args(images, out, streamed_cache, "memory.stream_encoders=true", model="tiny:sd3")) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["cache"]["text_cached"] == 4 and len(run["losses"]) == 2
    assert "stream_encoders = true" in (out / "config.toml").read_text()
    for cache, cached in ((streamed_cache, 0), (plain_cache, 4)):
        args = train_args(images, tmp_path / "cache", cache, model="tiny:sd3")
        args[0] = "cache"
        capsys.readouterr()
        assert main(args) == 0
        assert f"text_cached {cached}" in capsys.readouterr().out
    files = sorted(p.relative_to(streamed_cache) for p in (streamed_cache / "entries" / "text").rglob("*.safetensors"))
    assert len(files) == 4
    assert files == sorted(p.relative_to(plain_cache) for p in (plain_cache / "entries" / "text").rglob("*.safetensors"))
    for f in files:
        a, b = load_file(str(streamed_cache / f)), load_file(str(plain_cache / f))
        assert a.keys() == b.keys()
        for k in a:  # on CPU bit for bit; on a GPU (the lead's run of this file) to rounding
            torch.testing.assert_close(a[k], b[k], **TOL)


def _peak_of(fn) -> tuple[torch.Tensor, int]:
    """(fn()'s output on the CPU, its peak CUDA allocation above what was allocated before)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn().float().cpu()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start


@pytest.mark.gpu
def test_cuda_t5_token_table_is_not_on_the_gpu():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=32128, d_model=512, d_kv=64, num_heads=8, d_ff=1024, num_layers=2,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    t5 = T5EncoderModel(config).to(torch.bfloat16).eval()
    ids = torch.randint(2, 32128, (4, 77))

    def hosted() -> torch.Tensor:
        with encoder_on(t5, torch.device("cuda"), False):
            return t5(ids.cuda())[0]

    with torch.no_grad():
        # the whole encoder first: the first matmul on the GPU allocates cuBLAS's workspace through
        # torch's allocator, and it stays; measured second, the hosted run would carry it alone
        ref, whole_peak = _peak_of(lambda: t5.cuda()(ids.cuda())[0])
        t5.cpu()
        got, peak = _peak_of(hosted)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    assert peak <= whole_peak - tensor_bytes(t5.get_input_embeddings().weight)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "int8", "nf4"])
def test_cuda_streamed_t5_same_output_lower_peak(precision):
    """On the GPU, a 6-layer T5 (bf16, or quantized): the streamed output matches the whole
    encoder's, the peak allocation is lower (about the resident part and two layers above the
    activations), the layers' homes are pinned CPU tensors afterwards and nothing stays on the GPU."""
    from transformers import T5Config, T5EncoderModel

    from vramfit.memory.quantize import quantize_encoder

    torch.manual_seed(0)
    config = T5Config(vocab_size=512, d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    t5 = quantize_encoder(T5EncoderModel(config).to(torch.bfloat16).eval(), precision)
    ids = torch.randint(2, 512, (4, 77)).cuda()
    streamer = EncoderStreamer(t5, torch.device("cuda"))

    def streamed() -> torch.Tensor:
        with streamer:
            return t5(ids)[0]

    with torch.no_grad():
        got, streamed_peak = _peak_of(streamed)
        for group in streamer.groups:
            for entry in group.entries:
                held = getattr(entry.module, entry.kind)[entry.name]
                assert held is entry.home
                assert all(p.device.type == "cpu" and p.is_pinned() for p in plain_parts(held))
        assert all(p.device.type == "cpu" for t in _tensors(t5) for p in plain_parts(t))
        ref, whole_peak = _peak_of(lambda: t5.cuda()(ids)[0])  # the unstreamed path: all of it there
        t5.cpu()
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    stats = streamer.stats
    assert stats.peak_device_bytes <= WINDOW * stats.largest_layer_bytes and stats.device_bytes == 0
    assert streamed_peak < whole_peak - 2 * stats.largest_layer_bytes  # six layers, two at a time
