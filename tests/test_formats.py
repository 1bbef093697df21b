"""Tests for vramfit.formats: SGM UNet, LDM VAE and CLIP/OpenCLIP key maps.

Tiny random models of the real diffusers/transformers classes check round trips and agreement with
diffusers' own single-file converters; full-size SDXL, SSD-1B, Segmind-Vega, bigG and VAE configs
are checked on the meta device (shapes only, no memory).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from vramfit.formats.clip import (
    clip_config_from_keys,
    hf_to_openclip,
    normalize_hf_clip_keys,
    openclip_to_hf,
    to_sgm_clip_keys,
)
from vramfit.formats.keys import UnmappedKeysError
from vramfit.formats.ldm_vae import diffusers_to_ldm_vae, ldm_to_diffusers_vae, vae_config_from_ldm, vae_key_map
from vramfit.models.sdxl.sgm_unet import (
    check_text_time,
    diffusers_to_sgm_unet,
    sgm_to_diffusers_unet,
    unet_config_from_sgm,
    unet_key_map,
)

# Published SDXL base 1.0 unet/config.json (model-facts 1.1), without "_class_name".
SDXL_UNET = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "attention_type": "default",
    "block_out_channels": [320, 640, 1280], "center_input_sample": False,
    "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3,
    "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dropout": 0.0, "dual_cross_attention": False,
    "encoder_hid_dim": None, "encoder_hid_dim_type": None, "flip_sin_to_cos": True, "freq_shift": 0,
    "in_channels": 4, "layers_per_block": 2, "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None,
    "only_cross_attention": False, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False, "resnet_time_scale_shift": "default",
    "reverse_transformer_layers_per_block": None, "sample_size": 128, "time_cond_proj_dim": None,
    "time_embedding_act_fn": None, "time_embedding_dim": None, "time_embedding_type": "positional",
    "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None, "use_linear_projection": True,
}
# model-facts 1.2: SSD-1B differs from SDXL in exactly these three fields.
SSD1B_UNET = dict(
    SDXL_UNET,
    mid_block_type="UNetMidBlock2D",
    transformer_layers_per_block=[1, [2, 2], [4, 4]],
    reverse_transformer_layers_per_block=[[4, 4, 10], [2, 1, 1], 1],
)
# ComfyUI model_detection Segmind_Vega: depths [0,0,1,1,2,2], output [0,0,0,1,1,1,2,2,2] (listed
# from output_blocks.8 down), middle -1: symmetric, so plain ints and no reverse list.
VEGA_UNET = dict(SDXL_UNET, mid_block_type="UNetMidBlock2D", transformer_layers_per_block=[1, 1, 2])

TINY_SDXL_UNET = dict(
    SDXL_UNET,
    block_out_channels=[32, 64, 128],
    attention_head_dim=[1, 1, 2],
    cross_attention_dim=64,
    transformer_layers_per_block=[1, 1, 2],
    projection_class_embeddings_input_dim=32 + 6 * 256,
)
# SSD-1B-like: resnet-only mid block, uneven depths inside a level, asymmetric down/up.
TINY_SSD_UNET = dict(
    TINY_SDXL_UNET,
    mid_block_type="UNetMidBlock2D",
    transformer_layers_per_block=[1, [1, 2], [2, 2]],
    reverse_transformer_layers_per_block=[[2, 2, 3], [2, 1, 1], 1],
)
TINY_UNETS = {"sdxl": TINY_SDXL_UNET, "ssd1b": TINY_SSD_UNET}
FULL_UNETS = {"sdxl": (SDXL_UNET, 2_567_463_684), "ssd1b": (SSD1B_UNET, 1_331_334_404), "vega": (VEGA_UNET, None)}

SDXL_VAE = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True, "in_channels": 3, "latent_channels": 4, "latents_mean": None, "latents_std": None,
    "layers_per_block": 2, "mid_block_add_attention": True, "norm_num_groups": 32, "out_channels": 3,
    "sample_size": 1024, "scaling_factor": 0.13025, "shift_factor": None, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True, "use_quant_conv": True,
}
SD3_VAE = dict(SDXL_VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
               scaling_factor=1.5305, shift_factor=0.0609)
TINY_VAES = {
    "flat": dict(SDXL_VAE, block_out_channels=[32, 32, 32, 32], layers_per_block=1, sample_size=32),
    # widening levels exercise nin_shortcut <-> conv_shortcut
    "widening": dict(SDXL_VAE, block_out_channels=[32, 64, 64, 64], layers_per_block=1, sample_size=32),
}

TINY_CLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                 vocab_size=1000, max_position_embeddings=77, bos_token_id=998, eos_token_id=999, pad_token_id=1)
SGM_OPENCLIP_PREFIX = "conditioner.embedders.1.model."


def _random_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter with distinct random values, so a swapped tensor cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


def _assert_same_tensors(a, b):
    assert set(a) == set(b), (sorted(set(a) - set(b))[:5], sorted(set(b) - set(a))[:5])
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def _sgm_depths(sgm_keys):
    """{'input_blocks.4': 2, ...}: transformer blocks per SGM block, read from key names."""
    out = {}
    for k in sgm_keys:
        parts = k.split(".")
        if "transformer_blocks" in parts:
            i = parts.index("transformer_blocks")
            block = ".".join(parts[: i - 1])
            out[block] = max(out.get(block, 0), int(parts[i + 1]) + 1)
    return out


@pytest.fixture(scope="module", params=sorted(TINY_UNETS))
def tiny_unet(request):
    config = TINY_UNETS[request.param]
    torch.manual_seed(0)
    return config, _random_(UNet2DConditionModel(**config)).eval()


# ----------------------------------------------------------------------------- UNet
def test_unet_key_map_covers_tiny_models_one_to_one(tiny_unet):
    config, model = tiny_unet
    key_map = unet_key_map(config)
    assert set(key_map) == set(model.state_dict())
    assert len(set(key_map.values())) == len(key_map)


def test_unet_round_trip_is_identity(tiny_unet):
    config, model = tiny_unet
    sd = model.state_dict()
    sgm = diffusers_to_sgm_unet(sd, config)
    assert all(k.split(".")[0] in {"input_blocks", "middle_block", "output_blocks", "time_embed", "label_emb", "out"}
               for k in sgm)
    back = sgm_to_diffusers_unet(sgm, config)
    _assert_same_tensors(back, sd)
    assert all(back[k] is sd[k] for k in sd)  # names only: no copies
    fresh = UNet2DConditionModel(**config)
    fresh.load_state_dict(back, strict=True)


def test_unet_config_read_back_from_sgm_keys(tiny_unet):
    config, model = tiny_unet
    inferred = unet_config_from_sgm(diffusers_to_sgm_unet(model.state_dict(), config))
    assert inferred == config
    with torch.device("meta"):
        rebuilt = UNet2DConditionModel(**inferred)
    assert _shapes(rebuilt.state_dict()) == _shapes(model.state_dict())


def test_unet_sgm_to_diffusers_matches_diffusers_converter(tiny_unet):
    config, model = tiny_unet
    sgm = diffusers_to_sgm_unet(model.state_dict(), config)
    theirs = convert_ldm_unet_checkpoint({"model.diffusion_model." + k: v for k, v in sgm.items()}, dict(config))
    _assert_same_tensors(sgm_to_diffusers_unet(sgm, config), theirs)


def test_tiny_sdxl_sgm_layout_names():
    sgm = set(unet_key_map(TINY_SDXL_UNET).values())
    for key in ("input_blocks.3.0.op.weight", "input_blocks.4.0.skip_connection.weight",
                "input_blocks.4.1.proj_in.weight", "middle_block.1.transformer_blocks.1.attn2.to_k.weight",
                "output_blocks.2.2.conv.weight", "output_blocks.5.2.conv.weight",
                "output_blocks.8.0.out_layers.3.weight",
                "label_emb.0.2.bias", "time_embed.0.weight", "out.2.weight"):
        assert key in sgm, key
    assert "output_blocks.8.1.conv.weight" not in sgm  # the last up level has no upsampler


@pytest.mark.parametrize("name", sorted(FULL_UNETS))
def test_full_size_unet_configs_on_meta(name):
    config, params = FULL_UNETS[name]
    with torch.device("meta"):
        model = UNet2DConditionModel(**config)
    sd = model.state_dict()
    if params is not None:
        assert sum(p.numel() for p in model.parameters()) == params
    assert set(unet_key_map(config)) == set(sd)
    sgm = diffusers_to_sgm_unet(sd, config)
    inferred = unet_config_from_sgm(sgm)
    assert inferred == config  # exactly the published / model-facts config
    with torch.device("meta"):
        rebuilt = UNet2DConditionModel(**inferred)
    assert _shapes(rebuilt.state_dict()) == _shapes(sd)


def test_full_size_sgm_layouts_match_reference():
    sdxl = set(unet_key_map(SDXL_UNET).values())
    assert len(sdxl) == 1680 and _sgm_depths(sdxl)["middle_block"] == 10
    # model-facts 2.3: the SSD-1B single-file layout
    ssd = set(unet_key_map(SSD1B_UNET).values())
    assert _sgm_depths(ssd) == {
        "input_blocks.4": 2, "input_blocks.5": 2, "input_blocks.7": 4, "input_blocks.8": 4,
        "output_blocks.0": 4, "output_blocks.1": 4, "output_blocks.2": 10,
        "output_blocks.3": 2, "output_blocks.4": 1, "output_blocks.5": 1,
    }
    assert "output_blocks.2.1.transformer_blocks.9.attn2.to_k.weight" in ssd
    assert "output_blocks.2.2.conv.weight" in ssd
    assert not any(k.startswith(("middle_block.1.", "middle_block.2.")) for k in ssd)
    assert "middle_block.0.in_layers.0.weight" in ssd
    vega = set(unet_key_map(VEGA_UNET).values())
    assert _sgm_depths(vega) == {
        "input_blocks.4": 1, "input_blocks.5": 1, "input_blocks.7": 2, "input_blocks.8": 2,
        "output_blocks.0": 2, "output_blocks.1": 2, "output_blocks.2": 2,
        "output_blocks.3": 1, "output_blocks.4": 1, "output_blocks.5": 1,
    }


def test_unet_errors_name_the_problem():
    vae_keys = {k: torch.empty(1, device="meta") for k in vae_key_map(SDXL_VAE).values()}
    with pytest.raises(ValueError, match="'input_blocks.0.0.weight'"):
        unet_config_from_sgm(vae_keys)
    sgm = {k: torch.empty(1, device="meta") for k in unet_key_map(TINY_SDXL_UNET).values()}
    prefixed = {"model.diffusion_model." + k: v for k, v in sgm.items()}
    with pytest.raises(ValueError, match="prefix"):
        unet_config_from_sgm(prefixed)
    with pytest.raises(UnmappedKeysError, match="input_blocks.99.0.foo") as info:
        sgm_to_diffusers_unet({**sgm, "input_blocks.99.0.foo": torch.empty(1)}, TINY_SDXL_UNET)
    assert isinstance(info.value, KeyError)
    partial = dict(sgm)
    del partial["out.2.weight"]
    with pytest.raises(UnmappedKeysError, match="1 missing key.*out.2.weight"):
        sgm_to_diffusers_unet(partial, TINY_SDXL_UNET)
    assert "conv_out.weight" not in sgm_to_diffusers_unet(partial, TINY_SDXL_UNET, strict=False)
    with pytest.raises(ValueError, match="class_embed_type"):
        unet_key_map(dict(TINY_SDXL_UNET, class_embed_type="timestep"))


def _meta_sgm(config: dict) -> dict:
    with torch.device("meta"):
        return diffusers_to_sgm_unet(UNet2DConditionModel(**config).state_dict(), config)


def test_size_embedding_width_gives_addition_time_embed_dim_or_is_refused():
    """label_emb.0.0's inputs = pooled text embedding + 6 x addition_time_embed_dim: read when the
    pooled width is known; SDXL's 256 otherwise; no whole width is an error naming the key."""
    sgm = _meta_sgm(TINY_SDXL_UNET)  # 32 + 6 x 256 inputs
    assert unet_config_from_sgm(sgm)["addition_time_embed_dim"] == 256
    assert unet_config_from_sgm(sgm, pooled_dim=32)["addition_time_embed_dim"] == 256
    wider = dict(sgm, **{"label_emb.0.0.weight": torch.empty(128, 32 + 6 * 320, device="meta")})
    config = unet_config_from_sgm(wider, pooled_dim=32)
    assert (config["addition_time_embed_dim"], config["projection_class_embeddings_input_dim"]) == (320, 1952)
    with torch.device("meta"):  # and the model built from it takes SDXL's conditioning
        assert UNet2DConditionModel(**config).add_embedding.linear_1.weight.shape[1] == 32 + 6 * 320
    for width, pooled in ((32 + 6 * 256 + 3, 32), (32 + 6 * 256, 64 + 6 * 256)):
        odd = dict(sgm, **{"label_emb.0.0.weight": torch.empty(128, width, device="meta")})
        with pytest.raises(ValueError, match=f"label_emb.0.0.weight takes {width} inputs"):
            unet_config_from_sgm(odd, pooled_dim=pooled)
    check_text_time(TINY_SDXL_UNET, 32)
    with pytest.raises(ValueError, match="addition_time_embed_dim 200"):
        check_text_time(dict(TINY_SDXL_UNET, addition_time_embed_dim=200), 32)


def test_channels_the_group_norms_do_not_divide_are_refused():
    """A UNet built with 16 groups over 48-channel blocks: its file does not say 16, and SDXL's 32
    does not divide 48, so reading it is refused naming the first such norm (not a diffusers error
    or a wrong model later)."""
    config = dict(TINY_SDXL_UNET, block_out_channels=[48, 96, 192], norm_num_groups=16)
    with pytest.raises(ValueError, match=r"input_blocks.1.0.in_layers.0.weight normalises 48 channels.*32 "):
        unet_config_from_sgm(_meta_sgm(config))
    # where 32 divides every count, the file reads as SDXL's 32 groups (assumed; inspect says so)
    divisible = _meta_sgm(dict(config, block_out_channels=[64, 96, 192]))
    assert unet_config_from_sgm(divisible)["norm_num_groups"] == 32


# ----------------------------------------------------------------------------- VAE
@pytest.fixture(scope="module", params=sorted(TINY_VAES))
def tiny_vae(request):
    config = TINY_VAES[request.param]
    return config, _random_(AutoencoderKL(**config), seed=1).eval()


def test_vae_round_trip_and_ldm_layout(tiny_vae):
    config, model = tiny_vae
    sd = model.state_dict()
    ldm = diffusers_to_ldm_vae(sd)
    assert ldm["encoder.mid.attn_1.q.weight"].shape[-2:] == (1, 1)
    assert ldm["decoder.mid.attn_1.proj_out.weight"].ndim == 4
    assert "decoder.up.3.upsample.conv.weight" in ldm and "decoder.up.0.upsample.conv.weight" not in ldm
    assert "encoder.down.3.downsample.conv.weight" not in ldm and "encoder.norm_out.weight" in ldm
    n_level = len(config["block_out_channels"])
    first_run = ldm[f"decoder.up.{n_level - 1}.block.0.conv1.weight"]  # LDM numbers decoder levels backwards
    assert torch.equal(first_run, sd["decoder.up_blocks.0.resnets.0.conv1.weight"])
    if config["block_out_channels"][1] != config["block_out_channels"][0]:
        assert "encoder.down.1.block.0.nin_shortcut.weight" in ldm
    back = ldm_to_diffusers_vae(ldm)
    _assert_same_tensors(back, sd)
    AutoencoderKL(**config).load_state_dict(back, strict=True)


def test_vae_config_read_back_and_matches_diffusers_converter(tiny_vae):
    config, model = tiny_vae
    ldm = diffusers_to_ldm_vae(model.state_dict())
    inferred = vae_config_from_ldm(ldm, scaling_factor=config["scaling_factor"])
    assert inferred == dict(config, sample_size=1024)  # sample_size is not in the weights
    theirs = convert_ldm_vae_checkpoint({"first_stage_model." + k: v for k, v in ldm.items()}, inferred)
    _assert_same_tensors(ldm_to_diffusers_vae(ldm), theirs)


@pytest.mark.parametrize("config", [SDXL_VAE, SD3_VAE], ids=["sdxl", "sd3"])
def test_full_size_vae_configs_on_meta(config):
    with torch.device("meta"):
        model = AutoencoderKL(**config)
    sd = model.state_dict()
    assert set(vae_key_map(config)) == set(sd)
    ldm = diffusers_to_ldm_vae(sd)
    assert ("quant_conv.weight" in ldm) == config["use_quant_conv"]
    inferred = vae_config_from_ldm(ldm, scaling_factor=config["scaling_factor"], shift_factor=config["shift_factor"])
    assert inferred == config
    assert _shapes(ldm_to_diffusers_vae(ldm)) == _shapes(sd)
    if config is SDXL_VAE:
        assert sum(p.numel() for p in model.parameters()) == 83_653_863


def test_vae_errors():
    with pytest.raises(ValueError, match="'encoder.down.0.block.0.conv1.weight'"):
        vae_config_from_ldm({"input_blocks.0.0.weight": torch.empty(1)})
    with torch.device("meta"):
        ldm = diffusers_to_ldm_vae(AutoencoderKL(**TINY_VAES["flat"]).state_dict())
    with pytest.raises(UnmappedKeysError, match="encoder.down.0.attn.0.q.weight"):
        ldm_to_diffusers_vae({**ldm, "encoder.down.0.attn.0.q.weight": torch.empty(1)})


# ----------------------------------------------------------------------------- CLIP
def _tiny_clip(cls, *, projection_dim=64, hidden_act="quick_gelu", seed=2):
    torch.manual_seed(seed)
    config = CLIPTextConfig(**TINY_CLIP, projection_dim=projection_dim, hidden_act=hidden_act)
    return _random_(cls(config), seed=seed).eval()


@pytest.mark.parametrize("cls", [CLIPTextModel, CLIPTextModelWithProjection])
def test_clip_single_file_keys_round_trip(cls):
    model = _tiny_clip(cls)
    sd = model.state_dict()
    sgm = to_sgm_clip_keys(sd)
    assert all(k.startswith("text_model.") or k == "text_projection.weight" for k in sgm)
    assert torch.equal(sgm["text_model.embeddings.position_ids"], torch.arange(77).unsqueeze(0))
    assert ("text_projection.weight" in sgm) == (cls is CLIPTextModelWithProjection)
    loaded = normalize_hf_clip_keys(sgm, model)
    _assert_same_tensors(loaded, sd)
    cls(model.config).load_state_dict(loaded, strict=True)
    # a flat (transformers >= 5.6 CLIPTextModel style) dict loads into either class too
    flat = {k.removeprefix("text_model."): v for k, v in sd.items()}
    _assert_same_tensors(normalize_hf_clip_keys(flat, model), sd)


def test_clip_position_ids_follow_the_model():
    model = _tiny_clip(CLIPTextModel)
    sgm = to_sgm_clip_keys(model.state_dict())
    assert not any(k.endswith("position_ids") for k in normalize_hf_clip_keys(sgm, model))
    # older transformers versions persisted the buffer: then it must be supplied
    emb = model.embeddings if hasattr(model, "embeddings") else model.text_model.embeddings
    emb.register_buffer("position_ids", torch.arange(77).unsqueeze(0), persistent=True)
    without = {k: v for k, v in sgm.items() if not k.endswith("position_ids")}
    loaded = normalize_hf_clip_keys(without, model)
    model.load_state_dict(loaded, strict=True)


@pytest.mark.parametrize("with_projection", [False, True])
def test_clip_config_from_keys_rebuilds_the_model(with_projection):
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    model = _tiny_clip(cls, projection_dim=32)
    sgm = to_sgm_clip_keys(model.state_dict())
    cfg = clip_config_from_keys(sgm, hidden_act="quick_gelu", with_projection=with_projection,
                                bos_token_id=998, eos_token_id=999)
    assert cfg["num_hidden_layers"] == 2 and cfg["num_attention_heads"] == 1
    assert cfg["projection_dim"] == (32 if with_projection else 64)
    rebuilt = cls(CLIPTextConfig(**cfg))
    assert _shapes(rebuilt.state_dict()) == _shapes(model.state_dict())
    with pytest.raises(ValueError, match="embeddings.token_embedding.weight"):
        clip_config_from_keys({}, hidden_act="gelu", with_projection=False)


def test_openclip_round_trip_and_matches_diffusers():
    model = _tiny_clip(CLIPTextModelWithProjection, projection_dim=32, hidden_act="gelu")
    sd = model.state_dict()
    oc = hf_to_openclip(sd, logit_scale=torch.tensor(4.6052))
    assert oc["text_projection"].shape == (64, 32)  # OpenCLIP stores [width, embed_dim]
    assert oc["transformer.resblocks.1.attn.in_proj_weight"].shape == (192, 64)
    assert oc["transformer.resblocks.1.attn.in_proj_bias"].shape == (192,)
    assert oc["positional_embedding"].shape == (77, 64) and "logit_scale" in oc
    hf = openclip_to_hf(oc)
    _assert_same_tensors(hf, sd)
    theirs = convert_open_clip_checkpoint(model, {SGM_OPENCLIP_PREFIX + k: v for k, v in oc.items()},
                                          prefix=SGM_OPENCLIP_PREFIX)
    _assert_same_tensors(hf, theirs)
    CLIPTextModelWithProjection(model.config).load_state_dict(normalize_hf_clip_keys(hf, model), strict=True)


def test_openclip_projection_orientation():
    """OpenCLIP computes pooled @ text_projection; the HF Linear must give the same embedding."""
    model = _tiny_clip(CLIPTextModelWithProjection, projection_dim=32, hidden_act="gelu")
    oc = hf_to_openclip(model.state_dict())
    ids = torch.tensor([[998, 5, 17, 999, 0, 0]])
    with torch.no_grad():
        out = model(input_ids=ids)
        pooled = model.text_model(input_ids=ids).pooler_output
    torch.testing.assert_close(pooled @ oc["text_projection"], out.text_embeds)


def test_openclip_full_size_bigg_on_meta():
    bigg = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
    with torch.device("meta"):
        model = CLIPTextModelWithProjection(CLIPTextConfig(**bigg))
    sd = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == 694_659_840
    oc = hf_to_openclip(sd)
    assert len([k for k in oc if k.endswith("in_proj_weight")]) == 32
    hf = openclip_to_hf(oc)
    assert _shapes(hf) == _shapes(sd)
    cfg = clip_config_from_keys(hf, hidden_act="gelu", with_projection=True)
    assert {k: cfg[k] for k in bigg} == bigg


def test_openclip_errors():
    with pytest.raises(UnmappedKeysError, match="transformer.resblocks.0.ls_1.gamma"):
        openclip_to_hf({"transformer.resblocks.0.ls_1.gamma": torch.empty(4)})
    with pytest.raises(UnmappedKeysError, match="k_proj"):
        hf_to_openclip({"text_model.encoder.layers.0.self_attn.q_proj.weight": torch.empty(2, 2)})
