"""uvic.integrations.diffusers on tiny configs of diffusers' own model classes (CPU, no downloads).

Each switched layer is checked against the paper's formula written out here, sign(p) * softmax(|p|), applied to
the layer's own projections; each kept layer against diffusers' stock processor.
"""

import copy
import json
import pickle
import warnings

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
)
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
    JointAttnProcessor2_0,
    SlicedAttnProcessor,
)
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from layer_calls import attention_layers, outputs, recorded_run

from uvic.integrations.diffusers import CONFIG_KEY, apply_cog_attention, load, restore_cog_attention


def paper_attention(q, k, v, key_kept=None, cog=True, scale=None):
    """(B, nh, Lq, hd) x (B, nh, Lk, hd): sign(p) * softmax(|p|) @ v (or softmax(p) @ v), p = scale q k^T, the scale
    hd ** -0.5 unless given."""
    p = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = p.abs() if cog else p
    if key_kept is not None:
        scores = scores.masked_fill(~key_kept[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (torch.sign(p) * weights if cog else weights) @ v


def heads(t, n):
    """(B, L, n * hd) -> (B, n, L, hd)."""
    return t.view(t.shape[0], t.shape[1], n, -1).transpose(1, 2)


def merge(t):
    """(B, n, L, hd) -> (B, L, n * hd)."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def paper_layer(attn, x, context=None, key_kept=None, temb=None, cog=True, scale=None):
    """A diffusers `Attention` layer written out from its sub-layers: spatial norm, (B, C, H, W) -> (B, HW, C),
    group norm, cross-attention norm, q/k projections and norms, attention over the kept keys (key_kept (B, Lk)),
    output projection, back to (B, C, H, W), residual, rescale."""
    residual = x
    if attn.spatial_norm is not None:
        x = attn.spatial_norm(x, temb)
    if x.ndim == 4:
        x = x.flatten(2).transpose(1, 2)
    if attn.group_norm is not None:
        x = attn.group_norm(x.transpose(1, 2)).transpose(1, 2)
    if context is None:
        context = x
    elif attn.norm_cross is not None:
        assert isinstance(attn.norm_cross, torch.nn.LayerNorm)
        context = attn.norm_cross(context)
    q, k, v = (heads(f(t), attn.heads) for f, t in ((attn.to_q, x), (attn.to_k, context), (attn.to_v, context)))
    if attn.norm_q is not None:
        q, k = attn.norm_q(q), attn.norm_k(k)
    out = attn.to_out[0](merge(paper_attention(q, k, v, key_kept, cog, scale)))
    if residual.ndim == 4:
        out = out.transpose(1, 2).reshape(residual.shape)
    if attn.residual_connection:
        out = out + residual
    return out / attn.rescale_output_factor


def kept_keys(mask):
    """diffusers' additive key mask (B, 1, Lk) (0 = keep) as (B, Lk) bool, or None."""
    return None if mask is None else mask.reshape(mask.shape[0], -1) == 0


def paper_joint_layer(attn, x, context):
    """An SD3 joint-attention layer with Cog attention over the concatenated image and context tokens."""
    assert attn.norm_q is None and attn.norm_added_q is None
    q = torch.cat([heads(attn.to_q(x), attn.heads), heads(attn.add_q_proj(context), attn.heads)], dim=2)
    k = torch.cat([heads(attn.to_k(x), attn.heads), heads(attn.add_k_proj(context), attn.heads)], dim=2)
    v = torch.cat([heads(attn.to_v(x), attn.heads), heads(attn.add_v_proj(context), attn.heads)], dim=2)
    out = merge(paper_attention(q, k, v))
    out_x, out_c = out[:, : x.shape[1]], out[:, x.shape[1] :]
    return attn.to_out[0](out_x), (out_c if attn.context_pre_only else attn.to_add_out(out_c))


def paper_flux_layer(attn, x, context, rotary):
    """A Flux attention layer with Cog attention: RMS-normed q and k, context tokens first, rotary embedding."""
    def qkv(to_q, to_k, to_v, norm_q, norm_k, t):
        q, k, v = (f(t).unflatten(-1, (attn.heads, -1)) for f in (to_q, to_k, to_v))  # (B, L, nh, hd)
        return norm_q(q), norm_k(k), v

    q, k, v = qkv(attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, x)
    if context is not None:
        cq, ck, cv = qkv(attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_added_q, attn.norm_added_k,
                         context)
        q, k, v = torch.cat([cq, q], 1), torch.cat([ck, k], 1), torch.cat([cv, v], 1)
    q, k = apply_rotary_emb(q, rotary, sequence_dim=1), apply_rotary_emb(k, rotary, sequence_dim=1)
    out = merge(paper_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    if context is None:
        return out
    n = context.shape[1]
    return attn.to_out[0](out[:, n:]), attn.to_add_out(out[:, :n])


# ---------------------------------------------------------------------------------------------------------
# Tiny models and their inputs
# ---------------------------------------------------------------------------------------------------------


def tiny_dit():
    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                  num_layers=4, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([3, 700]),
              "class_labels": torch.tensor([1, 4])}
    return model.eval(), inputs, lambda out: out.sample


def tiny_unet():
    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                 layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24,
                                 attention_head_dim=8, norm_num_groups=8)
    g = torch.Generator().manual_seed(1)
    text_kept = torch.ones(2, 7, dtype=torch.bool)
    text_kept[1, 4:] = False  # a padded caption: its last 3 tokens are masked in every cross-attention
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 7, 24, generator=g), "encoder_attention_mask": text_kept}
    return model.eval(), inputs, lambda out: out.sample


def tiny_sd3():
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
                                  pooled_projection_dim=12, out_channels=4, pos_embed_max_size=8)
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10.0, 500.0]),
              "encoder_hidden_states": torch.randn(2, 5, 24, generator=g),
              "pooled_projections": torch.randn(2, 12, generator=g)}
    return model.eval(), inputs, lambda out: out.sample


def tiny_flux():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12,
                                   axes_dims_rope=(4, 6, 6))
    g = torch.Generator().manual_seed(1)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    inputs = {"hidden_states": torch.randn(2, 16, 4, generator=g), "timestep": torch.tensor([0.1, 0.7]),
              "encoder_hidden_states": torch.randn(2, 5, 24, generator=g),
              "pooled_projections": torch.randn(2, 12, generator=g), "img_ids": img_ids.reshape(16, 3),
              "txt_ids": torch.zeros(5, 3)}
    return model.eval(), inputs, lambda out: out.sample


MODELS = {"dit": tiny_dit, "unet": tiny_unet, "sd3": tiny_sd3, "flux": tiny_flux}

# What apply_cog_attention(model) switches: every attention block but the first and last in forward
# order (UNet: down, mid, up; a BasicTransformerBlock's self- and cross-attention form one block).
SWITCHED = {
    "dit": ["transformer_blocks.1.attn1", "transformer_blocks.2.attn1"],
    "unet": ["mid_block.attentions.0.transformer_blocks.0.attn1", "mid_block.attentions.0.transformer_blocks.0.attn2",
             "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
             "up_blocks.1.attentions.0.transformer_blocks.0.attn2"],
    "sd3": ["transformer_blocks.1.attn"],
    "flux": ["single_transformer_blocks.0.attn"],  # double-stream blocks run first, then single-stream ones
}


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Single diffusers Attention layers with every input the default processors handle
# ---------------------------------------------------------------------------------------------------------


def layer_zoo():
    """Attention layers that use what the tiny models above do not: 4-D inputs with spatial norm (its GroupNorm
    has 32 groups) and group norm,
    residual and rescale (as in VAEs and UNet2DModel); cross-attention norm and q/k norms; scale_qk=False (whose
    default processor is AttnProcessor, scale 1). Each with its inputs: [(kwargs, key_kept (B, Lk) or None)]."""
    torch.manual_seed(0)
    zoo = torch.nn.ModuleDict({
        "spatial": Attention(query_dim=32, heads=2, dim_head=16, norm_num_groups=4, spatial_norm_dim=3,
                             residual_connection=True, rescale_output_factor=2.0, bias=True),
        "cross": Attention(query_dim=16, cross_attention_dim=12, heads=2, dim_head=8, qk_norm="layer_norm",
                           cross_attention_norm="layer_norm"),
        "unscaled": Attention(query_dim=16, cross_attention_dim=12, heads=2, dim_head=8, scale_qk=False),
    })
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(2, 6, 16, generator=g), torch.randn(2, 5, 12, generator=g)
    kept = torch.tensor([[True] * 5, [True, True, True, False, False]])
    additive = torch.where(kept, 0.0, -10000.0)[:, None]  # (B, 1, Lk), as UNet2DConditionModel builds it
    inputs = {
        "spatial": [({"hidden_states": torch.randn(2, 32, 4, 4, generator=g), "temb": torch.randn(2, 3, 2, 2,
                                                                                                   generator=g)}, None)],
        "cross": [({"hidden_states": x, "encoder_hidden_states": context}, None),
                  ({"hidden_states": x, "encoder_hidden_states": context, "attention_mask": additive}, kept),
                  ({"hidden_states": x, "encoder_hidden_states": context, "attention_mask": kept}, kept)],
        "unscaled": [({"hidden_states": x, "encoder_hidden_states": context, "attention_mask": additive}, kept)],
    }
    return zoo.eval(), inputs


def test_every_input_of_the_default_processors():
    zoo, inputs = layer_zoo()
    assert [type(attn.processor) for attn in zoo.values()] == [AttnProcessor2_0, AttnProcessor2_0, AttnProcessor]
    with torch.no_grad():
        stock = {name: [zoo[name](**kw) for kw, _ in runs] for name, runs in inputs.items()}
        for name, runs in inputs.items():  # the reference written out above is the stock layer in softmax mode
            for (kw, kept), want in zip(runs, stock[name]):
                got = paper_layer(zoo[name], kw["hidden_states"], kw.get("encoder_hidden_states"), kept,
                                  kw.get("temb"), cog=False, scale=zoo[name].scale)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

        with pytest.warns(UserWarning, match="ModuleDict has 3 attention block"):
            assert apply_cog_attention(zoo, keep_softmax_first=5, keep_softmax_last=5) == []
        assert [p.layer_scale for p in (attn.processor for attn in zoo.values())] == [False, False, True]
        for name, runs in inputs.items():
            for (kw, _), want in zip(runs, stock[name]):
                tol = 1e-5 if name == "unscaled" else 0  # AttnProcessor's explicit softmax; else the same SDPA call
                torch.testing.assert_close(zoo[name](**kw), want, rtol=tol, atol=tol)

        # each layer a block
        assert apply_cog_attention(zoo, keep_softmax_first=0, keep_softmax_last=0) == ["spatial", "cross", "unscaled"]
        assert zoo["unscaled"].processor.layer_scale  # kept when a Cog processor is re-placed
        for name, runs in inputs.items():
            for (kw, kept), want in zip(runs, stock[name]):
                got = zoo[name](**kw)
                expect = paper_layer(zoo[name], kw["hidden_states"], kw.get("encoder_hidden_states"), kept,
                                     kw.get("temb"), scale=zoo[name].scale)
                assert got.shape == want.shape and not torch.allclose(got, want, atol=1e-3)
                torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_softmax_mode_reproduces_the_stock_model(kind):
    model, inputs, sample = MODELS[kind]()
    with torch.no_grad():
        stock = sample(model(**inputs))
        with pytest.warns(UserWarning, match="no layer runs Cog attention"):
            # every block kept: all in softmax mode
            assert apply_cog_attention(model, keep_softmax_first=100, keep_softmax_last=100) == []
        assert all(type(m.processor).__name__.startswith("KeptSoftmax") and m.processor.runs_softmax
                   for m in attention_layers(model).values())
        torch.testing.assert_close(sample(model(**inputs)), stock, rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(MODELS))
def test_switched_layers_follow_the_paper_and_kept_layers_stay_stock(kind):
    model, inputs, sample = MODELS[kind]()
    with torch.no_grad():
        stock = sample(model(**inputs))
        switched = apply_cog_attention(model)
        assert switched == SWITCHED[kind]
        calls, cog = recorded_run(model, inputs, sample)
        assert not torch.allclose(cog, stock, atol=1e-3)
        layers = attention_layers(model)
        assert set(calls) == set(layers)
        for name, (args, kw, out) in calls.items():
            attn = layers[name]
            x = args[0] if args else kw["hidden_states"]
            context, mask = kw.get("encoder_hidden_states"), kw.get("attention_mask")
            if kind == "flux":
                rotary = kw["image_rotary_emb"]
                expect = paper_flux_layer(attn, x, context, rotary) if name in switched else \
                    FluxAttnProcessor()(attn, x, context, None, rotary)
            elif kind == "sd3":
                expect = paper_joint_layer(attn, x, context) if name in switched else \
                    JointAttnProcessor2_0()(attn, x, encoder_hidden_states=context)
            else:
                expect = paper_layer(attn, x, context, kept_keys(mask)) if name in switched else \
                    AttnProcessor2_0()(attn, x, encoder_hidden_states=context, attention_mask=mask)
            for got, want in zip(outputs(out), outputs(expect), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if kind == "unet":  # the padded caption reached the cross-attention as a mask
            assert calls[SWITCHED["unet"][1]][1]["attention_mask"] is not None


def test_keep_softmax_zero_switches_every_layer():
    model, inputs, _ = tiny_unet()
    everything = list(attention_layers_in_forward_order(model))
    assert apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=0) == everything
    assert apply_cog_attention(model) == SWITCHED["unet"]  # a second call re-places the rule


def attention_layers_in_forward_order(model):
    names = list(attention_layers(model))
    order = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    return sorted(names, key=lambda n: order[n.split(".")[0]])  # stable: module order inside each stage


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_training_step_has_finite_gradients(kind):
    model, inputs, sample = MODELS[kind]()
    switched = apply_cog_attention(model.train())
    loss = sample(model(**inputs)).square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    layers = attention_layers(model)
    assert all(layers[name].to_q.weight.grad.abs().sum() > 0 for name in switched)


def test_masks_that_are_not_key_masks_are_refused_with_the_module_name():
    model, inputs, _ = tiny_unet()
    apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=0)
    name = "mid_block.attentions.0.transformer_blocks.0.attn2"
    attn = attention_layers(model)[name]
    x, context = torch.randn(2, 4, 64), torch.randn(2, 7, 24)
    bias = torch.randn(2, 1, 7)  # an additive bias, not a key mask
    with pytest.raises(ValueError, match=f"{name}: the additive attention mask has entries other than 0"):
        attn(x, encoder_hidden_states=context, attention_mask=bias)
    per_query = torch.zeros(2, 4, 7)
    per_query[:, 0, 3] = -10000.0  # removes a key for one query only
    with pytest.raises(ValueError, match=f"{name}: the attention mask differs between queries or heads"):
        attn(x, encoder_hidden_states=context, attention_mask=per_query)
    kept = torch.zeros(2, 1, 7)
    kept[0, 0, 5:] = float("-inf")  # a key mask (with -inf): the paper formula without keys 5 and 6 of item 0
    expect = paper_layer(attn, x, context, key_kept=kept[:, 0] == 0)
    torch.testing.assert_close(attn(x, encoder_hidden_states=context, attention_mask=kept), expect)


def test_unsupported_processors_and_arguments_are_refused():
    model, _, _ = tiny_dit()
    layer = attention_layers(model)["transformer_blocks.2.attn1"]
    layer.set_processor(SlicedAttnProcessor(slice_size=1))
    with pytest.raises(ValueError, match="'transformer_blocks.2.attn1' uses SlicedAttnProcessor"):
        apply_cog_attention(model)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keep_softmax"):
            apply_cog_attention(model, keep_softmax_first=bad, keep_softmax_last=bad)
    with pytest.raises(ValueError, match="no diffusers attention modules"):
        apply_cog_attention(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------------------
# The placement survives saving, loading and processors that diffusers re-creates
# ---------------------------------------------------------------------------------------------------------


def processor_types(model):
    return {name: type(m.processor) for name, m in attention_layers(model).items()}


def test_a_saved_placement_is_restored_by_load(tmp_path):
    model, inputs, sample = tiny_dit()
    switched = apply_cog_attention(model, backend="torch")
    with torch.no_grad():
        want = sample(model(**inputs))
    model.save_pretrained(tmp_path)

    plain = DiTTransformer2DModel.from_pretrained(tmp_path).eval()  # diffusers does not save processors
    assert set(processor_types(plain).values()) == {AttnProcessor2_0}
    assert plain.config[CONFIG_KEY] == {"keep_softmax_first": 1, "keep_softmax_last": 1, "backend": "torch"}
    assert restore_cog_attention(plain) == switched
    assert processor_types(plain) == processor_types(model)

    loaded = load(DiTTransformer2DModel, tmp_path).eval()
    assert processor_types(loaded) == processor_types(model)
    assert all(m.processor.backend == "torch" for m in attention_layers(loaded).values())
    with torch.no_grad():
        torch.testing.assert_close(sample(loaded(**inputs)), want, rtol=0, atol=0)


def test_the_two_ends_are_placed_apart():
    """keep_softmax_first / keep_softmax_last, as U-ViT's and Cogformer's: blocks in forward order."""
    model, _, _ = tiny_dit()
    blocks = list(attention_layers(model))  # DiT: transformer_blocks.0 .. 3, in forward order
    assert len(blocks) == 4  # one attention layer per transformer block
    assert apply_cog_attention(model, keep_softmax_first=1, keep_softmax_last=0) == blocks[1:]
    assert apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=2) == blocks[:2]


def test_the_old_keep_softmax_still_places_both_ends_with_one_warning(tmp_path):
    """`apply_cog_attention(model, keep_softmax=k)` and a config.json whose record holds the one count `keep_softmax`
    (as saved before the rename) place k and k, each with one FutureWarning, and the loaded model computes the
    same as the saving one."""
    model, inputs, sample = tiny_dit()
    with pytest.warns(FutureWarning, match=r"^apply_cog_attention: keep_softmax is the old name") as record:
        switched = apply_cog_attention(model, keep_softmax=1, backend="torch")
    assert len(record) == 1 and switched == list(attention_layers(model))[1:-1]
    with torch.no_grad():
        want = sample(model(**inputs))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, CONFIG_KEY: {"keep_softmax": 1, "backend": "torch"}}))
    with pytest.warns(FutureWarning, match=r"config entry '_cog_attention': keep_softmax is the old name") as record:
        loaded = load(DiTTransformer2DModel, tmp_path).eval()
    assert len([w for w in record if issubclass(w.category, FutureWarning)]) == 1
    assert processor_types(loaded) == processor_types(model)
    with torch.no_grad():
        torch.testing.assert_close(sample(loaded(**inputs)), want, rtol=0, atol=0)


def test_load_warns_when_nothing_was_recorded(tmp_path):
    model, _, _ = tiny_dit()
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="DiTTransformer2DModel: its config records no Cog placement"):
        loaded = load(DiTTransformer2DModel, tmp_path)
    assert set(processor_types(loaded).values()) == {AttnProcessor2_0}


def test_a_damaged_saved_placement_is_one_error_naming_the_entry(tmp_path):
    """A config.json's `_cog_attention` that is not what apply_cog_attention records: one ValueError naming the entry
    (before: `TypeError: ... argument after ** must be a mapping`, or a bare keep_softmax error)."""
    model, _, _ = tiny_dit()
    apply_cog_attention(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for bad, match in [([1], r"must be a mapping \{'keep_softmax_first': int, 'keep_softmax_last': int, 'backend': "
                             r"str\} .*got \[1\]"),
                       ("1", "must be a mapping"), ({"keep_softmax_first": 1, "layers": [2]}, "must be a mapping"),
                       ({"keep_softmax_first": -1}, "keep_softmax_first must be an int >= 0, got -1"),
                       ({"keep_softmax_first": 1, "keep_softmax_last": "1"}, "keep_softmax_last must be an int >= 0"),
                       # saved before the rename: the one count, checked under its name
                       ({"keep_softmax": 1, "layers": [2]}, "must be a mapping"),
                       ({"keep_softmax": -1}, "keep_softmax must be an int >= 0, got -1"),
                       ({"keep_softmax": 0.5, "backend": "torch"}, "keep_softmax must be an int >= 0, got 0.5"),
                       ({"keep_softmax": 1, "backend": "flash"}, "backend must be one of")]:
        (tmp_path / "config.json").write_text(json.dumps({**saved, CONFIG_KEY: bad}))
        with pytest.raises(ValueError, match=r"^DiTTransformer2DModel config entry '_cog_attention'.*" + match):
            load(DiTTransformer2DModel, tmp_path)
    # In a pipeline, the component is named.
    model.register_to_config(**{CONFIG_KEY: [1]})
    pipe = DiTPipeline(transformer=model, vae=AutoencoderKL(block_out_channels=(8,), norm_num_groups=4),
                       scheduler=DDIMScheduler())
    with pytest.raises(ValueError, match=r"^DiTTransformer2DModel \('transformer'\) config entry '_cog_attention' must"):
        restore_cog_attention(pipe)


def test_a_pipeline_is_restored_component_by_component(tmp_path):
    transformer, inputs, _ = tiny_dit()
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    switched = apply_cog_attention(transformer)
    DiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler()).save_pretrained(tmp_path)
    pipe = load(DiTPipeline, tmp_path)  # the VAE recorded nothing: only the transformer is switched
    assert processor_types(pipe.transformer) == processor_types(transformer)
    assert set(processor_types(pipe.vae).values()) == {AttnProcessor2_0}
    assert restore_cog_attention(pipe) == [f"transformer.{name}" for name in switched]


def test_re_created_processors_keep_their_mode():
    """diffusers re-creates processors as `processor.__class__()` (IP-adapter loading, for self-attention): the
    class alone gives the same computation, `AttnProcessor`-style layers (scale_qk=False) included."""
    model, inputs, sample = tiny_unet()
    zoo, zoo_inputs = layer_zoo()
    apply_cog_attention(model)
    apply_cog_attention(zoo, keep_softmax_first=0, keep_softmax_last=0)

    def run():
        with torch.no_grad():
            return [sample(model(**inputs))] + [zoo[name](**kw) for name, r in zoo_inputs.items() for kw, _ in r]

    before, types = run(), {**processor_types(model), **processor_types(zoo)}
    for m in [*attention_layers(model).values(), *attention_layers(zoo).values()]:
        m.set_processor(type(m.processor)())
    assert {**processor_types(model), **processor_types(zoo)} == types
    for b, a in zip(before, run(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def ip_adapter_state_dict(unet):
    """An IP-adapter checkpoint for `unet` (random weights), in the layout `_load_ip_adapter_weights` reads."""
    torch.manual_seed(2)
    dim = unet.config.cross_attention_dim
    cross = [name for name in unet.attn_processors if not name.endswith("attn1.processor")]
    hidden = {name: unet.get_submodule(name.removesuffix(".processor")).to_q.out_features for name in cross}
    ip_adapter = {}
    for i, name in enumerate(cross):
        ip_adapter[f"{2 * i + 1}.to_k_ip.weight"] = torch.randn(hidden[name], dim)
        ip_adapter[f"{2 * i + 1}.to_v_ip.weight"] = torch.randn(hidden[name], dim)
    image_proj = {"proj.weight": torch.randn(4 * dim, dim), "proj.bias": torch.zeros(4 * dim),
                  "norm.weight": torch.ones(dim), "norm.bias": torch.zeros(dim)}
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}


def test_ip_adapter_loading_keeps_self_attention_and_says_what_it_replaced():
    model, inputs, _ = tiny_unet()
    apply_cog_attention(model)
    before = processor_types(model)
    model._load_ip_adapter_weights([ip_adapter_state_dict(model)])
    after = processor_types(model)
    self_attention = [name for name in before if name.endswith("attn1")]
    assert {name: after[name] for name in self_attention} == {name: before[name] for name in self_attention}
    inputs["added_cond_kwargs"] = {"image_embeds": [torch.randn(2, 1, 24)]}
    replaced = "mid_block.attentions.0.transformer_blocks.0.attn2 (IPAdapterAttnProcessor2_0)"
    with pytest.warns(UserWarning, match=r"4 attention module\(s\) no longer run .*" + replaced.replace("(", r"\(")
                      .replace(")", r"\)")):
        model(**inputs)


def test_replaced_processors_are_reported_and_a_fresh_apply_is_quiet():
    model, inputs, _ = tiny_dit()
    apply_cog_attention(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**inputs)  # nothing replaced: no warning
    attention_layers(model)["transformer_blocks.1.attn1"].set_processor(AttnProcessor2_0())
    with pytest.warns(UserWarning, match=r"1 attention module\(s\) .*transformer_blocks.1.attn1 \(AttnProcessor2_0\)"):
        model(**inputs)
    apply_cog_attention(model)  # re-placed: checked against the new processors only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**inputs)
    assert len(model._forward_pre_hooks) == 1
    # set_default_attn_processor refuses processors it does not know, so the placement is not lost silently
    unet, _, _ = tiny_unet()
    apply_cog_attention(unet)
    with pytest.raises(ValueError, match="Cannot call `set_default_attn_processor`"):
        unet.set_default_attn_processor()


def test_a_model_with_too_few_blocks_says_that_nothing_was_switched():
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    with pytest.warns(UserWarning, match=r"AutoencoderKL has 2 attention block\(s\), and keep_softmax_first=1 and "
                                         r"keep_softmax_last=1 keep all .*no layer runs Cog attention"):
        assert apply_cog_attention(vae) == []
    assert all(type(m.processor).__name__ == "KeptSoftmaxAttnProcessor" and m.processor.runs_softmax
               for m in attention_layers(vae).values())
    assert apply_cog_attention(vae, keep_softmax_first=0, keep_softmax_last=0) == ["encoder.mid_block.attentions.0",
                                                        "decoder.mid_block.attentions.0"]
    assert all(type(m.processor).__name__ == "CogAttnProcessor" and not m.processor.runs_softmax
               for m in attention_layers(vae).values())


def test_a_switched_model_pickles_and_copies_with_its_check():
    model, inputs, sample = tiny_dit()
    apply_cog_attention(model)
    pickled, copied = pickle.loads(pickle.dumps(model)), copy.deepcopy(model)
    attention_layers(copied)["transformer_blocks.2.attn1"].set_processor(AttnProcessor2_0())
    with torch.no_grad():
        want = sample(model(**inputs))
        torch.testing.assert_close(sample(pickled(**inputs)), want, rtol=0, atol=0)
        with pytest.warns(UserWarning, match=r"transformer_blocks.2.attn1 \(AttnProcessor2_0\)"):
            copied(**inputs)  # the copy checks its own processors
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**inputs)
