"""Cogformer: causality, KV cache, padding, layer placement, parameter counts and the transformers round trip."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from uvic.models.cogformer import COGFORMER_PRESETS, CogformerConfig, CogformerForCausalLM, cogformer_config


def tiny(attention="cog", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = cogformer_config("tiny", attention=attention, **kw)
    return CogformerForCausalLM(cfg).eval()


@pytest.mark.parametrize("attention", ["cog", "softmax"])
def test_causality(attention):
    """Logits at positions <= t do not change when tokens after t change."""
    model = tiny(attention)
    x = torch.randint(0, 257, (2, 24))
    y = x.clone()
    t = 11
    y[:, t + 1 :] = torch.randint(0, 257, (2, 24 - t - 1))
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-5)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-3  # the later positions do see the change


@pytest.mark.parametrize("attention", ["cog", "softmax"])
def test_cached_step_logits_equal_full_recomputation(attention):
    model = tiny(attention)
    x = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = DynamicCache()
        steps = [model(x[:, :8], past_key_values=cache, use_cache=True).logits]  # prefill
        for t in range(8, 20):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert cache.get_seq_length() == 20
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-4)


def test_cache_is_taken_under_both_names():
    """transformers >= 5.24's generate() passes the KV cache as `cache=`, older versions as `past_key_values=`."""
    model = tiny()
    x = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        full = model(x, use_cache=False).logits[:, -1]
        old, new = DynamicCache(), DynamicCache()
        model(x[:, :8], past_key_values=old, use_cache=True)
        model(x[:, :8], cache=new, use_cache=True)
        assert old.get_seq_length() == new.get_seq_length() == 8
        by_old = model(x[:, 8:], past_key_values=old, use_cache=True).logits[:, -1]
        by_new = model(x[:, 8:], cache=new, use_cache=True).logits[:, -1]
    torch.testing.assert_close(by_new, by_old, rtol=0, atol=0)
    torch.testing.assert_close(by_new, full, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="not both"):
        model(x, past_key_values=DynamicCache(), cache=DynamicCache())


def test_generate_logs_no_deprecation_warning():
    """The generate snippet of docs/language_models.md: transformers >= 5.24 names the KV cache `cache` in its outputs, and logs a
    deprecation warning when an output is built or read under the old name `past_key_values`."""
    import logging

    import transformers

    model = tiny()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    library = logging.getLogger("transformers")  # it does not propagate to the root logger
    logging.Logger.warning_once.cache_clear()  # transformers logs this warning once per process
    library.addHandler(handler)
    try:
        out = model.generate(torch.randint(0, 257, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=256,
                             return_dict_in_generate=True)
    finally:
        library.removeHandler(handler)
    assert [r.getMessage() for r in records if "deprecated" in r.getMessage()] == []
    assert out.sequences.shape == (1, 8)
    if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__:
        assert model(torch.randint(0, 257, (1, 5)), use_cache=True).cache.get_seq_length() == 5


@pytest.mark.parametrize("attention", ["cog", "softmax"])
def test_greedy_generate_with_cache_equals_without(attention):
    model = tiny(attention, seed=1)
    x = torch.randint(0, 257, (2, 10))
    with torch.no_grad():
        g_cache = model.generate(x, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=256)
        g_full = model.generate(x, max_new_tokens=12, do_sample=False, use_cache=False, pad_token_id=256)
        # Independent greedy loop: argmax of a full forward pass each step.
        seq = x
        for _ in range(12):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(g_cache, g_full)
    assert torch.equal(g_cache, seq)


@pytest.mark.parametrize("attention", ["cog", "softmax"])
def test_left_padded_batch_matches_unpadded(attention):
    """Real tokens of a left-padded row get the logits of the same sequence run alone; so does generation."""
    model = tiny(attention, seed=2)
    long_seq = torch.randint(0, 257, (1, 16))
    short = torch.randint(0, 257, (1, 10))
    pad = 256
    batch = torch.cat([long_seq, torch.cat([torch.full((1, 6), pad), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone_short = model(short).logits
        alone_long = model(long_seq).logits
        torch.testing.assert_close(padded[1, 6:], alone_short[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(padded[0], alone_long[0], rtol=0, atol=1e-4)
        assert torch.isfinite(padded).all()
        gen = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=pad)
        gen_alone = model.generate(short, max_new_tokens=6, do_sample=False, pad_token_id=pad)
    assert torch.equal(gen[1, 16:], gen_alone[0, 10:])


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny().train()
    x = torch.randint(0, 257, (2, 16))
    model(x, labels=x).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # v5 name, v4 name
    assert model.model.gradient_checkpointing
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_loss_is_shifted_cross_entropy():
    model = tiny()
    x = torch.randint(0, 257, (3, 12))
    labels = x.clone()
    labels[0, 5] = -100
    out = model(x, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 257), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)


@pytest.mark.parametrize("preset,k", [("141M", 1), ("600M", 2), ("1B", 3), ("tiny", 1)])
def test_layer_placement(preset, k):
    """Softmax in the first k and last k layers, Cog elsewhere (paper Sec. 4.1 and App. C); baseline all softmax."""
    cfg = cogformer_config(preset)
    n = cfg.num_hidden_layers
    expected = ["softmax"] * k + ["cog"] * (n - 2 * k) + ["softmax"] * k
    assert (cfg.keep_softmax_first, cfg.keep_softmax_last) == (k, k)
    assert cfg.attention_types() == expected
    assert cogformer_config(preset, attention="softmax").attention_types() == ["softmax"] * n
    with torch.device("meta"):
        model = CogformerForCausalLM(cfg)
    assert [layer.self_attn.attention for layer in model.model.layers] == expected


PLACEMENTS = [  # (keep_softmax_first, keep_softmax_last) -> the kinds of 6 layers
    ((2, 0), ["softmax", "softmax", "cog", "cog", "cog", "cog"]),
    ((0, 2), ["cog", "cog", "cog", "cog", "softmax", "softmax"]),
    ((1, 0), ["softmax", "cog", "cog", "cog", "cog", "cog"]),
    ((0, 0), ["cog"] * 6),
    ((2, 2), ["softmax", "softmax", "cog", "cog", "softmax", "softmax"]),
]


@pytest.mark.parametrize("ends, expected", PLACEMENTS)
def test_placement_ends(ends, expected):
    """keep_softmax_first / keep_softmax_last set one end each (U-ViT's keys)."""
    cfg = cogformer_config("tiny", num_hidden_layers=6, keep_softmax_first=ends[0], keep_softmax_last=ends[1])
    assert cfg.attention_types() == expected
    with torch.device("meta"):
        model = CogformerForCausalLM(cfg)
    assert [layer.self_attn.attention for layer in model.model.layers] == expected


@pytest.mark.parametrize("kwargs, ends", [
    ({"num_softmax_layers": 2, "keep_softmax_last": 0}, (2, 0)),
    ({"num_softmax_layers": 2, "keep_softmax_first": 0}, (0, 2)),
    ({"num_softmax_layers": 0}, (0, 0)),
    ({"num_softmax_layers": 2, "keep_softmax_first": None, "keep_softmax_last": None}, (2, 2)),
])
def test_the_old_num_softmax_layers_sets_both_ends_with_one_warning(kwargs, ends):
    """The old count k = num_softmax_layers is both ends, an end given apart wins (None: k), as before the rename."""
    with pytest.warns(FutureWarning, match=r"^CogformerConfig: num_softmax_layers is the old name") as record:
        cfg = cogformer_config("tiny", num_hidden_layers=6, **kwargs)
    assert len(record) == 1 and (cfg.keep_softmax_first, cfg.keep_softmax_last) == ends
    assert cfg.attention_types() == dict(PLACEMENTS)[ends]
    assert "num_softmax_layers" not in cfg.to_dict()


@pytest.mark.parametrize("old_ends", ["absent", "null"])
def test_a_config_saved_with_num_softmax_layers_loads_identically(tmp_path, old_ends):
    """A config.json written before the rename (num_softmax_layers = k, the ends absent, or null as configs saved
    between the two versions hold them) loads with the same placement and one FutureWarning."""
    model = tiny(attention="cog", num_hidden_layers=6, keep_softmax_first=2, keep_softmax_last=2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["keep_softmax_first"], saved["keep_softmax_last"]) == (2, 2) and "num_softmax_layers" not in saved
    del saved["keep_softmax_first"], saved["keep_softmax_last"]
    saved = {**saved, "num_softmax_layers": 2, **({"keep_softmax_first": None, "keep_softmax_last": None}
                                                  if old_ends == "null" else {})}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(FutureWarning, match="num_softmax_layers is the old name") as record:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert len([w for w in record if issubclass(w.category, FutureWarning)]) == 1
    assert loaded.config.attention_types() == ["softmax", "softmax", "cog", "cog", "softmax", "softmax"]
    x = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def closed_form_params(V, D, F_, n_layers, nh, hd):
    attn = 3 * D * nh * hd + nh * hd * D  # q, k, v, o; no biases
    ffn = 3 * D * F_  # SwiGLU gate, up, down
    norms = 2 * D
    return V * D + n_layers * (attn + ffn + norms) + D + V * D  # embedding, layers, final norm, untied head


@pytest.mark.parametrize("preset", sorted(COGFORMER_PRESETS))
def test_parameter_counts(preset):
    p = COGFORMER_PRESETS[preset]
    with torch.device("meta"):
        model = CogformerForCausalLM(cogformer_config(preset))
    count = sum(t.numel() for t in model.parameters())
    D, nh = p["hidden_size"], p["num_attention_heads"]
    expected = closed_form_params(p["vocab_size"], D, p["intermediate_size"], p["num_hidden_layers"], nh, D // nh)
    assert count == expected
    head = p["vocab_size"] * D
    if preset == "141M":
        # The paper's "141M" matches the count with the 32000 x 768 embedding counted once (137.8M, within 3%);
        # with the untied output head the model holds 162.4M parameters.
        assert abs((count - head) / 141e6 - 1) < 0.03
    elif preset == "600M":
        assert abs(count / 600e6 - 1) < 0.03
    elif preset == "1B":
        assert abs(count / 1e9 - 1) < 0.05


def test_save_load_round_trip_with_auto_classes(tmp_path):
    model = tiny(attention="cog", num_hidden_layers=6, keep_softmax_first=2, keep_softmax_last=2)
    model.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, CogformerConfig) and cfg.model_type == "cogformer"
    expected = ["softmax", "softmax", "cog", "cog", "softmax", "softmax"]
    assert cfg.attention_types() == model.config.attention_types() == expected
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, CogformerForCausalLM)
    x = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


def test_save_load_softmax_baseline(tmp_path):
    model = tiny(attention="softmax")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.attention == "softmax"
    x = torch.randint(0, 257, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"attention": "linear"}, "attention must be one of"),
        ({"keep_softmax_first": 3, "keep_softmax_last": 3, "num_hidden_layers": 4}, "keep_softmax_first=3 and "
                                                                                   "keep_softmax_last=3 .* overlap"),
        ({"num_softmax_layers": True}, "num_softmax_layers must be an int >= 0, got True"),
        ({"num_softmax_layers": -1}, "num_softmax_layers must be an int >= 0, got -1"),
        ({"keep_softmax_first": 1.5}, "keep_softmax_first must be an int >= 0, got 1.5"),
        ({"keep_softmax_last": None}, "keep_softmax_last must be an int >= 0, got None"),
        ({"keep_softmax_first": 12, "num_hidden_layers": 12}, r"keep_softmax_first=12 and keep_softmax_last=1 .* overlap"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"hidden_size": 60, "num_attention_heads": 4}, "head_dim must be even"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CogformerConfig(**kwargs)


def test_input_errors():
    model = tiny()
    x = torch.randint(0, 257, (2, 5))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(x, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="past_key_values must be a transformers Cache"):
        model(x, past_key_values=((torch.zeros(1),),))
    with pytest.raises(ValueError, match="unknown Cogformer preset"):
        cogformer_config("7B")
