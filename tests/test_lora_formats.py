"""LoRA file formats (formats/lora.py) against the real loaders: diffusers' SDXL and SD3 pipelines
load what vramfit writes, at the trained strength, and kohya names are the SGM names of the model's
own single file. Tiny models of the real classes, CPU only."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import safe_open

from vramfit.config.schema import ModelConfig
from vramfit.formats import lora as L
from vramfit.formats.safetensors_io import read_header
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sdxl import kohya as K
from vramfit.models.sources import resolve_source

RANK = 4
ALPHA = 6.0  # != RANK on purpose: the scale alpha/rank = 1.5 must survive every format
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
FAMILY = {"sdxl": "sdxl", "ssd1b": "sdxl", "sd3": "sd3"}
ADAPTER = "vramfit"
KOHYA_KEY = re.compile(
    r"^lora_unet_(input_blocks_\d+_1|middle_block_1|output_blocks_\d+_1)_transformer_blocks_\d+_"
    r"attn[12]_to_(q|k|v|out_0)\.(lora_down\.weight|lora_up\.weight|alpha)$")


@pytest.fixture(scope="module")
def bundle(cache_root):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            source = resolve_source(ModelConfig(path=f"tiny:{name}"), cache_root)
            loaded[name] = detect_family(source).load(source)
            loaded[name].denoiser.eval()
        return loaded[name]

    return get


def _trained(b, alpha=ALPHA, seed=0):
    """A copy of the denoiser with a peft LoRA as the trainer adds it, lora_B made non-zero."""
    model = copy.deepcopy(b.denoiser)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS,
                                 init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval(), get_peft_model_state_dict(model)


def _forward(model) -> torch.Tensor:
    """The denoiser on fixed inputs (UNet2DConditionModel or SD3Transformer2DModel)."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if hasattr(cfg, "cross_attention_dim"):
            x = torch.randn(1, cfg.in_channels, 8, 8, generator=g)
            ctx = torch.randn(1, 6, cfg.cross_attention_dim, generator=g)
            pooled = torch.randn(1, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim,
                                 generator=g)
            ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])
            return model(x, torch.tensor([500]), ctx,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": ids}).sample
        x = torch.randn(1, cfg.in_channels, 8, 8, generator=g)
        ctx = torch.randn(1, 6, cfg.joint_attention_dim, generator=g)
        pooled = torch.randn(1, cfg.pooled_projection_dim, generator=g)
        return model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled,
                     timestep=torch.tensor([500.0])).sample


def _pipeline(b):
    """The real diffusers pipeline made of the bundle's parts, with a fresh denoiser (no adapter)."""
    denoiser = copy.deepcopy(b.denoiser)
    enc, tok = b.text_encoders, b.tokenizers
    if b.family == "sdxl":
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=b.vae, text_encoder=enc[0], text_encoder_2=enc[1], tokenizer=tok[0], tokenizer_2=tok[1],
            unet=denoiser, scheduler=EulerDiscreteScheduler.from_config(b.noise_scheduler.config))
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=denoiser, vae=b.vae,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(b.noise_scheduler.config),
        text_encoder=enc[0], tokenizer=tok[0], text_encoder_2=enc[1], tokenizer_2=tok[1],
        text_encoder_3=enc[2] if len(enc) > 2 else None, tokenizer_3=tok[2] if len(tok) > 2 else None)


def _denoiser(pipe):
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def _delta(state, alphas) -> dict[str, torch.Tensor]:
    """The weight change each module gets: (alpha / r) * B @ A."""
    out = {}
    for module, rank in L.lora_ranks(state).items():
        a, b = state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        out[module] = (alphas[module] / rank) * (b.flatten(1).double() @ a.flatten(1).double())
    return out


def _assert_same_delta(got_state, got_alphas, want_state, want_alpha):
    want = _delta(want_state, {m: want_alpha for m in L.lora_ranks(want_state)})
    got = _delta(got_state, got_alphas)
    assert got.keys() == want.keys()
    for m in want:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-7)  # float32 rounding of folded lora_B


# ----------------------------------------------------------------------------- diffusers format
@pytest.mark.parametrize("name", ["sdxl", "ssd1b", "sd3"])
def test_diffusers_file_loads_in_pipeline_at_trained_strength(name, bundle, tmp_path):
    b = bundle(name)
    family = FAMILY[name]
    trained, peft_state = _trained(b)
    exported = L.to_diffusers(peft_state, FAMILIES[family].denoiser_component, alpha=ALPHA)
    prefix = FAMILIES[family].denoiser_component + "."
    assert all(k.startswith(prefix) and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in exported)
    assert len(exported) == len(peft_state)
    path = tmp_path / "pytorch_lora_weights.safetensors"
    L.save_lora(path, exported, L.lora_scale_metadata(RANK, ALPHA, "diffusers"))

    pipe = _pipeline(b)
    base = _forward(_denoiser(pipe))
    pipe.load_lora_weights(str(path), adapter_name=ADAPTER)
    denoiser = _denoiser(pipe)

    # (a) every tensor landed, under the same module, unchanged
    landed = get_peft_model_state_dict(denoiser, adapter_name=ADAPTER)
    want = {k[len(prefix):]: v for k, v in exported.items()}
    assert landed.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(landed[k], v), k
    # diffusers assumes alpha == rank for this format: the scale lives in lora_B
    assert denoiser.peft_config[ADAPTER].lora_alpha == denoiser.peft_config[ADAPTER].r == RANK

    # (b) the LoRA changes the output, exactly as the trained model (alpha 6, rank 4) does
    out = _forward(denoiser)
    assert (out - base).abs().max() > 1e-3
    torch.testing.assert_close(out, _forward(trained), rtol=0, atol=1e-5)

    # (c) adapter weight 0 gives the base model bit for bit
    pipe.set_adapters([ADAPTER], [0.0])
    assert torch.equal(_forward(denoiser), base)


def test_sd3_state_dict_loads_as_dict(bundle):
    """load_lora_weights also takes the dict (no file), as ComfyUI-style tools pass it around."""
    b = bundle("sd3")
    trained, peft_state = _trained(b, alpha=RANK)
    exported = L.to_diffusers(peft_state, "transformer")
    assert all(exported[k] is v for k, v in zip(exported, peft_state.values()))  # alpha == rank: untouched
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in exported
    pipe = _pipeline(b)
    pipe.load_lora_weights(exported, adapter_name=ADAPTER)
    torch.testing.assert_close(_forward(pipe.transformer), _forward(trained), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- kohya format
@pytest.mark.parametrize("name", ["sdxl", "ssd1b"])
def test_kohya_round_trip_and_sgm_names(name, bundle):
    b = bundle(name)
    cfg = dict(b.denoiser.config)
    _, peft_state = _trained(b)
    kohya = K.to_kohya_sdxl(peft_state, cfg, ALPHA)

    n_modules = len(peft_state) // 2
    assert len(kohya) == 3 * n_modules
    bad = [k for k in kohya if not KOHYA_KEY.match(k)]
    assert not bad, bad[:5]
    # down_blocks.1.attentions.0 is SGM input_blocks.4.1 in SDXL and in SSD-1B
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert "lora_unet_output_blocks_2_1_transformer_blocks_1_attn2_to_out_0.lora_up.weight" in kohya
    alphas = {k: v for k, v in kohya.items() if k.endswith(".alpha")}
    assert len(alphas) == n_modules
    assert all(v.shape == () and v.dtype == torch.float32 and v.item() == ALPHA for v in alphas.values())

    # Independent check: each kohya name is a real weight of the model's own SGM single file, and
    # the LoRA factor shapes fit that weight.
    header, _ = read_header(b.source.path)
    sgm = {k[len("model.diffusion_model."):-len(".weight")].replace(".", "_"): v["shape"]
           for k, v in header.items() if k.startswith("model.diffusion_model.") and k.endswith(".weight")}
    for key, t in kohya.items():
        module, _, part = key.partition(".")
        shape = sgm[module[len("lora_unet_"):]]
        if part == "lora_down.weight":
            assert list(t.shape) == [RANK, shape[1]], key
        elif part == "lora_up.weight":
            assert list(t.shape) == [shape[0], RANK], key

    back, back_alphas = K.from_kohya_sdxl(kohya, cfg)
    assert back.keys() == peft_state.keys()
    assert all(torch.equal(back[k], v) for k, v in peft_state.items())
    assert set(back_alphas) == {k[: -len(".lora_A.weight")] for k in peft_state if k.endswith("lora_A.weight")}
    assert set(back_alphas.values()) == {ALPHA}
    again = K.to_kohya_sdxl(back, cfg, back_alphas)
    assert again.keys() == kohya.keys() and all(torch.equal(again[k], kohya[k]) for k in kohya)


@pytest.mark.parametrize("name", ["sdxl", "ssd1b"])
def test_diffusers_loads_kohya_file_like_diffusers_file(name, bundle, tmp_path):
    b = bundle(name)
    cfg = dict(b.denoiser.config)
    trained, peft_state = _trained(b, seed=3)
    kohya_path, diffusers_path = tmp_path / "kohya.safetensors", tmp_path / "diffusers.safetensors"
    L.save_lora(kohya_path, K.to_kohya_sdxl(peft_state, cfg, ALPHA), L.lora_scale_metadata(RANK, ALPHA))
    L.save_lora(diffusers_path, L.to_diffusers(peft_state, "unet", ALPHA))

    outs = {}
    for kind, path in (("kohya", kohya_path), ("diffusers", diffusers_path)):
        pipe = _pipeline(b)
        pipe.load_lora_weights(str(path), adapter_name=ADAPTER)
        if kind == "kohya":  # diffusers converted the SGM names back to exactly our modules
            landed = get_peft_model_state_dict(pipe.unet, adapter_name=ADAPTER)
            assert landed.keys() == peft_state.keys()
            assert all(torch.equal(landed[k], v) for k, v in peft_state.items())
            assert pipe.unet.peft_config[ADAPTER].lora_alpha == ALPHA
        outs[kind] = _forward(pipe.unet)
    torch.testing.assert_close(outs["kohya"], outs["diffusers"], rtol=0, atol=1e-5)
    torch.testing.assert_close(outs["kohya"], _forward(trained), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- load_lora
def test_load_lora_recognises_every_format(bundle, tmp_path):
    from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers, convert_state_dict_to_kohya

    sdxl, ssd1b, sd3 = bundle("sdxl"), bundle("ssd1b"), bundle("sd3")
    _, s_xl = _trained(sdxl)
    _, s_ssd = _trained(ssd1b, seed=1)
    _, s_sd3 = _trained(sd3, seed=2)
    diffusers_xl = L.to_diffusers(s_xl, "unet", ALPHA)
    files = {  # name: (state to write, expected format, family, peft state, alpha of training)
        "diffusers_sdxl": (diffusers_xl, "diffusers", "sdxl", s_xl, ALPHA),
        "diffusers_sd3": (L.to_diffusers(s_sd3, "transformer", ALPHA), "diffusers", "sd3", s_sd3, ALPHA),
        "kohya_sdxl": (K.to_kohya_sdxl(s_xl, dict(sdxl.denoiser.config), ALPHA), "kohya", "sdxl", s_xl,
                       ALPHA),
        "kohya_ssd1b": (K.to_kohya_sdxl(s_ssd, dict(ssd1b.denoiser.config), ALPHA), "kohya", "sdxl", s_ssd,
                        ALPHA),
        "peft_sd3": (s_sd3, "peft", "sd3", s_sd3, RANK),
        "peft_sdxl": (s_xl, "peft", "sdxl", s_xl, RANK),
        # layouts diffusers' own converters write: unet.*.lora.down.weight, and kohya with diffusers paths
        "legacy_diffusers": (convert_state_dict_to_diffusers(L.to_diffusers(s_xl, "unet")), "diffusers",
                             "sdxl", s_xl, RANK),
        "kohya_diffusers_paths": (convert_state_dict_to_kohya(L.to_diffusers(s_xl, "unet")), "kohya", "sdxl",
                                  s_xl, RANK),
    }
    assert any(".lora.down.weight" in k for k in files["legacy_diffusers"][0])
    assert any(k.startswith("lora_unet_down_blocks_") for k in files["kohya_diffusers_paths"][0])
    for fname, (state, fmt, family, want, alpha) in files.items():
        path = tmp_path / f"{fname}.safetensors"
        L.save_lora(path, state, {"note": fname})
        got = L.load_lora(path, FAMILIES.values())
        assert (got.format, got.family) == (fmt, family), fname
        assert got.metadata == {"note": fname}
        st, alphas, fam = got  # unpacks as (state, alphas, family)
        assert fam == family and not got.text_encoders
        _assert_same_delta(st, alphas, want, alpha)
    # kohya with the config given (as for a layout outside the shipped ones)
    got = L.load_lora(tmp_path / "kohya_ssd1b.safetensors", FAMILIES.values(),
                      unet_config=ssd1b.denoiser.config)
    assert got.state.keys() == s_ssd.keys() and set(got.alphas.values()) == {ALPHA}


def test_load_lora_reads_text_encoder_parts(tmp_path):
    down, up = torch.randn(2, 8), torch.randn(8, 2)
    kohya = {"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": down,
             "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": up,
             "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha": torch.tensor(1.0),
             "lora_te2_text_model_encoder_layers_3_mlp_fc2.lora_down.weight": down,
             "lora_te2_text_model_encoder_layers_3_mlp_fc2.lora_up.weight": up}
    L.save_lora(tmp_path / "te.safetensors", kohya)
    got = L.load_lora(tmp_path / "te.safetensors", FAMILIES.values())
    assert got.format == "kohya" and got.family is None and got.state == {}
    assert set(got.text_encoders["text_encoder"]) == {"text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
                                                      "text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"}
    assert got.text_encoder_alphas == {"text_encoder": {"text_model.encoder.layers.0.self_attn.q_proj": 1.0},
                                       "text_encoder_2": {"text_model.encoder.layers.3.mlp.fc2": 2.0}}


def test_lora_config_kwargs_rebuild_a_loaded_lora(bundle, tmp_path):
    """A user LoRA with per-module alphas, read back into a fresh denoiser with peft alone."""
    b = bundle("ssd1b")
    trained, state = _trained(b, alpha=RANK, seed=5)
    alphas = {m: (8.0 if ".attn1." in m else 2.0) for m in L.lora_ranks(state)}
    reference = copy.deepcopy(b.denoiser)
    reference.add_adapter(LoraConfig(**L.lora_config_kwargs(state, alphas)))
    set_peft_model_state_dict(reference, state)
    want = _forward(reference.eval())
    assert (want - _forward(trained)).abs().max() > 1e-4  # the alphas matter

    for path, fmt_state in ((tmp_path / "k.safetensors", K.to_kohya_sdxl(state, b.denoiser.config, alphas)),
                            (tmp_path / "d.safetensors", L.to_diffusers(state, "unet", alphas))):
        L.save_lora(path, fmt_state)
        st, al, _ = L.load_lora(path, FAMILIES.values())
        model = copy.deepcopy(b.denoiser)
        model.add_adapter(LoraConfig(**L.lora_config_kwargs(st, al)))
        result = set_peft_model_state_dict(model, st)
        assert not result.unexpected_keys
        torch.testing.assert_close(_forward(model.eval()), want, rtol=0, atol=1e-5)
    # diffusers' pipeline reads the per-module scale of the diffusers file right, as it is in lora_B
    pipe = _pipeline(b)
    pipe.load_lora_weights(str(tmp_path / "d.safetensors"), adapter_name=ADAPTER)
    torch.testing.assert_close(_forward(pipe.unet), want, rtol=0, atol=1e-5)


def test_bad_files_and_inputs_are_refused(tmp_path):
    junk = tmp_path / "junk.safetensors"
    L.save_lora(junk, {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"junk\.safetensors.*not a LoRA.*model\.diffusion_model\.input_blocks"):
        L.load_lora(junk, FAMILIES.values())
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="garbage.safetensors"):
        L.load_lora(garbage, FAMILIES.values())
    sd3_kohya = tmp_path / "sd3_kohya.safetensors"
    L.save_lora(sd3_kohya, {"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.zeros(2, 4),
                            "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.zeros(12, 2)})
    with pytest.raises(ValueError, match="kohya SD3.*joint_blocks_0"):
        L.load_lora(sd3_kohya, FAMILIES.values())
    unknown_block = tmp_path / "odd.safetensors"
    L.save_lora(unknown_block, {"lora_unet_input_blocks_4_1_transformer_blocks_99_attn1_to_q.lora_down.weight":
                                torch.zeros(2, 4),
                                "lora_unet_input_blocks_4_1_transformer_blocks_99_attn1_to_q.lora_up.weight":
                                torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="odd.safetensors.*transformer_blocks_99.*UNet config"):
        L.load_lora(unknown_block, FAMILIES.values())
    bad_te = tmp_path / "bad_te.safetensors"
    L.save_lora(bad_te, {"lora_te1_text_model_embeddings_token_embedding.lora_down.weight": torch.zeros(2, 4),
                         "lora_te1_text_model_embeddings_token_embedding.lora_up.weight": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="bad_te.safetensors.*token_embedding"):
        L.load_lora(bad_te, FAMILIES.values())

    a, b = torch.zeros(2, 4), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="component 'flux'"):
        L.to_diffusers({"x.lora_A.weight": a, "x.lora_B.weight": b}, "flux")
    with pytest.raises(ValueError, match="only lora_A"):
        L.to_diffusers({"x.lora_A.weight": a}, "unet")
    with pytest.raises(ValueError, match="already carry a component prefix"):
        L.to_diffusers({"unet.x.lora_A.weight": a, "unet.x.lora_B.weight": b}, "unet")
    with pytest.raises(ValueError, match="lora_magnitude_vector"):
        L.to_diffusers({"x.lora_A.weight": a, "x.lora_B.weight": b, "x.lora_magnitude_vector": a}, "unet")
    from vramfit.models.parts import shipped_config

    with pytest.raises(ValueError, match="not parameters of this UNet config.*nowhere"):
        K.to_kohya_sdxl({"nowhere.lora_A.weight": a, "nowhere.lora_B.weight": b},
                        shipped_config("tiny_sdxl_unet"), 4)
    with pytest.raises(ValueError, match="str to str"):
        L.save_lora(tmp_path / "m.safetensors", {"x.lora_A.weight": a}, {"rank": 4})


def test_saved_metadata(tmp_path):
    meta = L.lora_scale_metadata(RANK, ALPHA)
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "6.0"
    assert meta["vramfit.lora.format"] == "kohya"
    d = L.lora_scale_metadata(RANK, ALPHA, "diffusers")
    assert d["vramfit.lora.scale_in_weights"] == "true"
    assert L.DIFFUSERS_METADATA_KEY not in meta and L.DIFFUSERS_METADATA_KEY not in d
    path = tmp_path / "out" / "lora.safetensors"
    L.save_lora(path, {"x.lora_A.weight": torch.ones(2, 3)}, meta)
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == meta
    assert [p.name for p in path.parent.iterdir()] == ["lora.safetensors"]  # no temp file left
