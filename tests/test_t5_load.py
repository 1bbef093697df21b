"""T5 stored as model.t5_precision asks while it loads (models/parts.py `t5_file_encoder`, and
`t5_folder_encoder` for a diffusers folder's): each part of a block is widened to bf16 and stored
before the next is read, so host memory never holds the whole bf16 encoder; the stored weights are
those of quantize_encoder over the whole bf16 encoder, bit for bit, and prepare_encoders leaves them
as they are. With "none" T5 is not read at all."""
from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5EncoderModel

from conftest import train_args
from vramfit.config.load import load_config
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import host_prediction
from vramfit.formats.safetensors_io import CheckpointError
from vramfit.memory import quantize
from vramfit.memory.accounting import MemoryTracker
from vramfit.memory.quantize import plain_state, quantize_encoder, storage_bytes, stored_precision
from vramfit.models import parts
from vramfit.models.adapter import Source
from vramfit.models.flux import FluxFamily
from vramfit.models.flux.tiny import materialize_flux
from vramfit.models.sd3 import SD3Family
from vramfit.models.sd3.tiny import materialize_sd3
from vramfit.train.setup import load_data

T5 = "text_encoders.t5xxl.transformer."
PROMPT = ["a red circle on a blue square"]


@pytest.fixture(scope="module")
def sd3_file(tmp_path_factory):
    return materialize_sd3(tmp_path_factory.mktemp("sd3"))  # T5 stored float8, as Stability's file


@pytest.fixture(scope="module")
def sd3_reference(sd3_file):
    """tiny:sd3 loaded as before: T5 whole in bf16, stored after."""
    return SD3Family().load(Source("single_file", sd3_file, tokenizers=sd3_file.parent))


def _same_storage(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """The same tensors, bit for bit, in the same dtypes (quantized ones by the tensors they are made of)."""
    sa, sb = plain_state(a), plain_state(b)
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def _output(t5: torch.nn.Module, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, padding="max_length", max_length=16, truncation=True,
                    return_tensors="pt").input_ids
    with torch.no_grad():
        return t5(ids)[0]


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_sd3_t5_stored_while_loading_equals_quantizing_after(sd3_file, sd3_reference, mode):
    """The all-in-one file's float8 T5, stored as it loads: the same weights and the same output as
    quantize_encoder over the whole bf16 T5; prepare_encoders stores nothing again; cache keys form."""
    family = SD3Family()
    bundle = family.load(Source("single_file", sd3_file, tokenizers=sd3_file.parent), t5_precision=mode)
    t5 = bundle.text_encoders[2]
    want = quantize_encoder(copy.deepcopy(sd3_reference.text_encoders[2]).to(torch.bfloat16), mode)
    assert stored_precision(t5) == mode
    assert type(t5.encoder.block[0].layer[0].SelfAttention.q.weight) is not torch.Tensor  # stored quantized
    _same_storage(t5, want)
    tokenizer = bundle.tokenizers[2]
    assert torch.equal(_output(t5, tokenizer), _output(want, tokenizer))
    assert not any(p.requires_grad for p in t5.parameters())

    before = {k: v.data_ptr() for k, v in plain_state(t5).items()}
    bundle.extra["t5_precision"] = mode
    identity = family.encoder_identity(bundle, "text")
    family.prepare_encoders(bundle)
    assert {k: v.data_ptr() for k, v in plain_state(bundle.text_encoders[2]).items()} == before
    assert identity != family.encoder_identity(sd3_reference, "text")  # the stored T5 keys its own cache
    with pytest.raises(ValueError, match=f"stored as {mode} already"):
        quantize_encoder(t5, "fp8")


def test_flux_fp16_t5_file_stored_while_loading(tmp_path):
    """Flux.1 with a t5xxl fp16 file of its own (model.t5): widened to bf16 a block at a time and
    stored int8, equal to the whole bf16 T5 stored after."""
    path = materialize_flux(tmp_path / "flux")
    t5_file = tmp_path / "t5xxl_fp16.safetensors"
    save_file({k[len(T5):]: v.to(torch.float16) for k, v in load_file(str(path)).items() if k.startswith(T5)},
              str(t5_file))
    source = Source("single_file", path, tokenizers=path.parent, encoder_files=(("t5", t5_file),))
    bundle = FluxFamily().load(source, t5_precision="int8")
    want = quantize_encoder(parts.t5_file_encoder(t5_file, T5, own_file=True).to(torch.bfloat16), "int8")
    _same_storage(bundle.text_encoders[1], want)
    tokenizer = bundle.tokenizers[1]
    assert torch.equal(_output(bundle.text_encoders[1], tokenizer), _output(want, tokenizer))


def _t5_file(path, layers: int) -> dict[str, torch.Tensor]:
    """A float8 t5xxl file of `layers` blocks (ComfyUI's t5xxl_fp8_e4m3fn layout: no prefix)."""
    config = T5Config(vocab_size=64, d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=layers,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False)
    torch.manual_seed(0)
    state = {k: v.to(torch.float8_e4m3fn) for k, v in T5EncoderModel(config).state_dict().items()}
    save_file(state, str(path))
    return state


def _alive(known: set[int]) -> dict[torch.dtype, int]:
    """Bytes of the plain tensors alive now by dtype (each storage once), those in `known` left out."""
    seen = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in known:
                seen[storage.data_ptr()] = (obj.dtype, storage.nbytes())
    out: dict[torch.dtype, int] = {}
    for dtype, n in seen.values():
        out[dtype] = out.get(dtype, 0) + n
    return out


def _pointers() -> set[int]:
    return {o.untyped_storage().data_ptr() for o in gc.get_objects()
            if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu"}


def test_peak_holds_one_part_in_bf16_not_the_whole_t5(tmp_path, monkeypatch):
    """Counted as each part of a block (attention, feed-forward) is stored, every plain bf16 and
    float8 tensor alive then: one part in bf16 beside the embedding, no more of the float8 file;
    loading whole, as a load without a precision does, holds every block in bf16 (the count sees
    it)."""
    layers = 4
    state = _t5_file(tmp_path / "t5xxl_fp8_e4m3fn.safetensors", layers)
    block_fp8 = sum(v.numel() for k, v in state.items() if k.startswith("encoder.block.1."))
    embedding = state["shared.weight"].numel()
    linears = ("q.weight", "k.weight", "v.weight", "o.weight", "wi_0.weight", "wi_1.weight", "wo.weight")
    kept = sum(v.numel() for k, v in state.items()  # what stays bf16: norms, attention bias, embedding
               if k != "encoder.embed_tokens.weight"
               and not (k.startswith("encoder.block.") and k.endswith(linears)))
    del state
    gc.collect()  # garbage freed later could hand a known pointer to a new tensor, which the count would miss
    known = _pointers()
    peaks = {"bf16": 0, "fp8": 0}
    calls = []

    def counting(module, mode):
        if type(module).__name__ in ("T5LayerSelfAttention", "T5LayerFF"):
            calls.append(mode)
            alive = _alive(known)
            peaks["bf16"] = max(peaks["bf16"], alive.get(torch.bfloat16, 0))
            peaks["fp8"] = max(peaks["fp8"], alive.get(torch.float8_e4m3fn, 0))
        return quantize.quantize_encoder(module, mode)

    monkeypatch.setattr(parts, "quantize_encoder", counting)
    stored = parts.t5_file_encoder(tmp_path / "t5xxl_fp8_e4m3fn.safetensors", "", "int8", own_file=True)
    assert calls == ["int8"] * 2 * layers and stored_precision(stored) == "int8"
    # the embedding (its tied copy is not read) and what else stays bf16, then the feed-forward
    # part (3/5 of a block here) and the int8 weights' scales
    assert embedding * 2 <= peaks["bf16"] <= kept * 2 + 0.8 * block_fp8 * 2, (peaks, kept, block_fp8)
    assert peaks["fp8"] == 0, peaks  # each part's float8 tensors are freed as they are widened

    gc.collect()
    known = _pointers()
    whole = parts.t5_file_encoder(tmp_path / "t5xxl_fp8_e4m3fn.safetensors", "", None, own_file=True)
    assert _alive(known)[torch.bfloat16] >= layers * block_fp8 * 2
    del whole


def _pointers_of(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in plain_state(module).values()}


def test_a_run_loads_t5_stored_and_keeps_it(images, tmp_path, cache_root, sd3_file):
    """A CPU run with model.t5_precision = nf4: the loader gets the precision, and neither the CPU
    run's widening of the encoders to fp32 nor prepare_encoders touches the stored T5."""
    args = train_args(images, tmp_path / "out", cache_root / "t5load", "model.t5_precision=nf4",
                      model="tiny:sd3")
    cfg = load_config(None, args[3::2])
    loaded = load_data(cfg, MemoryTracker(torch.device("cpu")), torch.device("cpu"), False)
    t5 = loaded.bundle.text_encoders[2]
    assert stored_precision(t5) == "nf4"
    want = SD3Family().load(Source("single_file", sd3_file, tokenizers=sd3_file.parent), t5_precision="nf4")
    _same_storage(t5, want.text_encoders[2])
    clip = loaded.bundle.text_encoders[0]
    assert clip.text_model.final_layer_norm.weight.dtype == torch.float32  # the CLIPs are widened


RESIDENT = """
import os, sys, traceback, torch
from pathlib import Path
import torchao.quantization  # imported before the first count, as loading the first part would
from transformers import T5Config, T5EncoderModel
from vramfit.memory.quantize import storage_bytes
from vramfit.models import parts
resident = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * 4096
load = {"file": lambda p: parts.t5_file_encoder(p, "", "int8", own_file=True),
        "folder": lambda p: parts.t5_folder_encoder(p, "int8")}
failed = 0
for kind, path in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()  # each load counted in a process of its own, after the same imports
    if pid == 0:
        try:
            start = resident()
            model = load[kind](Path(path))
            print(kind, (resident() - start) / storage_bytes(model), flush=True)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    failed |= os.waitpid(pid, 0)[1]
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_resident_memory_after_loading_is_the_stored_t5(tmp_path):
    """A fresh process: once a float8 t5xxl file, or a diffusers folder's bf16 T5 in two shards, is
    loaded stored int8, its resident memory has grown by the stored encoder, not by the parts' freed
    bf16 tensors left in the C heap between them (nor, for the folder, by the whole bf16 encoder
    from_pretrained would load)."""
    config = T5Config(vocab_size=256, d_model=1024, d_kv=64, num_heads=16, d_ff=4096, num_layers=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in T5EncoderModel(config).state_dict().items()}
    save_file({k: torch.full(s, 0.25, dtype=torch.float8_e4m3fn) for k, s in shapes.items()},
              str(tmp_path / "t5.safetensors"))
    folder = tmp_path / "text_encoder_3"
    _write_folder(folder, config, {k: torch.full(s, 0.25, dtype=torch.bfloat16) for k, s in shapes.items()})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RESIDENT, "file", str(tmp_path / "t5.safetensors"),
                          "folder", str(folder)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    growth = {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines()}
    assert set(growth) == {"file", "folder"}, out.stdout
    assert growth["file"] < 1.4, growth  # the freed bf16 parts left in the heap make it nearly 2x
    assert growth["folder"] < 1.4, growth


def _write_folder(folder, config: T5Config, state: dict[str, torch.Tensor]) -> None:
    """A transformers T5 folder: config.json and the state in two shards with their index."""
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(folder / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    return materialize_flux(tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="module", params=["sd3", "flux"])
def folder_of(request, sd3_file, sd3_reference, flux_file, tmp_path_factory):
    """(family, the tiny single file, the T5 subfolder's name, the model saved from that file as a
    diffusers folder: its T5 in bf16, as loaded from the file)."""
    family, file, sub = {"sd3": (SD3Family(), sd3_file, "text_encoder_3"),
                         "flux": (FluxFamily(), flux_file, "text_encoder_2")}[request.param]
    bundle = sd3_reference if request.param == "sd3" else \
        family.load(Source("single_file", file, tokenizers=file.parent))
    folder = tmp_path_factory.mktemp(f"{request.param}-folder") / "model"
    family.save_diffusers(bundle, folder, torch.float32)
    return family, file, sub, folder


def test_folder_t5_stored_while_loading(folder_of, cache_root):
    """A diffusers folder's T5 with model.t5_precision int8: stored as it loads, the same weights as
    from_pretrained's T5 widened to bf16 and stored after, its output close to from_pretrained's
    stored as it is (no bf16 step: the folder's loading before); the host plan counts it as a single
    file's: the stored encoder and one part beside it, not the whole encoder."""
    family, _, sub, folder = folder_of
    bundle = family.load(Source("diffusers", folder, tokenizers=folder), t5_precision="int8")
    t5, tokenizer = bundle.text_encoders[-1], bundle.tokenizers[-1]
    assert stored_precision(t5) == "int8"
    whole = T5EncoderModel.from_pretrained(folder / sub).eval()
    _same_storage(t5, quantize_encoder(copy.deepcopy(whole).to(torch.bfloat16), "int8"))
    got, before = _output(t5, tokenizer), _output(quantize_encoder(whole, "int8"), tokenizer)
    assert torch.allclose(got.float(), before.float(), atol=0.05 * before.abs().max().item())

    cfg = load_config(None, [f"model.path={folder}", f"cache.dir={cache_root}", "data.resolution=64",
                             "train.device=cpu", "model.t5_precision=int8"], need_data=False)
    facts = read_facts(cfg, cache_root)
    name = next(e.name for e in facts.encoders if e.kind == "t5")
    term = host_prediction(facts, cfg).phase("load").parts[name]
    whole_bf16 = 2 * sum(v.numel() for v in whole.state_dict().values())  # what loading whole held beside
    assert storage_bytes(t5) <= term < storage_bytes(t5) + whole_bf16, (term, storage_bytes(t5), whole_bf16)


def test_folder_t5_none_is_not_read(folder_of, tmp_path, cache_root):
    """model.t5_precision = "none": neither a single file's T5 nor a folder's is read (the folder's
    weights truncated to nothing load, where int8 says the file is damaged); both bundles have the
    CLIP encoders and tokenizers only, encode the same, and the host plan has no T5 term."""
    family, file, sub, saved = folder_of
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    (folder / sub / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=sub):
        family.load(Source("diffusers", folder, tokenizers=folder), t5_precision="int8")
    from_folder = family.load(Source("diffusers", folder, tokenizers=folder), t5_precision="none")
    from_file = family.load(Source("single_file", file, tokenizers=file.parent), t5_precision="none")
    clips = len(from_file.text_encoders)
    for bundle in (from_folder, from_file):
        assert len(bundle.text_encoders) == len(bundle.tokenizers) == clips == len(family.files.encoders) - 1
        bundle.extra["t5_precision"] = "none"
        family.prepare_encoders(bundle)
        assert len(bundle.text_encoders) == clips
    a, b = (family.encode_text(x, PROMPT, torch.device("cpu"), torch.float32)
            for x in (from_folder, from_file))
    assert torch.equal(a["prompt_embeds"], b["prompt_embeds"]) and torch.equal(a["pooled"], b["pooled"])
    assert family.encoder_identity(from_folder, "text") == family.encoder_identity(from_file, "text")
    cfg = load_config(None, [f"model.path={saved}", f"cache.dir={cache_root}", "data.resolution=64",
                             "train.device=cpu", "model.t5_precision=none"], need_data=False)
    facts = read_facts(cfg, cache_root)
    t5 = next(e.name for e in facts.encoders if e.kind == "t5")
    assert t5 not in host_prediction(facts, cfg).phase("load").parts


def test_load_encoders_of_a_folder_reads_no_transformer(folder_of, tmp_path):
    """The VAE and text encoders reloaded for a save from a folder: its transformer is not read
    again (its weights truncated to nothing), its T5 is from_pretrained's, as the folder stores it."""
    family, _, sub, saved = folder_of
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.write_bytes(b"")
    vae, encoders = family.load_encoders(Source("diffusers", folder, tokenizers=folder))
    assert vae is not None and len(encoders) == len(family.files.encoders)
    _same_storage(encoders[-1], T5EncoderModel.from_pretrained(saved / sub).eval())


def test_folder_t5_shards_and_their_index(tmp_path):
    """A sharded T5 folder reads as the one-file folder does; a shard its index names but the folder
    lacks is refused naming both."""
    config = T5Config(vocab_size=64, d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False)
    torch.manual_seed(0)
    model = T5EncoderModel(config).eval()
    model.save_pretrained(tmp_path / "one")
    _write_folder(tmp_path / "two", config, {k: v.contiguous() for k, v in model.state_dict().items()
                                             if k != "encoder.embed_tokens.weight"})
    _same_storage(parts.t5_folder_encoder(tmp_path / "two", "nf4"),
                  parts.t5_folder_encoder(tmp_path / "one", "nf4"))
    (tmp_path / "two" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: names model-00002-of-00002"):
        parts.t5_folder_encoder(tmp_path / "two", "int8")
