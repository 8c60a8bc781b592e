"""uvic.integrations.transformers on tiny configs of transformers' own LlamaForCausalLM and Qwen2ForCausalLM.

Each layer's output is checked against the paper's formula (Cog layers) or softmax (kept layers), written out here
from the layer's own projections and transformers' rotary embedding.
"""

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from uvic.integrations.transformers import apply_cog_attention


def tiny(family, layers=4, sliding_window=4096):
    """A 4-layer model with grouped-query attention (4 query heads, 2 key/value heads). Mistral's sliding window
    (4096 by default) is longer than these sequences, so its pattern is the causal one."""
    torch.manual_seed(0)
    kw = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**kw, sliding_window=sliding_window)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()


def batch():
    """Two sequences of 9 tokens; the second is left-padded by 3 (as generate() pads)."""
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def paper_layer(attn, x, cos, sin, key_kept, cog):
    """A decoder attention layer by the formula: p = q k^T / sqrt(hd) over kept keys (causal and padding);
    Cog weights sign(p) * softmax(|p|), softmax weights softmax(p)."""
    B, L, _ = x.shape
    hd = attn.head_dim
    q, k, v = (proj(x).view(B, L, -1, hd).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = (j <= i)[None, None] & key_kept[:, None, None, :]
    p = q @ k.transpose(-2, -1) / hd**0.5
    scores = (p.abs() if cog else p).masked_fill(~keep, float("-inf"))
    w = torch.softmax(scores, -1)
    out = ((torch.sign(p) * w if cog else w) @ v).transpose(1, 2).reshape(B, L, -1)
    return attn.o_proj(out)


def record_attention(model):
    calls = {}

    def hook(name):
        def record(module, args, kwargs, output):
            calls[name] = (kwargs, output[0])
        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in model.named_modules()
               if n.endswith("self_attn")]  # fmt: skip
    return calls, handles


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_layers_follow_the_placement_rule_and_the_formula(family):
    model = tiny(family)
    ids, mask = batch()
    with torch.no_grad():
        stock_calls, handles = record_attention(model)
        stock = model(ids, attention_mask=mask).logits
        for h in handles:
            h.remove()
        switched = apply_cog_attention(model, keep_softmax=1)
        assert switched == ["model.layers.1.self_attn", "model.layers.2.self_attn"]
        calls, handles = record_attention(model)
        logits = model(ids, attention_mask=mask).logits
        for h in handles:
            h.remove()
    real = mask.bool()
    assert not torch.allclose(logits[real], stock[real], atol=1e-3)
    assert len(calls) == 4
    first = "model.layers.0.self_attn"  # same input as in the stock model: a kept layer gives the stock output
    torch.testing.assert_close(calls[first][1][real], stock_calls[first][1][real], rtol=1e-6, atol=1e-6)
    for name, (kw, out) in calls.items():
        attn = model.get_submodule(name)
        cos, sin = kw["position_embeddings"]
        expect = paper_layer(attn, kw["hidden_states"], cos, sin, real, cog=name in switched)
        torch.testing.assert_close(out[real], expect[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_all_layers_kept_is_the_stock_model(family):
    model = tiny(family)
    ids, mask = batch()
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
        assert apply_cog_attention(model, keep_softmax=2) == []
        real = mask.bool()
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], stock[real], rtol=1e-5, atol=1e-5)
        assert len(apply_cog_attention(model, keep_softmax=0)) == 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padding_does_not_change_the_real_tokens(family):
    model = tiny(family)
    apply_cog_attention(model, keep_softmax=1)
    ids, mask = batch()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[1, 3:]
        alone = model(ids[1:, 3:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_gives_the_same_tokens_with_and_without_the_cache(family):
    model = tiny(family)
    apply_cog_attention(model, keep_softmax=1)
    ids, mask = batch()
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with_cache = model.generate(ids, use_cache=True, **kw)
    without = model.generate(ids, use_cache=False, **kw)
    assert with_cache.shape == (2, 15)
    assert torch.equal(with_cache, without)
    # and the cached logits are the full forward's logits at each step
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        step = model(with_cache[:, 9:10], attention_mask=torch.cat([mask, mask.new_ones(2, 1)], 1),
                     past_key_values=out.past_key_values).logits[:, -1]  # fmt: skip
        full = model(with_cache[:, :10], attention_mask=torch.cat([mask, mask.new_ones(2, 1)], 1)).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_from_config_with_cog_uses_the_default_placement(family):
    model = tiny(family)
    config = copy.deepcopy(model.config)  # from_config keeps the config object and sets its implementation
    built = AutoModelForCausalLM.from_config(config, attn_implementation="cog").eval()
    built.load_state_dict(model.state_dict())
    assert built.config._attn_implementation == "cog" and not hasattr(built.config, "cog_keep_softmax")
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
        from_config = built(ids, attention_mask=mask).logits
        apply_cog_attention(model, keep_softmax=1)  # the default: softmax in the first and last layer
        torch.testing.assert_close(from_config[real], model(ids, attention_mask=mask).logits[real])
    assert not torch.allclose(from_config[real], stock[real], atol=1e-3)


def test_save_and_load_keep_the_rule(tmp_path):
    model = tiny("llama", layers=6)
    apply_cog_attention(model, keep_softmax=2)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="cog").eval()
    assert loaded.config.cog_keep_softmax == 2
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    fresh = AutoModelForCausalLM.from_config(loaded.config, attn_implementation="cog")
    assert fresh.config._attn_implementation == "cog" and fresh.config.cog_keep_softmax == 2


def test_a_training_step_has_finite_gradients():
    model = tiny("qwen2").train()
    apply_cog_attention(model, keep_softmax=1)
    ids, mask = batch()
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.model.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_unsupported_inputs_are_refused_with_the_layer_named():
    model = tiny("llama")
    apply_cog_attention(model, keep_softmax=1)
    ids, _ = batch()
    four_d = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"LlamaAttention \(layer 0\).*4-D masks are not supported"):
        model(ids, attention_mask=four_d)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=32)
    with pytest.raises(ValueError, match="Llama attention mask: Cog attention needs keys that end at the current"):
        model(ids, past_key_values=cache, use_cache=True)
    packed = torch.cat([torch.arange(4), torch.arange(5)])[None].expand(2, -1)  # two documents in each row
    with pytest.raises(ValueError, match="Llama attention mask: .*another pattern .*packed sequences"):
        model(ids, position_ids=packed, use_cache=False)
    short_window = tiny("mistral", sliding_window=4)
    apply_cog_attention(short_window)
    with pytest.raises(ValueError, match="Mistral attention mask: .*a sliding window shorter than the sequence"):
        short_window(ids)
    for bad in (-1, 2.0):
        with pytest.raises(ValueError, match="keep_softmax"):
            apply_cog_attention(model, keep_softmax=bad)
    with pytest.raises(ValueError, match="Linear is not a transformers model"):
        apply_cog_attention(torch.nn.Linear(2, 2))
    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32))  # fmt: skip
    with pytest.raises(ValueError, match="BartForConditionalGeneration is an encoder-decoder model"):
        apply_cog_attention(bart)
