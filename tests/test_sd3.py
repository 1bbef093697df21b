"""The SD3 family: MMDiT key conversion, layout detection, loading, text encoding, flow-matching
training and saving, with the tiny SD3 single file (real classes, SAI layout) on the CPU."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vramfit.config.schema import TrainConfig
from vramfit.formats.safetensors_io import load_prefixed, save_atomic
from vramfit.models.adapter import Source
from vramfit.models.parts import shipped_config
from vramfit.models.sd3 import flow
from vramfit.models.sd3.family import CLIP_G, T5, T5_EMBED, TRANSFORMER, SD3Family, layout_name
from vramfit.models.sd3.mmdit import diffusers_to_sai_mmdit, sai_to_diffusers_mmdit, sd3_config_from_keys
from vramfit.models.sd3.tiny import materialize_sd3
from vramfit.models.sdxl import SDXLFamily

CPU = torch.device("cpu")
CAPTIONS = ["a red circle", "The blue square on green!"]
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                  num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    return materialize_sd3(tmp_path_factory.mktemp("sd3"))


@pytest.fixture(scope="module")
def no_t5_file(tiny_file, tmp_path_factory) -> Path:
    """The same model without T5, as in sd3_medium_incl_clips.safetensors; no tokenizer_3 beside it."""
    folder = tmp_path_factory.mktemp("sd3-no-t5")
    path = folder / "no-t5.safetensors"
    save_atomic(load_prefixed(tiny_file, "", exclude=T5), path)
    for sub in ("tokenizer", "tokenizer_2"):
        shutil.copytree(tiny_file.parent / sub, folder / sub)
    return path


def _load(path: Path):
    family = SD3Family()
    return family, family.load(Source("single_file", path, tokenizers=path.parent))


@pytest.fixture(scope="module")
def loaded(tiny_file):
    return _load(tiny_file)


def _config(model) -> dict:
    cfg = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    cfg["dual_attention_layers"] = tuple(cfg["dual_attention_layers"])
    return cfg


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---- MMDiT keys ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [{}, {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}],
                         ids=["sd3", "sd3.5-style"])
def test_mmdit_round_trip_is_exact_and_matches_diffusers(variant):
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**{**shipped_config("tiny_sd3_transformer"), **variant})
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    sai = diffusers_to_sai_mmdit(ours)
    assert "joint_blocks.1.context_block.attn.qkv.weight" in sai
    assert not any(k.startswith("joint_blocks.1.context_block.mlp") for k in sai)  # last block: pre-only
    assert ("joint_blocks.0.x_block.attn2.qkv.weight" in sai) == bool(variant)
    assert ("joint_blocks.0.x_block.attn.ln_q.weight" in sai) == bool(variant)
    _assert_same(sai_to_diffusers_mmdit(sai), ours)
    theirs = convert_sd3_transformer_checkpoint_to_diffusers({TRANSFORMER + k: v for k, v in sai.items()})
    _assert_same(sai_to_diffusers_mmdit({TRANSFORMER + k: v for k, v in sai.items()}), theirs)
    assert sd3_config_from_keys(sai) == {**_config(model), "dual_attention_layers": tuple(variant.get(
        "dual_attention_layers", ()))}


def test_tiny_file_transformer_matches_diffusers_conversion(tiny_file):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    sai = load_prefixed(tiny_file, TRANSFORMER)
    ours = sai_to_diffusers_mmdit(sai)
    _assert_same(ours, convert_sd3_transformer_checkpoint_to_diffusers(
        {TRANSFORMER + k: v.clone() for k, v in sai.items()}))
    _assert_same(diffusers_to_sai_mmdit(ours), sai)


def test_unknown_or_missing_mmdit_keys_raise():
    from diffusers import SD3Transformer2DModel

    from vramfit.formats.keys import UnmappedKeysError

    sai = diffusers_to_sai_mmdit(SD3Transformer2DModel(**shipped_config("tiny_sd3_transformer")).state_dict())
    with pytest.raises(UnmappedKeysError, match="unmapped"):
        sai_to_diffusers_mmdit({**sai, "joint_blocks.0.x_block.extra.weight": torch.zeros(1)})
    del sai["joint_blocks.0.x_block.mlp.fc1.bias"]
    with pytest.raises(UnmappedKeysError, match="missing"):
        sai_to_diffusers_mmdit(sai)


def test_config_from_keys_full_size_sd3_medium_on_meta():
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(**SD3_MEDIUM)
    assert sum(p.numel() for p in model.parameters()) == 2_028_328_000
    sai = diffusers_to_sai_mmdit(model.state_dict())
    assert all(t.device.type == "meta" for t in sai.values())
    assert sai["pos_embed"].shape == (1, 36864, 1536)
    assert "joint_blocks.23.context_block.attn.proj.weight" not in sai
    cfg = sd3_config_from_keys({TRANSFORMER + k: v for k, v in sai.items()})
    assert cfg == {**SD3_MEDIUM, "dual_attention_layers": (), "qk_norm": None}
    assert layout_name(cfg) == "sd3-medium"
    assert set(sai_to_diffusers_mmdit(sai)) == set(model.state_dict())


def test_config_from_keys_sd35_style_qk_norm_and_dual_attention_on_meta():
    from diffusers import SD3Transformer2DModel

    sd35m = {**SD3_MEDIUM, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
             "dual_attention_layers": tuple(range(13))}
    with torch.device("meta"):
        model = SD3Transformer2DModel(**sd35m)
    sai = diffusers_to_sai_mmdit(model.state_dict())
    assert "joint_blocks.12.x_block.attn2.qkv.weight" in sai
    assert "joint_blocks.13.x_block.attn2.qkv.weight" not in sai
    cfg = sd3_config_from_keys(sai)
    assert cfg == sd35m
    assert layout_name(cfg) == "sd3.5-medium"
    assert set(sai_to_diffusers_mmdit(sai)) == set(model.state_dict())


# ---- loading -------------------------------------------------------------------------------------
def test_tiny_single_file_loads(tiny_file, loaded):
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    family, bundle = loaded
    keys = set(load_file(str(tiny_file)))
    assert family.detect_single_file(keys) and not SDXLFamily().detect_single_file(keys)
    assert family.detect_diffusers({"_class_name": "StableDiffusion3Pipeline"})
    assert not family.detect_diffusers({"_class_name": "StableDiffusionXLPipeline"})
    assert isinstance(bundle.denoiser, SD3Transformer2DModel)
    shipped = shipped_config("tiny_sd3_transformer")
    assert _config(bundle.denoiser) == {**shipped, "dual_attention_layers": ()}
    assert isinstance(bundle.vae, AutoencoderKL)
    vc = bundle.vae.config
    assert (vc.latent_channels, vc.scaling_factor, vc.shift_factor) == (16, 1.5305, 0.0609)
    assert not vc.use_quant_conv and not vc.use_post_quant_conv
    clip_l, clip_g, t5 = bundle.text_encoders
    assert isinstance(clip_l, CLIPTextModelWithProjection) and isinstance(clip_g, CLIPTextModelWithProjection)
    assert isinstance(t5, T5EncoderModel)
    assert torch.equal(clip_l.text_projection.weight, torch.eye(64))  # SD3 files carry no CLIP-L projection
    with safe_open(str(tiny_file), "pt") as fh:
        assert torch.equal(clip_g.text_projection.weight, fh.get_tensor(CLIP_G + "text_projection.weight"))
        stored = fh.get_tensor(T5 + "encoder.block.0.layer.0.SelfAttention.q.weight")
    assert stored.dtype == torch.float8_e4m3fn
    q = t5.encoder.block[0].layer[0].SelfAttention.q.weight
    assert q.dtype == torch.bfloat16 and torch.equal(q, stored.to(torch.bfloat16))
    assert t5.encoder.embed_tokens.weight is t5.shared.weight
    assert len(bundle.tokenizers) == 3 and bundle.tokenizers[2].eos_token_id == 1
    assert bundle.tokenizers[2].pad_token_id == 0
    assert bundle.noise_scheduler.config.shift == 3.0
    assert sum(p.numel() for m in (bundle.denoiser, bundle.vae, *bundle.text_encoders)
               for p in m.parameters()) < 5_000_000
    info = family.describe(bundle.source)
    assert info["family"] == "sd3" and info["num_layers"] == 2 and info["t5"]
    assert set(info["components"]["text_encoder_3 (T5)"]["dtypes"]) == {"F8_E4M3"}  # as Stability's t5xxlfp8


# ---- text and images -----------------------------------------------------------------------------
def test_encode_text_shapes_padding_and_t5_part(loaded):
    family, bundle = loaded
    out = family.encode_text(bundle, CAPTIONS, CPU, torch.float32)
    assert out["prompt_embeds"].shape == (2, 77 + 77, 256)  # joint_attention_dim = T5 d_model
    assert out["pooled"].shape == (2, 128)  # CLIP-L 64 + CLIP-G 64
    clip, t5 = out["prompt_embeds"][:, :77], out["prompt_embeds"][:, 77:]
    assert torch.count_nonzero(clip[..., 128:]) == 0  # 64 + 64 CLIP channels zero-padded to 256
    assert torch.count_nonzero(clip[..., :128]) > 0 and torch.count_nonzero(t5) > 0
    assert not torch.equal(out["prompt_embeds"][0], out["prompt_embeds"][1])
    short = family.encode_text(bundle, CAPTIONS, CPU, torch.float32, max_sequence_length=20)
    assert short["prompt_embeds"].shape == (2, 77 + 20, 256)
    assert torch.equal(short["prompt_embeds"][:, :77], clip)
    assert all(next(m.parameters()).device.type == "cpu" for m in bundle.text_encoders)


def test_t5_less_file_gives_zeros_in_the_t5_part(loaded, no_t5_file):
    family, bundle = loaded
    _, small = _load(no_t5_file)
    assert len(small.text_encoders) == 2 and len(small.tokenizers) == 2
    out = family.encode_text(small, CAPTIONS, CPU, torch.float32)
    full = family.encode_text(bundle, CAPTIONS, CPU, torch.float32)
    assert out["prompt_embeds"].shape == (2, 154, 256)
    assert torch.count_nonzero(out["prompt_embeds"][:, 77:]) == 0
    assert torch.equal(out["prompt_embeds"][:, :77], full["prompt_embeds"][:, :77])
    assert torch.equal(out["pooled"], full["pooled"])
    assert family.encoder_identity(small, "text") != family.encoder_identity(bundle, "text")


def test_latents_are_shifted_and_scaled(loaded):
    family, bundle = loaded
    enc = family.encode_images(bundle, torch.rand(1, 3, 64, 64) * 2 - 1, CPU, torch.float32, tiling=False)
    assert enc["mean"].shape == (1, 16, 8, 8) and enc["logvar"].shape == (1, 16, 8, 8)
    sharp = {"mean": enc["mean"], "logvar": torch.full_like(enc["logvar"], -30.0)}
    lat = family.latents(bundle, sharp, torch.Generator().manual_seed(0))
    assert torch.allclose(lat, (enc["mean"] - 0.0609) * 1.5305, atol=1e-5)


# ---- training ------------------------------------------------------------------------------------
def _batch(family, bundle):
    torch.manual_seed(1)
    enc = family.encode_images(bundle, torch.rand(2, 3, 64, 64) * 2 - 1, CPU, torch.float32, tiling=False)
    return {**enc, **family.encode_text(bundle, CAPTIONS, CPU, torch.float32)}


def test_training_loss_finite_reproducible_and_reaches_the_transformer(loaded):
    family, bundle = loaded
    batch, cfg = _batch(family, bundle), TrainConfig(precision="fp32")
    model = bundle.denoiser.float().train()

    def loss(seed):
        return family.training_loss(bundle, batch, cfg, torch.Generator().manual_seed(seed), CPU, torch.float32)

    a = loss(0)
    assert torch.isfinite(a) and a.item() > 0
    assert torch.equal(a.detach(), loss(0).detach())
    assert not torch.equal(a.detach(), loss(1).detach())
    model.zero_grad()
    a.backward()
    for name in ("pos_embed.proj.weight", "transformer_blocks.0.attn.to_q.weight", "context_embedder.weight",
                 "time_text_embed.text_embedder.linear_1.weight", "proj_out.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.count_nonzero(grad) > 0, name
    model.zero_grad()
    for scheme in flow.WEIGHTING_SCHEMES:
        class Cfg:  # the schema gains these keys later; getattr defaults cover their absence
            weighting_scheme = scheme
            mode_scale = 1.29
        assert torch.isfinite(family.training_loss(bundle, batch, Cfg(), torch.Generator().manual_seed(0),
                                                   CPU, torch.float32))
    with pytest.raises(ValueError, match="noise_offset"):
        family.training_loss(bundle, batch, TrainConfig(noise_offset=0.1), torch.Generator(), CPU, torch.float32)


def test_training_loss_follows_the_flow_matching_formulas(loaded):
    """Redraw the same randomness and rebuild the loss from diffusers' scheduler and formulas."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    family, bundle = loaded
    batch = _batch(family, bundle)
    model = bundle.denoiser.float().eval()

    class Cfg:
        weighting_scheme, logit_mean, logit_std = "cosmap", 0.0, 1.0

    with torch.no_grad():
        got = family.training_loss(bundle, batch, Cfg(), torch.Generator().manual_seed(7), CPU, torch.float32)
        g = torch.Generator().manual_seed(7)
        std = torch.exp(0.5 * batch["logvar"].clamp(-30, 20))
        x = (batch["mean"] + std * torch.randn(batch["mean"].shape, generator=g) - 0.0609) * 1.5305
        noise = torch.randn(x.shape, generator=g)
        u = torch.rand(2, generator=g)  # cosmap samples u uniformly
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
        idx = (u * 1000).long()
        sigma = sched.sigmas[idx].view(-1, 1, 1, 1)
        noisy = (1 - sigma) * x + sigma * noise
        pred = model(hidden_states=noisy, timestep=sched.timesteps[idx],
                     encoder_hidden_states=batch["prompt_embeds"], pooled_projections=batch["pooled"]).sample
        w = 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))
        want = (w * (pred - (noise - x)) ** 2).reshape(2, -1).mean(1).mean()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


# ---- flow.py -------------------------------------------------------------------------------------
def test_flow_densities_against_their_formulas():
    from diffusers.training_utils import compute_density_for_timestep_sampling

    n = 20000
    u = flow.sample_density("logit_normal", n, torch.Generator().manual_seed(0))
    assert abs(u.mean().item() - 0.5) < 0.01 and 0 < u.min() and u.max() < 1
    shifted = flow.sample_density("logit_normal", n, torch.Generator().manual_seed(0), logit_mean=1.0)
    assert abs(shifted.median().item() - 1 / (1 + math.exp(-1))) < 0.01
    plain = torch.rand(n, generator=torch.Generator().manual_seed(0))
    mode = flow.sample_density("mode", n, torch.Generator().manual_seed(0), mode_scale=1.29)
    assert torch.allclose(mode, 1 - plain - 1.29 * (torch.cos(math.pi * plain / 2) ** 2 - 1 + plain))
    assert torch.equal(flow.sample_density("uniform", n, torch.Generator().manual_seed(0)), plain)
    assert torch.equal(flow.sample_density("cosmap", n, torch.Generator().manual_seed(0)), plain)
    assert abs(plain.mean().item() - 0.5) < 0.01
    for scheme, theirs in (("logit_normal", "logit_normal"), ("mode", "mode"), ("uniform", "none")):
        ours = flow.sample_density(scheme, 16, torch.Generator().manual_seed(3), logit_mean=0.2, logit_std=1.1)
        ref = compute_density_for_timestep_sampling(theirs, 16, logit_mean=0.2, logit_std=1.1, mode_scale=1.29,
                                                    generator=torch.Generator().manual_seed(3))
        assert torch.equal(ours, ref), scheme
    with pytest.raises(ValueError, match="weighting_scheme"):
        flow.sample_density("sigma_sqrt", 2, torch.Generator())


def test_flow_sigma_table_lookup_and_weighting():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    table = flow.shifted_sigmas(1000, 3.0)
    assert torch.equal(table, sched.sigmas)
    u = torch.tensor([0.0, 0.2501, 0.999, 1.0])
    sigmas, timesteps = flow.lookup_sigmas(u, table)
    idx = torch.tensor([0, 250, 999, 999])  # u == 1 is clamped into the table
    assert torch.equal(sigmas, sched.sigmas[idx]) and torch.equal(timesteps, sched.timesteps[idx])
    assert sigmas[0] == 1.0
    s = torch.linspace(0, 1, 11)
    assert torch.allclose(flow.loss_weighting("cosmap", s), 2 / (math.pi * (1 - 2 * s + 2 * s ** 2)))
    assert torch.equal(flow.loss_weighting("cosmap", s), compute_loss_weighting_for_sd3("cosmap", s))
    assert flow.loss_weighting("cosmap", torch.tensor(0.5)).item() == pytest.approx(4 / math.pi)
    for scheme in ("logit_normal", "mode", "uniform"):
        assert torch.equal(flow.loss_weighting(scheme, s), torch.ones(11))
    x, noise = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    noisy, target = flow.flow_inputs(x, noise, torch.tensor([0.0, 1.0]))
    assert torch.equal(noisy[0], x[0]) and torch.equal(noisy[1], noise[1]) and torch.equal(target, noise - x)


# ---- saving --------------------------------------------------------------------------------------
def test_save_single_file_round_trip_is_exact(loaded, tiny_file, tmp_path):
    family, bundle = loaded
    out = tmp_path / "saved.safetensors"
    family.save_single_file(bundle, out, torch.float32, {"k": "v"})
    saved, original = load_file(str(out)), load_file(str(tiny_file))
    # the tied T5 embedding under both of its names, as Stability's files carry it (also where the
    # source has it once); the rest byte for byte
    assert set(saved) == set(original) | {T5 + T5_EMBED}
    assert torch.equal(saved[T5 + T5_EMBED], saved[T5 + "shared.weight"])
    _assert_same({k: saved[k] for k in original}, original)
    with safe_open(str(out), "pt") as fh:
        meta = fh.metadata()
    assert meta["k"] == "v" and meta["modelspec.architecture"] == "stable-diffusion-3"
    for sub in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        shutil.copytree(tiny_file.parent / sub, tmp_path / sub)
    _, again = _load(out)
    for a, b in ((bundle.denoiser, again.denoiser), (bundle.vae, again.vae),
                 *zip(bundle.text_encoders, again.text_encoders)):
        _assert_same(a.state_dict(), b.state_dict())


def test_save_diffusers_loads_back_and_as_a_pipeline(loaded, tiny_file, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    family, bundle = loaded
    folder = tmp_path / "sd3-diffusers"
    family.save_diffusers(bundle, folder, torch.float32)
    index = json.loads((folder / "model_index.json").read_text())
    assert family.detect_diffusers(index) and index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    source = Source("diffusers", folder, tokenizers=folder)
    again = family.load(source)
    _assert_same(again.denoiser.state_dict(), bundle.denoiser.state_dict())
    a = family.encode_text(bundle, CAPTIONS, CPU, torch.float32)
    b = family.encode_text(again, CAPTIONS, CPU, torch.float32)
    assert torch.equal(a["prompt_embeds"], b["prompt_embeds"]) and torch.equal(a["pooled"], b["pooled"])
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    assert pipe.transformer.config.joint_attention_dim == 256 and pipe.text_encoder_3 is not None
    # a single file written from the diffusers folder has the key set of Stability's layout
    saved = tmp_path / "from-diffusers.safetensors"
    family.save_single_file(again, saved, torch.float32, {})
    ours, original = load_file(str(saved)), load_file(str(tiny_file))
    assert set(ours) == set(original) | {T5 + T5_EMBED}
    for k in original:
        assert torch.equal(ours[k].float(), original[k].float()), k


def _no_meta(pipe) -> None:
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name)
        tensors = [*module.named_parameters(), *module.named_buffers()]
        left = [n for n, t in tensors if t.device.type == "meta"]
        assert not left, (name, left)


def test_exports_load_in_diffusers_from_single_file_with_the_source_dtypes(loaded, tiny_file, tmp_path):
    """A single file written from tiny:sd3 and one written from an fp16 diffusers folder: diffusers'
    from_single_file leaves no tensor unset (the tied T5 embedding is in the file under Stability's
    name), the key set is Stability's, and carried-over weights keep the source's dtypes (T5's `wo`,
    which transformers keeps in fp32, included)."""
    from diffusers import StableDiffusion3Pipeline

    family, bundle = loaded
    folder = tmp_path / "fp16"
    half = dataclasses.replace(bundle, vae=copy.deepcopy(bundle.vae).half(),  # an fp16 source throughout
                               text_encoders=[copy.deepcopy(e).half() for e in bundle.text_encoders])
    family.save_diffusers(half, folder, torch.float16)
    from_file, from_folder = tmp_path / "from-file.safetensors", tmp_path / "from-folder.safetensors"
    family.save_single_file(bundle, from_file, torch.float16, {})
    again = family.load(Source("diffusers", folder, tokenizers=folder))
    assert again.text_encoders[2].encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    family.save_single_file(again, from_folder, torch.float16, {})
    keys = set(load_file(str(tiny_file))) | {T5 + T5_EMBED}
    for path in (from_file, from_folder):
        saved = load_file(str(path))
        assert set(saved) == keys
        pipe = StableDiffusion3Pipeline.from_single_file(str(path), config=str(folder), local_files_only=True)
        _no_meta(pipe)
        t5 = pipe.text_encoder_3
        assert torch.equal(t5.encoder.embed_tokens.weight.float(), saved[T5 + "shared.weight"].float())
        assert torch.equal(t5.encoder.block[1].layer[1].DenseReluDense.wo.weight.float(),
                           saved[T5 + "encoder.block.1.layer.1.DenseReluDense.wo.weight"].float())
    dtypes = {k: v.dtype for k, v in load_file(str(from_folder)).items() if not k.startswith(TRANSFORMER)}
    assert {d for d in dtypes.values() if d.is_floating_point} == {torch.float16}, dtypes
    original = load_file(str(tiny_file))  # fp32, with T5 in fp8; save.dtype applies to the transformer only
    assert all(original[k].dtype == v.dtype for k, v in load_file(str(from_file)).items()
               if k in original and not k.startswith(TRANSFORMER))
