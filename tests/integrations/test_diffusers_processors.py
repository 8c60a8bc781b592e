"""The processors of uvic.integrations.diffusers_processors on tiny configs of the diffusers models that use them
(HunyuanDiT, AuraFlow, CogVideoX, LTX-Video, Wan text- and image-to-video, UNet SimpleCrossAttn blocks).

Every attention layer is run on the inputs it gets in the stock model, in float64. Kept-softmax layers must give
the stock processor's output exactly. Cog layers must give the stock processor's output with its softmax attention
call replaced by the paper's formula, sign(p) * softmax(|p|) @ v over the kept keys (written out below): the stock
code then supplies everything around the attention (projections, norms, rotary embeddings, joint text/image
streams, masks), so the check covers all of it.
"""

from unittest import mock

import pytest
import torch
from diffusers import (
    AuraFlowTransformer2DModel,
    CogVideoXTransformer3DModel,
    HunyuanDiT2DModel,
    LTXVideoTransformer3DModel,
    SanaTransformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)
from layer_calls import attention_layers, outputs, recorded_run

from uvic.integrations.diffusers import apply_cog_attention


def formula_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Cog attention by the paper's formula in `F.scaled_dot_product_attention`'s calling convention: q (B, nh, Lq,
    hd), k and v (B, nh, Lk, hd); attn_mask boolean (True = keep) or additive with entries 0 (keep) and <= -10000
    (remove the key)."""
    assert dropout_p == 0.0 and not is_causal and not enable_gqa
    q, k, v = query, key, value
    p = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    keep = torch.ones_like(p, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            assert bool(((attn_mask == 0) | (attn_mask <= -10000)).all())
            attn_mask = attn_mask == 0
        keep = keep & attn_mask
    weights = torch.softmax(p.abs().masked_fill(~keep, float("-inf")), dim=-1)
    return (torch.sign(p) * weights) @ v


# ---------------------------------------------------------------------------------------------------------
# Tiny models and their inputs
# ---------------------------------------------------------------------------------------------------------


def tiny_hunyuan():
    torch.manual_seed(0)
    model = HunyuanDiT2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
                              num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
                              pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4)
    g = torch.Generator().manual_seed(1)
    tokens = (8 // 2) ** 2
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([3.0, 700.0]),
              "encoder_hidden_states": torch.randn(2, 4, 8, generator=g), "text_embedding_mask": torch.ones(2, 4),
              "encoder_hidden_states_t5": torch.randn(2, 4, 8, generator=g),
              "text_embedding_mask_t5": torch.ones(2, 4),
              "image_meta_size": torch.tensor([[1024.0, 1024, 16, 16, 0, 0]] * 2),
              "style": torch.zeros(2, dtype=torch.long),
              "image_rotary_emb": (torch.randn(tokens, 8, generator=g), torch.randn(tokens, 8, generator=g))}
    return model, inputs


def tiny_auraflow():
    torch.manual_seed(0)
    model = AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                       num_single_dit_layers=2, attention_head_dim=8, num_attention_heads=2,
                                       caption_projection_dim=16, joint_attention_dim=12, out_channels=4,
                                       pos_embed_max_size=16)
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=g),
              "encoder_hidden_states": torch.randn(2, 5, 12, generator=g), "timestep": torch.tensor([10, 500])}
    return model, inputs


def tiny_cogvideox():
    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                        time_embed_dim=4, text_embed_dim=8, num_layers=3, sample_width=8,
                                        sample_height=8, sample_frames=1, patch_size=2, temporal_compression_ratio=1,
                                        max_text_seq_length=5, use_rotary_positional_embeddings=True)
    g = torch.Generator().manual_seed(1)
    video_tokens = 2 * 4 * 4
    inputs = {"hidden_states": torch.randn(2, 2, 4, 8, 8, generator=g),
              "encoder_hidden_states": torch.randn(2, 5, 8, generator=g), "timestep": torch.tensor([10, 500]),
              "image_rotary_emb": (torch.randn(video_tokens, 8, generator=g),
                                   torch.randn(video_tokens, 8, generator=g))}
    return model, inputs


def tiny_ltx():
    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                       cross_attention_dim=16, num_layers=3, caption_channels=12)
    g = torch.Generator().manual_seed(1)
    text_kept = torch.ones(2, 6, dtype=torch.bool)
    text_kept[1, 4:] = False  # a padded caption: a key mask in every cross-attention
    inputs = {"hidden_states": torch.randn(2, 2 * 4 * 4, 4, generator=g),
              "encoder_hidden_states": torch.randn(2, 6, 12, generator=g), "timestep": torch.tensor([10, 500]),
              "encoder_attention_mask": text_kept, "num_frames": 2, "height": 4, "width": 4}
    return model, inputs


def tiny_wan(image: bool = False):
    """Wan text-to-video, or image-to-video (image tokens attended separately; the stock processor takes the last
    512 context tokens as the text)."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
                                  image_dim=8 if image else None, added_kv_proj_dim=24 if image else None)
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 512 if image else 6, 16, generator=g)}
    if image:
        inputs["encoder_hidden_states_image"] = torch.randn(2, 3, 8, generator=g)
    return model, inputs


def tiny_simple_cross_unet():
    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                 layers_per_block=1,
                                 down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                                 up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
                                 mid_block_type="UNetMidBlock2DSimpleCrossAttn", cross_attention_dim=12,
                                 attention_head_dim=8, norm_num_groups=8)
    g = torch.Generator().manual_seed(1)
    text_kept = torch.ones(2, 5, dtype=torch.bool)
    text_kept[1, 3:] = False
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 5, 12, generator=g), "encoder_attention_mask": text_kept}
    return model, inputs


MODELS = {"hunyuan": tiny_hunyuan, "auraflow": tiny_auraflow, "cogvideox": tiny_cogvideox, "ltx": tiny_ltx,
          "wan": tiny_wan, "wan_i2v": lambda: tiny_wan(image=True), "simple_cross_unet": tiny_simple_cross_unet}


def in_float64(model, inputs):
    double = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    for key in ("image_rotary_emb",):
        if key in double:
            double[key] = tuple(t.double() for t in double[key])
    return model.double().eval(), double


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MODELS))
def test_kept_layers_are_the_stock_processor_exactly(kind):
    model, inputs = in_float64(*MODELS[kind]())
    with torch.no_grad():
        calls, stock = recorded_run(model, inputs)
        with pytest.warns(UserWarning, match="no layer runs Cog attention"):
            assert apply_cog_attention(model, keep_softmax_first=100, keep_softmax_last=100) == []
        layers = attention_layers(model)
        assert all(type(m.processor).__name__.startswith("KeptSoftmax") and m.processor.runs_softmax
                   for m in layers.values())
        for name, (args, kw, want) in calls.items():
            for got, expect in zip(outputs(layers[name](*args, **kw)), outputs(want), strict=True):
                torch.testing.assert_close(got, expect, rtol=0, atol=0)
        torch.testing.assert_close(model(**inputs).sample, stock, rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(MODELS))
def test_cog_layers_follow_the_formula(kind):
    model, inputs = in_float64(*MODELS[kind]())
    with torch.no_grad():
        calls, stock = recorded_run(model, inputs)
        stock_processors = {name: type(m.processor) for name, m in attention_layers(model).items()}
        switched = apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=0)
        layers = attention_layers(model)
        assert sorted(switched) == sorted(layers) and all(type(m.processor).__name__.startswith("Cog") for m in layers.values())
        for name, (args, kw, stock_out) in calls.items():
            attn = layers[name]
            got = outputs(attn(*args, **kw))
            cog = attn.processor
            attn.set_processor(stock_processors[name]())
            with mock.patch("torch.nn.functional.scaled_dot_product_attention", formula_sdpa):
                expect = outputs(attn(*args, **kw))
            attn.set_processor(cog)
            for g, e, s in zip(got, expect, outputs(stock_out), strict=True):
                torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
            assert not torch.allclose(got[0], outputs(stock_out)[0], atol=1e-4)  # Cog is not softmax here
        assert not torch.allclose(model(**inputs).sample, stock, atol=1e-4)


def test_blocks_group_their_attention_layers():
    """HunyuanDiT's blocks hold a self- and a cross-attention each; keep_softmax_first=1 and keep_softmax_last=1 keep
    the first and last block."""
    model, _ = tiny_hunyuan()
    assert apply_cog_attention(model) == ["blocks.1.attn1", "blocks.1.attn2", "blocks.2.attn1",
                                                          "blocks.2.attn2"]
    model, _ = tiny_simple_cross_unet()  # attention layers outside blocks: each one is a block, in down, mid, up order
    assert apply_cog_attention(model) == ["mid_block.attentions.0", "up_blocks.0.attentions.0"]


def test_a_cog_training_step_has_finite_gradients():
    model, inputs = tiny_wan(image=True)
    switched = apply_cog_attention(model.train())
    model(**inputs).sample.square().mean().backward()
    layers = attention_layers(model)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(layers[name].to_q.weight.grad.abs().sum() > 0 for name in switched)


def test_sana_linear_attention_is_refused_with_the_reason():
    torch.manual_seed(0)
    model = SanaTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2,
                                   attention_head_dim=4, num_cross_attention_heads=2, cross_attention_head_dim=4,
                                   cross_attention_dim=8, caption_channels=8, sample_size=8)
    before = {name: type(m.processor) for name, m in attention_layers(model).items()}
    with pytest.raises(ValueError, match=r"'transformer_blocks.0.attn1' uses SanaLinearAttnProcessor2_0: linear "
                                         r"attention .*no signed-softmax counterpart"):
        apply_cog_attention(model)
    assert {name: type(m.processor) for name, m in attention_layers(model).items()} == before  # nothing changed


def test_explicit_added_kv_processors_keep_their_scale():
    """`set_default_attn_processor` gives a SimpleCrossAttn UNet the explicit `AttnAddedKVProcessor` (softmax by
    hand, scale `attn.scale`): its kept-softmax twin matches it, and its Cog layers compute what the SDPA variant's
    Cog layers compute (the same scale, hd ** -0.5, on these layers)."""
    model, inputs = in_float64(*tiny_simple_cross_unet())
    model.set_default_attn_processor()
    with torch.no_grad():
        stock = model(**inputs).sample
        with pytest.warns(UserWarning, match="no layer runs Cog attention"):
            apply_cog_attention(model, keep_softmax_first=100, keep_softmax_last=100)
        assert all(m.processor.layer_scale for m in attention_layers(model).values())
        # The stock processor's softmax runs in float32 (its `upcast_softmax` casts the scores with `.float()`).
        torch.testing.assert_close(model(**inputs).sample, stock, rtol=1e-6, atol=1e-6)
        apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=0)
        cog = model(**inputs).sample
        sdpa_variant, _ = in_float64(*tiny_simple_cross_unet())
        apply_cog_attention(sdpa_variant, keep_softmax_first=0, keep_softmax_last=0)
        torch.testing.assert_close(cog, sdpa_variant(**inputs).sample, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(cog, stock, atol=1e-4)
