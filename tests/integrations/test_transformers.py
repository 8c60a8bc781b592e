"""uvic.integrations.transformers on tiny configs of transformers' own LlamaForCausalLM and Qwen2ForCausalLM.

Each layer's output is checked against the paper's formula (Cog layers) or softmax (kept layers), written out here
from the layer's own projections and transformers' rotary embedding.
"""

import copy
import json
import re
import warnings

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertModel,
    CLIPConfig,
    CLIPModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTModel,
    WhisperConfig,
    WhisperForConditionalGeneration,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
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
               if n.endswith("self_attn")]
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
        switched = apply_cog_attention(model)
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
        with pytest.warns(UserWarning, match=r"keep_softmax_first=2 and keep_softmax_last=2 keep every layer of its "
                                             r"stacks \(4 layers\)"):
            assert apply_cog_attention(model, keep_softmax_first=2, keep_softmax_last=2) == []
        real = mask.bool()
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], stock[real], rtol=1e-5, atol=1e-5)
        assert len(apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=0)) == 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padding_does_not_change_the_real_tokens(family):
    model = tiny(family)
    apply_cog_attention(model)
    ids, mask = batch()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[1, 3:]
        alone = model(ids[1:, 3:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_gives_the_same_tokens_with_and_without_the_cache(family):
    model = tiny(family)
    apply_cog_attention(model)
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
                     past_key_values=out.past_key_values).logits[:, -1]
        full = model(with_cache[:, :10], attention_mask=torch.cat([mask, mask.new_ones(2, 1)], 1)).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_static_cache_gives_the_dynamic_cache_tokens_and_logits(family):
    """A StaticCache holds max_cache_len slots, filled up to the current token: Cog attends to the filled ones."""
    model = tiny(family, sliding_window=4)  # Mistral: a window shorter than the sequence, in a static window layer
    apply_cog_attention(model)
    ids, mask = batch()
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
          "return_dict_in_generate": True, "output_scores": True}
    static = model.generate(ids, cache_implementation="static", **kw)
    dynamic = model.generate(ids, **kw)
    assert type(static.past_key_values).__name__ == "StaticCache"
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.scores, dynamic.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a prefill into a fresh cache longer than the sequence: the full forward's logits
    from transformers import StaticCache

    with torch.no_grad():
        cached = model(ids, attention_mask=mask, past_key_values=StaticCache(config=model.config, max_cache_len=32),
                       use_cache=True).logits
        full = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(cached[1, 3:], full[1, 3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached[0], full[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_from_config_with_cog_uses_the_default_placement(family):
    model = tiny(family)
    config = copy.deepcopy(model.config)  # from_config keeps the config object and sets its implementation
    built = AutoModelForCausalLM.from_config(config, attn_implementation="cog").eval()
    built.load_state_dict(model.state_dict())
    assert built.config._attn_implementation == "cog" and not hasattr(built.config, "cog_keep_softmax_first")
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
        from_config = built(ids, attention_mask=mask).logits
        apply_cog_attention(model)  # the default: softmax in the first and last layer
        torch.testing.assert_close(from_config[real], model(ids, attention_mask=mask).logits[real])
    assert not torch.allclose(from_config[real], stock[real], atol=1e-3)


def test_save_and_load_keep_the_rule(tmp_path):
    model = tiny("llama", layers=6)
    apply_cog_attention(model, keep_softmax_first=2, keep_softmax_last=2)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # the saved config names "cog"
    assert loaded.config._attn_implementation == "cog" and loaded.config.cog_keep_softmax_first == 2
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    fresh = AutoModelForCausalLM.from_config(loaded.config, attn_implementation="cog")
    assert fresh.config._attn_implementation == "cog" and fresh.config.cog_keep_softmax_last == 2
    loaded.save_pretrained(tmp_path / "again")  # a loaded model saves "cog" again
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "again").config._attn_implementation == "cog"


def test_the_two_ends_are_placed_apart():
    """keep_softmax_first / keep_softmax_last, as U-ViT's and Cogformer's: 1 and 0 keep only layer 0 on softmax."""
    model = tiny("llama")
    assert apply_cog_attention(model, keep_softmax_first=1, keep_softmax_last=0) == [
        f"model.layers.{i}.self_attn" for i in (1, 2, 3)]
    assert apply_cog_attention(model, keep_softmax_first=0, keep_softmax_last=2) == [
        f"model.layers.{i}.self_attn" for i in (0, 1)]


def test_the_old_keep_softmax_still_places_both_ends_with_one_warning(tmp_path):
    """`apply_cog_attention(model, keep_softmax=k)` and a config.json saved with the one count `cog_keep_softmax`
    (as before the rename) give the placement k and k, each with one FutureWarning; the loaded model's logits are
    the saving model's."""
    model = tiny("llama", layers=6)
    with pytest.warns(FutureWarning, match=r"^apply_cog_attention: keep_softmax is the old name") as record:
        switched = apply_cog_attention(model, keep_softmax=2)
    assert len(record) == 1 and switched == ["model.layers.2.self_attn", "model.layers.3.self_attn"]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["cog_keep_softmax_first"], saved["cog_keep_softmax_last"]) == (2, 2)
    del saved["cog_keep_softmax_first"], saved["cog_keep_softmax_last"]
    (tmp_path / "config.json").write_text(json.dumps({**saved, "cog_keep_softmax": 2}))
    with pytest.warns(FutureWarning, match=r"LlamaConfig .*: cog_keep_softmax is the old name") as record:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert len([w for w in record if issubclass(w.category, FutureWarning)]) == 1
    assert (loaded.config.cog_keep_softmax_first, loaded.config.cog_keep_softmax_last) == (2, 2)
    assert not hasattr(loaded.config, "cog_keep_softmax")
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_a_saved_placement_is_checked_on_load(tmp_path):
    """config.json's cog_keep_softmax_first / _last (and the old cog_keep_softmax) are checked when a model is built
    from it, as apply_cog_attention checks its counts: before, -1 switched every layer, 0.5 half a placement,
    NaN / inf / 1e6 none, and "1" / null / [1] failed at the forward."""
    model = tiny("llama")
    apply_cog_attention(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for field in ("cog_keep_softmax_first", "cog_keep_softmax_last", "cog_keep_softmax"):
        for bad in (-1, 0.5, float("nan"), float("inf"), 1e6, "1", None, [1], True):
            (tmp_path / "config.json").write_text(json.dumps({**saved, field: bad}))
            for implementation in ("cog", "sdpa"):  # a damaged record is an error whichever implementation runs
                with pytest.raises(ValueError, match=rf"^LlamaConfig .*: {field} must be an int >= 0, got "):
                    AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation)
    with pytest.raises(ValueError, match=r"^keep_softmax_last must be an int >= 0, got 0.5$"):  # the same check
        apply_cog_attention(model, keep_softmax_first=1, keep_softmax_last=0.5)


def test_a_bad_backend_is_refused_at_apply_and_at_load(tmp_path):
    """backend="bogus" was accepted, saved by save_pretrained and failed at the first forward: it is refused at
    apply, and a saved config.json edited to a backend that is not one is refused when the model is built (as the
    diffusers integration does)."""
    from uvic.attention import BACKENDS

    model = tiny("llama")
    with pytest.raises(ValueError, match=r"^backend must be one of .*, got 'bogus'$"):
        apply_cog_attention(model, backend="bogus")
    assert model.config._attn_implementation != "cog" and not hasattr(model.config, "cog_backend")  # untouched
    apply_cog_attention(model, backend="torch")
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.cog_backend == "torch"
    saved = json.loads((tmp_path / "config.json").read_text())
    for bad in ("bogus", 1, None, ["torch"]):
        (tmp_path / "config.json").write_text(json.dumps({**saved, "cog_backend": bad}))
        with pytest.raises(ValueError, match=rf"^LlamaConfig .*: cog_backend must be one of "
                                             rf"{re.escape(str(BACKENDS))}, got "):
            AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_cog_config_running_another_implementation_warns(tmp_path):
    model = tiny("llama")
    apply_cog_attention(model)
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"Llama model .*records Cog attention \(cog_keep_softmax_first=1, "
                                         r"cog_keep_softmax_last=1\), but it runs 'sdpa' attention"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny("llama")  # a stock config: no warning


def test_a_training_step_has_finite_gradients():
    model = tiny("qwen2").train()
    apply_cog_attention(model)
    ids, mask = batch()
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.model.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_unsupported_inputs_are_refused_with_the_layer_named():
    model = tiny("llama")
    apply_cog_attention(model)
    ids, _ = batch()
    three_d = torch.ones(2, 9, 9, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"LlamaAttention \(layer 0\).*got a 3-D torch.bool mask"):
        model(ids, attention_mask=three_d)
    packed = torch.cat([torch.arange(4), torch.arange(5)])[None].expand(2, -1)  # two documents in each row
    with pytest.raises(ValueError, match="Llama attention mask: .*another pattern .*packed sequences"):
        model(ids, position_ids=packed, use_cache=False)
    for bad in (-1, 2.0):
        with pytest.raises(ValueError, match="keep_softmax"):
            apply_cog_attention(model, keep_softmax_first=bad, keep_softmax_last=bad)
    with pytest.raises(ValueError, match="Linear is not a transformers model"):
        apply_cog_attention(torch.nn.Linear(2, 2))


def four_d(mask, additive=False):
    """transformers' 4-D form of a causal pattern with key padding `mask` (B, L): (B, 1, L, L), bool True = attend,
    or float with 0 where attended and the dtype's lowest value elsewhere."""
    L = mask.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min) if additive else keep


@pytest.mark.parametrize("keep_softmax", [1, 1000])
@pytest.mark.parametrize("additive", [False, True])
def test_a_4d_causal_padding_mask_is_the_2d_mask(keep_softmax, additive):
    """A caller's 4-D mask of the causal pattern with key padding runs as the 2-D padding mask, on Cog layers and
    on a model that keeps softmax everywhere."""
    model = tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 1000 and 1000: no layer runs Cog
        apply_cog_attention(model, keep_softmax_first=keep_softmax, keep_softmax_last=keep_softmax)
    ids, mask = batch()
    with torch.no_grad():
        expect = model(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=four_d(mask, additive)).logits
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


def test_other_4d_masks_are_refused_with_the_layer_named():
    model = tiny("llama")
    apply_cog_attention(model)
    ids, mask = batch()
    bidirectional = mask.bool()[:, None, None, :].expand(2, 1, 9, 9)
    block = four_d(mask).clone()
    block[:, :, 5:, :5] = False  # two documents in each row
    for bad in (bidirectional, block):
        with pytest.raises(ValueError, match=r"^LlamaAttention \(layer 0\): Cog attention takes a 4-D mask only when "
                                             r"it is the layer's causal pattern"):
            model(ids, attention_mask=bad)
    biased = four_d(mask, additive=True) + 0.5 * torch.ones(9, 9).triu(1).T  # a bias on the kept scores
    with pytest.raises(ValueError, match=r"^LlamaAttention \(layer 0\): the 4-D float attention mask holds values"):
        model(ids, attention_mask=biased)
    with pytest.raises(ValueError, match=r"a 4-D attention mask of shape \(2, 1, 9, 8\) does not fit 2 sequences"):
        model(ids, attention_mask=four_d(mask)[..., :8])


def test_static_cache_generation_compiles_to_one_graph():
    """transformers' `generate` with a StaticCache and fullgraph compilation (its own
    test_generate_compile_model_forward_fullgraph): the decoding steps are one graph, as with SDPA, and give the
    tokens of uncompiled generation. The "eager" backend: dynamo traces and counts graphs without code generation."""
    from torch._dynamo.utils import counters
    from transformers.generation import CompileConfig

    model = tiny("llama", layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # every layer keeps softmax, as in transformers' test
        apply_cog_attention(model, keep_softmax_first=1000, keep_softmax_last=1000)
    ids, mask = batch()
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CPU only when asked
    kw = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0,
          "cache_implementation": "static"}
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(ids, compile_config=config, **kw)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"]
    assert torch.equal(compiled, model.generate(ids, disable_compile=True, **kw))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# Encoders, cross-attention, sliding windows and softcaps, against the formula with transformers' own masks
# ---------------------------------------------------------------------------------------------------------


def formula_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """An `AttentionInterface` entry written from the paper: p = scaling * q k^T (capped as c * tanh(p / c) with a
    softcap c), then sign(p) * softmax(|p|) on layers flagged `formula_cog`, softmax(p) elsewhere, over the keys
    transformers' own boolean mask keeps (causal, sliding window, padding; None: every key)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    p = query @ key.transpose(-2, -1) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        p = softcap * torch.tanh(p / softcap)
    cog = module.formula_cog
    scores = p.abs() if cog else p
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    w = torch.softmax(scores, -1).nan_to_num(0.0)  # a padded query that sees no key: zeros
    return ((torch.sign(p) * w if cog else w) @ value).transpose(1, 2), None


def formula_mask(*args, **kwargs):
    """transformers' SDPA mask, always materialised: (B, 1, Lq, Lk) bool, True = attend."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


AttentionInterface.register("formula", formula_attention)
AttentionMaskInterface.register("formula", formula_mask)


def tiny_vit():
    torch.manual_seed(0)
    config = ViTConfig(image_size=8, patch_size=2, num_channels=3, hidden_size=16, num_hidden_layers=3,
                       num_attention_heads=2, intermediate_size=32)
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return ViTModel(config), {"pixel_values": pixels}, lambda out: out.last_hidden_state


def tiny_clip():
    torch.manual_seed(0)
    config = CLIPConfig(text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                     "num_hidden_layers": 3, "num_attention_heads": 2, "max_position_embeddings": 16},
                        vision_config={"image_size": 8, "patch_size": 2, "hidden_size": 16, "intermediate_size": 32,
                                       "num_hidden_layers": 3, "num_attention_heads": 2},
                        projection_dim=8)
    ids, mask = batch()
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": mask.flip(-1), "pixel_values": pixels}  # right-padded captions
    return CLIPModel(config), inputs, lambda out: torch.cat([out.text_model_output.last_hidden_state.flatten(1),
                                                             out.vision_model_output.last_hidden_state.flatten(1)], 1)


def tiny_whisper():
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=3, decoder_layers=3, d_model=16,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, max_source_positions=8, max_target_positions=16, pad_token_id=0,
                           decoder_start_token_id=1)
    g = torch.Generator().manual_seed(1)
    inputs = {"input_features": torch.randn(2, 8, 16, generator=g),
              "decoder_input_ids": torch.randint(1, 64, (2, 7), generator=g)}
    return WhisperForConditionalGeneration(config), inputs, lambda out: out.logits


def tiny_windowed(family):
    """Local attention over 4 tokens on 9-token sequences: Mistral (every layer), Gemma 2 (alternating local and
    global layers, attention logits softcapped at 2), Gemma 3 (local layers, then a global one). Gemma 2's batch is
    right-padded: the stock (eager) Gemma 2 turns left-padded rows to NaN, as their first windows hold only padding."""
    torch.manual_seed(0)
    kw = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
          "sliding_window": 4}
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw))
    elif family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**kw, head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                                               final_logit_softcapping=None))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**kw, head_dim=8, query_pre_attn_scalar=8,
                                                   layer_types=["sliding_attention"] * 3 + ["full_attention"]))
    ids, mask = batch()
    if family == "gemma2":
        ids, mask = ids.flip(-1), mask.flip(-1)
    return model, {"input_ids": ids, "attention_mask": mask}, lambda out: out.logits[mask.bool()]


def tiny_bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=64, pad_token_id=0)
    ids, mask = batch()
    ids, mask = ids.flip(-1), mask.flip(-1)  # right-padded: a key padding mask in bidirectional attention
    return BertModel(config), {"input_ids": ids, "attention_mask": mask}, lambda out: out.last_hidden_state[mask.bool()]


def tiny_bart():
    """An encoder-decoder: padded encoder input, so the cross-attention gets a key padding mask too."""
    torch.manual_seed(0)
    config = BartConfig(vocab_size=64, d_model=16, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    ids, mask = batch()
    inputs = {"input_ids": ids.flip(-1) + 3, "attention_mask": mask.flip(-1), "decoder_input_ids": ids[:, :5] + 3}
    return BartForConditionalGeneration(config), inputs, lambda out: out.logits


ENCODERS = {"bert": tiny_bert, "bart": tiny_bart, "vit": tiny_vit, "clip": tiny_clip, "whisper": tiny_whisper, "mistral_window": lambda: tiny_windowed(
    "mistral"), "gemma2": lambda: tiny_windowed("gemma2"), "gemma3": lambda: tiny_windowed("gemma3")}
# The attention modules apply_cog_attention(model) (1 and 1) switches: the middle layer of each 3-layer stack
# (CLIP: the text and the vision tower; Whisper, BART: the encoder and the decoder, self- and cross-attention).
SWITCHED = {
    "bart": ["model.encoder.layers.1.self_attn", "model.decoder.layers.1.self_attn",
             "model.decoder.layers.1.encoder_attn"],
    "vit": ["layers.1.attention"],
    "clip": ["text_model.encoder.layers.1.self_attn", "vision_model.encoder.layers.1.self_attn"],
    "whisper": ["model.encoder.layers.1.self_attn", "model.decoder.layers.1.self_attn",
                "model.decoder.layers.1.encoder_attn"],
}


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_switched_models_match_the_formula_with_transformers_masks(kind):
    model, inputs, output = ENCODERS[kind]()
    model = model.double().eval()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        stock = output(model(**inputs))
        switched = apply_cog_attention(model)
        if kind in SWITCHED:
            assert switched == SWITCHED[kind]
        got = output(model(**inputs))
        for name, m in model.named_modules():
            m.formula_cog = name in switched
        model.set_attn_implementation("formula")
        expect = output(model(**inputs))
        for name in switched:  # the reference is not the stock model: its flagged layers are Cog
            model.get_submodule(name).formula_cog = False
        tol = 1e-6 if kind == "gemma2" else 1e-10  # stock Gemma 2 is eager attention, whose softmax runs in float32
        torch.testing.assert_close(output(model(**inputs)), stock, rtol=tol, atol=tol)
    torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(got, stock, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_windowed_generation_with_a_cache_longer_than_the_window(family):
    model, inputs, _ = tiny_windowed(family)
    model.eval()
    apply_cog_attention(model)
    kw = {"attention_mask": inputs["attention_mask"], "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with_cache = model.generate(inputs["input_ids"], use_cache=True, **kw)
    assert torch.equal(with_cache, model.generate(inputs["input_ids"], use_cache=False, **kw))


def test_t5_is_refused_for_its_position_bias():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match="T5Attention adds a learned relative-position bias to the attention scores"):
        apply_cog_attention(t5)
