"""Tests for UViTModel (U-ViT / U-ViC).

Independent references used here:
- parameter counts, key lists and shapes written out from docs/conventions.md ("Official checkpoints",
  "Cog placement") and the U-ViT paper's Table 1;
- `_official_forward`: a functional re-implementation of the official `UViT.forward` (math attention path)
  that reads only a state dict and those rules (token order, LIFO skips, Cog placement, unpatchify layout).
"""

import dataclasses
import json
import math

import einops
import pytest
import torch
import torch.nn.functional as F

from uvic.config import config_from_dict, load_config
from uvic.errors import ConfigError
from uvic.models import UVIT_PRESETS, UViTModel, build_preset, uvit_from_official


# --------------------------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------------------------


def _closed_form_params(img_size, patch_size, in_chans, embed_dim, depth, mlp_ratio=4.0, qkv_bias=False,
                        mlp_time_embed=False, num_classes=-1, clip_dim=None, num_clip_token=77, conv=True,
                        skip=True, **_):
    """Parameter count from the architecture (docs/conventions.md, "Token order"), not from the module."""
    D, h, n = embed_dim, int(embed_dim * mlp_ratio), depth // 2
    block = 4 * D + 3 * D * D + (3 * D if qkv_bias else 0) + D * D + D + D * h + h + h * D + D
    total = (2 * n + 1) * block + (n * (2 * D * D + D) if skip else 0)
    extras = 1 + (num_classes > 0) + (num_clip_token if clip_dim else 0)
    total += (extras + (img_size // patch_size) ** 2) * D  # pos_embed
    total += D * in_chans * patch_size**2 + D  # patch_embed
    total += 2 * (D * 4 * D) + 4 * D + D if mlp_time_embed else 0
    total += num_classes * D if num_classes > 0 else 0
    total += clip_dim * D + D if clip_dim else 0
    total += 2 * D + D * patch_size**2 * in_chans + patch_size**2 * in_chans  # norm, decoder_pred
    total += in_chans * in_chans * 9 + in_chans if conv else 0
    return total


_BLOCK_KEYS = """norm1.weight norm1.bias attn.qkv.weight attn.proj.weight attn.proj.bias norm2.weight norm2.bias
mlp.fc1.weight mlp.fc1.bias mlp.fc2.weight mlp.fc2.bias""".split()


def _official_keys(depth: int, text: bool, label: bool = False) -> list[str]:
    """The official key list, in order (docs/conventions.md, "Official checkpoints")."""
    keys = ["pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    keys += ["label_emb.weight"] if label else []
    keys += ["context_embed.weight", "context_embed.bias"] if text else []
    for i in range(depth // 2):
        keys += [f"in_blocks.{i}.{k}" for k in _BLOCK_KEYS]
    keys += [f"mid_block.{k}" for k in _BLOCK_KEYS]
    for i in range(depth // 2):
        keys += [f"out_blocks.{i}.{k}" for k in _BLOCK_KEYS]
        keys += [f"out_blocks.{i}.skip_linear.weight", f"out_blocks.{i}.skip_linear.bias"]
    return keys + ["norm.weight", "norm.bias", "decoder_pred.weight", "decoder_pred.bias", "final_layer.weight",
                   "final_layer.bias"]


def _official_shapes(key, D, C, p, n_tokens, clip_dim=None, hidden=None):
    """Shape of an official key (docs/conventions.md, "Official checkpoints"), generalised to any width."""
    hidden = hidden or 4 * D
    table = {
        "pos_embed": (1, n_tokens, D), "patch_embed.proj.weight": (D, C, p, p), "patch_embed.proj.bias": (D,),
        "context_embed.weight": (D, clip_dim), "context_embed.bias": (D,), "attn.qkv.weight": (3 * D, D),
        "attn.proj.weight": (D, D), "attn.proj.bias": (D,), "mlp.fc1.weight": (hidden, D), "mlp.fc1.bias": (hidden,),
        "mlp.fc2.weight": (D, hidden), "mlp.fc2.bias": (D,), "skip_linear.weight": (D, 2 * D),
        "skip_linear.bias": (D,), "decoder_pred.weight": (p * p * C, D), "decoder_pred.bias": (p * p * C,),
        "final_layer.weight": (C, C, 3, 3), "final_layer.bias": (C,),
    }
    for suffix, shape in table.items():
        if key == suffix or key.endswith("." + suffix):
            return shape
    assert "norm" in key, key
    return (D,)


def _cog_flags(depth: int, cog: bool) -> tuple[list[bool], bool, list[bool]]:
    """The official rule (docs/conventions.md, "Cog placement"): np and layer_idx != 0 (in), np (mid), np and
    layer_idx != depth//2 - 1 (out)."""
    n = depth // 2
    return [cog and i != 0 for i in range(n)], cog, [cog and i != n - 1 for i in range(n)]


def _official_forward(sd, cfg, x, t, context=None, y=None, cog=None):
    """Functional re-implementation of the official UViT.forward (math attention), from a state dict. `cog`: one
    flag per block in execution order (in, mid, out) for other placements; None is the official rule."""
    D, nh, C = cfg["embed_dim"], cfg["num_heads"], cfg["in_chans"]
    ins, mid, outs = _cog_flags(cfg["depth"], cfg.get("attention") == "cog")
    if cog is not None:
        n = cfg["depth"] // 2
        ins, mid, outs = cog[:n], cog[n], cog[n + 1 :]

    def block(prefix, h, cog, skip=None):
        if skip is not None:
            h = F.linear(torch.cat([h, skip], -1), sd[prefix + "skip_linear.weight"], sd[prefix + "skip_linear.bias"])
        a = F.layer_norm(h, (D,), sd[prefix + "norm1.weight"], sd[prefix + "norm1.bias"])
        qkv = einops.rearrange(F.linear(a, sd[prefix + "attn.qkv.weight"]), "B L (K H D) -> K B H L D", K=3, H=nh)
        p = qkv[0] @ qkv[1].transpose(-2, -1) * (D // nh) ** -0.5
        w = torch.sign(p) * torch.softmax(p.abs(), -1) if cog else p.softmax(-1)
        a = einops.rearrange(w @ qkv[2], "B H L D -> B L (H D)")
        h = h + F.linear(a, sd[prefix + "attn.proj.weight"], sd[prefix + "attn.proj.bias"])
        m = F.layer_norm(h, (D,), sd[prefix + "norm2.weight"], sd[prefix + "norm2.bias"])
        m = F.gelu(F.linear(m, sd[prefix + "mlp.fc1.weight"], sd[prefix + "mlp.fc1.bias"]))
        return h + F.linear(m, sd[prefix + "mlp.fc2.weight"], sd[prefix + "mlp.fc2.bias"])

    h = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=cfg["patch_size"])
    h = einops.rearrange(h, "B D h w -> B (h w) D")
    half = D // 2
    # The official sinusoid is computed in float32 whatever the model dtype.
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs
    time_token = torch.cat([torch.cos(args), torch.sin(args)], -1).to(h.dtype)[:, None]
    if y is not None:
        tokens = [sd["label_emb.weight"][y][:, None], time_token, h]
    elif context is not None:
        tokens = [time_token, F.linear(context, sd["context_embed.weight"], sd["context_embed.bias"]), h]
    else:
        tokens = [time_token, h]
    extras = sum(tok.shape[1] for tok in tokens[:-1])
    h = torch.cat(tokens, 1) + sd["pos_embed"]
    skips = []
    for i, cog in enumerate(ins):
        h = block(f"in_blocks.{i}.", h, cog)
        skips.append(h)
    h = block("mid_block.", h, mid)
    for i, cog in enumerate(outs):
        h = block(f"out_blocks.{i}.", h, cog, skips.pop())
    h = F.layer_norm(h, (D,), sd["norm.weight"], sd["norm.bias"])
    h = F.linear(h, sd["decoder_pred.weight"], sd["decoder_pred.bias"])[:, extras:]
    p = cfg["patch_size"]
    h = einops.rearrange(h, "B (h w) (p1 p2 C) -> B C (h p1) (w p2)", h=cfg["img_size"] // p, p1=p, p2=p, C=C)
    return F.conv2d(h, sd["final_layer.weight"], sd["final_layer.bias"], padding=1)


def _inputs(cfg, B=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cfg["in_chans"], cfg["img_size"], cfg["img_size"], generator=g, dtype=dtype)
    t = torch.tensor([3.5, 812.0][:B], dtype=dtype)
    ctx = y = None
    if cfg.get("clip_dim"):
        ctx = torch.randn(B, cfg["num_clip_token"], cfg["clip_dim"], generator=g, dtype=dtype)
    if cfg.get("num_classes", -1) > 0:
        y = torch.randint(0, cfg["num_classes"], (B,), generator=g)
    return x, t, ctx, y


def _randomize(model: UViTModel, seed: int = 0) -> UViTModel:
    """Non-trivial weights everywhere (the official init zeroes biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return model.eval()


TINY = ["tiny-cifar", "tiny-t2i", "tiny-class"]


# --------------------------------------------------------------------------------------------------------------
# Structure: parameter counts, keys, shapes, Cog placement
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [("s2-cifar10", 44_255_328), ("s2-mscoco", 44_692_644), ("s2-deep-mscoco", 58_345_636)],
)
@pytest.mark.parametrize("prefix", ["uvit", "uvic"])
def test_small_presets_exact_parameter_counts(prefix, name, expected):
    with torch.device("meta"):
        model = build_preset(f"{prefix}-{name}")
    assert sum(p.numel() for p in model.parameters()) == expected  # docs/conventions.md, "Official checkpoints"


@pytest.mark.parametrize(
    "name, millions",
    [("m4-imagenet64", 131), ("l4-imagenet64", 287), ("l2-imagenet256", 287), ("h2-imagenet256", 501),
     ("l4-imagenet512", 287), ("h4-imagenet512", 501)],
)
def test_large_presets_match_paper_table(name, millions):
    with torch.device("meta"):
        model = build_preset(f"uvic-{name}")
    # U-ViT paper Table 1 (rounded to millions).
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == millions


@pytest.mark.parametrize("name", sorted(UVIT_PRESETS))
def test_every_preset_matches_closed_form_count(name):
    with torch.device("meta"):
        model = build_preset(name)
    assert sum(p.numel() for p in model.parameters()) == _closed_form_params(**UVIT_PRESETS[name])
    assert model.config.attention == ("cog" if name.startswith("uvic-") else "softmax")


@pytest.mark.parametrize(
    "name, depth, text, C, n_tokens, n_keys",
    [("s2-cifar10", 12, False, 3, 257, 164), ("s2-mscoco", 12, True, 4, 334, 166),
     ("s2-deep-mscoco", 16, True, 4, 334, 214)],
)
@pytest.mark.parametrize("prefix", ["uvit", "uvic"])
def test_official_state_dict_keys_and_shapes(prefix, name, depth, text, C, n_tokens, n_keys):
    with torch.device("meta"):
        model = build_preset(f"{prefix}-{name}")
    sd = model.state_dict()
    expected = _official_keys(depth, text)
    assert len(expected) == n_keys
    assert list(sd) == expected
    for key, value in sd.items():
        assert tuple(value.shape) == _official_shapes(key, 512, C, 2, n_tokens, clip_dim=768), key
    assert list(model.buffers()) == []  # no buffers at all, so nothing extra in the state dict


def test_class_conditional_keys():
    model = build_preset("uvit-tiny-class")
    assert list(model.state_dict()) == _official_keys(4, text=False, label=True)
    assert model.label_emb.weight.shape == (11, 32)


@pytest.mark.parametrize(
    "depth, expected",
    [
        (12, ["in_blocks.1", "in_blocks.2", "in_blocks.3", "in_blocks.4", "in_blocks.5", "mid_block",
              "out_blocks.0", "out_blocks.1", "out_blocks.2", "out_blocks.3", "out_blocks.4"]),
        (16, [f"in_blocks.{i}" for i in range(1, 8)] + ["mid_block"] + [f"out_blocks.{i}" for i in range(7)]),
    ],
)
def test_which_blocks_are_cog(depth, expected):
    with torch.device("meta"):
        uvic = build_preset("uvic-s2-mscoco", depth=depth)
        uvit = build_preset("uvit-s2-mscoco", depth=depth)
    assert uvic.cog_block_names() == expected  # "Cog placement": 11 of 13 / 15 of 17
    assert uvit.cog_block_names() == []
    assert [uvic.in_blocks[0].attn.attention, uvic.out_blocks[-1].attn.attention, uvic.mid_block.attn.attention] == [
        "softmax", "softmax", "cog"]


# A depth-4 model's blocks in execution order.
_TINY_BLOCKS = ["in_blocks.0", "in_blocks.1", "mid_block", "out_blocks.0", "out_blocks.1"]


@pytest.mark.parametrize(
    "first, last, cog",
    [
        (1, 1, [False, True, True, True, False]),  # U-ViC, the default
        (0, 0, [True, True, True, True, True]),  # Cog everywhere
        (1, 0, [False, True, True, True, True]),  # the paper's ablation: softmax in the first block only
        (2, 1, [False, False, True, True, False]),  # counted through in_blocks, mid_block, out_blocks
        (0, 3, [True, True, False, False, False]),
    ],
)
def test_placement_picks_the_cog_blocks(first, last, cog):
    """keep_softmax_first / keep_softmax_last choose the blocks that run Cog, and the forward is the functional
    reference with exactly those blocks on Cog."""
    cfg = dict(UVIT_PRESETS["uvic-tiny-t2i"])
    model = build_preset("uvic-tiny-t2i", keep_softmax_first=first, keep_softmax_last=last,
                         attention_backend="reference")
    model = _randomize(model).double()
    assert model.cog_block_names() == [name for name, c in zip(_TINY_BLOCKS, cog) if c]
    assert (model.config.keep_softmax_first, model.config.keep_softmax_last) == (first, last)
    x, t, ctx, _ = _inputs(cfg)
    with torch.no_grad():
        out = model(x, t, encoder_hidden_states=ctx).sample
        ref = _official_forward(model.state_dict(), cfg, x, t, context=ctx, cog=cog)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    # The softmax model ignores the placement: every block is softmax.
    assert build_preset("uvit-tiny-t2i", keep_softmax_first=first, keep_softmax_last=last).cog_block_names() == []


def test_placement_is_an_ordinary_config_override():
    """`model.keep_softmax_first=0` in a run config reaches the model; a run config or saved model without the
    keys (written before they existed) is U-ViC's 1 and 1."""
    cfg = load_config(None, ["model.keep_softmax_first=0", "model.keep_softmax_last=0"])
    with torch.device("meta"):
        model = UViTModel(**dataclasses.asdict(cfg.model))
    assert len(model.cog_block_names()) == 13  # S/2, depth 12: every block
    old = cfg.to_dict()
    del old["model"]["keep_softmax_first"], old["model"]["keep_softmax_last"]
    assert (config_from_dict(old).model.keep_softmax_first, config_from_dict(old).model.keep_softmax_last) == (1, 1)
    with pytest.raises(ConfigError, match="model.keep_softmax_last: must be >= 0"):
        load_config(None, ["model.keep_softmax_last=-1"])


def test_saved_model_without_placement_keys_loads_as_uvic(tmp_path):
    model = _randomize(build_preset("uvic-tiny-class"))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["keep_softmax_first"], saved["keep_softmax_last"]) == (1, 1)
    del saved["keep_softmax_first"], saved["keep_softmax_last"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = UViTModel.from_pretrained(tmp_path)
    assert loaded.cog_block_names() == ["in_blocks.1", "mid_block", "out_blocks.0"]
    x, t, _, y = _inputs(dict(UVIT_PRESETS["uvic-tiny-class"]), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x, t, class_labels=y).sample, model.eval()(x, t, class_labels=y).sample)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_softmax_first": -1}, r"keep_softmax_first must be an int >= 0, got -1"),
        ({"keep_softmax_last": True}, r"keep_softmax_last must be an int >= 0, got True"),
        ({"keep_softmax_last": 1.0}, r"keep_softmax_last must be an int >= 0, got 1.0"),
        ({"keep_softmax_first": None}, r"keep_softmax_first must be an int >= 0, got None"),
        ({"keep_softmax_first": 3, "keep_softmax_last": 3}, r"6 layers, more than the 5 there are: the two ends"),
        ({"keep_softmax_first": 6, "keep_softmax_last": 0, "attention": "softmax"}, "the two ends would overlap"),
    ],
)
def test_bad_placement_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_preset("uvic-tiny-cifar", **kwargs)


def test_placement_without_cog_blocks_warns():
    with pytest.warns(UserWarning, match="keeps all 5 layers on softmax, so no layer runs Cog attention"):
        model = build_preset("uvic-tiny-cifar", keep_softmax_first=3, keep_softmax_last=2)
    assert model.cog_block_names() == []


def test_cog_flag_changes_the_computation():
    # Same weights, softmax vs Cog: outputs differ (the weights cannot tell them apart, the config must).
    uvit = _randomize(build_preset("uvit-tiny-cifar"))
    uvic = build_preset("uvic-tiny-cifar").eval()
    uvic.load_state_dict(uvit.state_dict(), strict=True)
    x, t, _, _ = _inputs(dict(UVIT_PRESETS["uvit-tiny-cifar"]), dtype=torch.float32)
    with torch.no_grad():
        assert (uvit(x, t).sample - uvic(x, t).sample).abs().max() > 1e-3


def test_demo_preset_is_the_model_of_the_demo_config():
    import dataclasses
    from pathlib import Path

    from uvic.config import UViTConfig, load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_digits.yaml").model
    assert cfg == UViTConfig(**UVIT_PRESETS["uvic-demo"])  # the config's model is exactly the preset
    with torch.device("meta"):
        model = build_preset("uvic-demo")
    assert sum(p.numel() for p in model.parameters()) == _closed_form_params(**dataclasses.asdict(cfg))


def test_the_compare_config_sees_17_tokens_in_5_blocks_with_uvics_placement():
    """configs/compare_digits.yaml's comment: 2x2 patches of the 8x8 digits (16 + the time token), 5 blocks with
    Cog between a softmax first and last, 0.27M parameters."""
    import dataclasses
    from pathlib import Path

    from uvic.config import load_config
    from uvic.models.layers import Attention

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "compare_digits.yaml").model
    model = UViTModel(**dataclasses.asdict(cfg))
    assert model.pos_embed.shape[1] == (8 // 2) ** 2 + 1 == 17
    assert [m.attention for m in model.modules() if isinstance(m, Attention)] == ["softmax", "cog", "cog", "cog",
                                                                                   "softmax"]
    n = sum(p.numel() for p in model.parameters())
    assert n == _closed_form_params(**dataclasses.asdict(cfg)) and round(n / 1e6, 2) == 0.27


def test_official_init_statistics():
    torch.manual_seed(0)
    model = build_preset("uvit-demo")
    assert model.pos_embed.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.in_blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(model.in_blocks[0].mlp.fc1.bias == 0) and torch.all(model.decoder_pred.bias == 0)
    assert torch.all(model.norm.weight == 1) and torch.all(model.norm.bias == 0)


# --------------------------------------------------------------------------------------------------------------
# Forward: against the functional reference, token order, backends
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", TINY)
@pytest.mark.parametrize("prefix", ["uvit", "uvic"])
def test_forward_matches_functional_official_reference(prefix, base):
    cfg = dict(UVIT_PRESETS[f"{prefix}-{base}"])
    model = _randomize(build_preset(f"{prefix}-{base}", attention_backend="reference").double())
    x, t, ctx, y = _inputs(cfg)
    with torch.no_grad():
        out = model(x, t, encoder_hidden_states=ctx, class_labels=y)
        ref = _official_forward(model.state_dict(), cfg, x, t, context=ctx, y=y)
    assert out.sample.shape == x.shape
    torch.testing.assert_close(out.sample, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("base", TINY)
def test_token_order_per_mode(base):
    # The first block's input is [label, time, patches] / [time, context, patches] / [time, patches] + pos_embed.
    model = _randomize(build_preset(f"uvic-{base}").double())
    cfg = model.config
    x, t, ctx, y = _inputs(dict(UVIT_PRESETS[f"uvic-{base}"]))
    seen = {}
    handle = model.in_blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(x, t, encoder_hidden_states=ctx, class_labels=y)
        handle.remove()
        tokens = seen["x"] - model.pos_embed
        patches = einops.rearrange(model.patch_embed.proj(x), "B D h w -> B (h w) D")
        half = cfg.embed_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs
        time_tok = torch.cat([torch.cos(args), torch.sin(args)], -1).double()
        if base == "tiny-class":
            expected = [model.label_emb.weight[y], time_tok]
        elif base == "tiny-t2i":
            ctx_tok = ctx @ model.context_embed.weight.T + model.context_embed.bias
            expected = [time_tok] + [ctx_tok[:, i] for i in range(cfg.num_clip_token)]
        else:
            expected = [time_tok]
    assert tokens.shape[1] == len(expected) + patches.shape[1] == model.pos_embed.shape[1]
    for i, tok in enumerate(expected):
        torch.testing.assert_close(tokens[:, i], tok, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tokens[:, len(expected) :], patches, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("base", TINY)
@pytest.mark.parametrize("prefix", ["uvit", "uvic"])
def test_backends_torch_and_reference_agree(prefix, base):
    cfg = dict(UVIT_PRESETS[f"{prefix}-{base}"])
    a = _randomize(build_preset(f"{prefix}-{base}", attention_backend="torch"))
    b = build_preset(f"{prefix}-{base}", attention_backend="reference").eval()
    b.load_state_dict(a.state_dict())
    x, t, ctx, y = _inputs(cfg, dtype=torch.float32)
    with torch.no_grad():
        out_a = a(x, t, encoder_hidden_states=ctx, class_labels=y).sample
        out_b = b(x, t, encoder_hidden_states=ctx, class_labels=y).sample
    torch.testing.assert_close(out_a, out_b, rtol=1e-4, atol=1e-5)


def test_timestep_scalar_broadcasts_and_tuple_output():
    model = _randomize(build_preset("uvic-tiny-t2i"))
    x, _, ctx, _ = _inputs(dict(UVIT_PRESETS["uvic-tiny-t2i"]), dtype=torch.float32)
    with torch.no_grad():
        a = model(x, 250.5, encoder_hidden_states=ctx).sample
        b = model(x, torch.tensor([250.5, 250.5]), encoder_hidden_states=ctx).sample
        c = model(x, torch.tensor(250.5), encoder_hidden_states=ctx, return_dict=False)
        d = model(x, 250, encoder_hidden_states=ctx).sample
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert isinstance(c, tuple) and len(c) == 1
    torch.testing.assert_close(c[0], a, rtol=0, atol=0)
    assert (d - a).abs().max() > 0  # 250 and 250.5 embed differently: the value is used as given


# --------------------------------------------------------------------------------------------------------------
# Training features, save / load, compile
# --------------------------------------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = build_preset("uvic-tiny-t2i", attention_backend="torch")
    x, t, ctx, _ = _inputs(dict(UVIT_PRESETS["uvic-tiny-t2i"]), dtype=torch.float32)

    def grads():
        model.zero_grad()
        model(x, t, encoder_hidden_states=ctx).sample.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    calls = []

    def counting_checkpoint(module, *args):
        calls.append(module)
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=counting_checkpoint)
    checkpointed = grads()
    assert len(calls) == 5  # every block (2 in, mid, 2 out) went through checkpointing
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    # No checkpointing under no_grad (nothing to save memory for).
    calls.clear()
    with torch.no_grad():
        model(x, t, encoder_hidden_states=ctx)
    assert calls == []


def test_save_and_load_pretrained_round_trip(tmp_path):
    model = _randomize(build_preset("uvic-tiny-class"))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").is_file()
    loaded = UViTModel.from_pretrained(tmp_path).eval()
    assert loaded.config.attention == "cog" and loaded.config.num_classes == 11
    assert loaded.cog_block_names() == model.cog_block_names()
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    x, t, _, y = _inputs(dict(UVIT_PRESETS["uvic-tiny-class"]), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t, class_labels=y).sample, model(x, t, class_labels=y).sample)
    # The backend is a config value that can be overridden at load time.
    ref = UViTModel.from_pretrained(tmp_path, attention_backend="reference")
    assert ref.config.attention_backend == "reference" and ref.mid_block.attn.backend == "reference"


@pytest.mark.parametrize("base", TINY)
def test_bf16_autocast_forward_backward(base):
    # Mixed precision comes from autocast (accelerate); Cog and softmax blocks must run under it.
    cfg = dict(UVIT_PRESETS[f"uvic-{base}"])
    model = _randomize(build_preset(f"uvic-{base}", attention_backend="torch"))
    x, t, ctx, y = _inputs(cfg, dtype=torch.float32)
    with torch.no_grad():
        ref = model(x, t, encoder_hidden_states=ctx, class_labels=y).sample
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, encoder_hidden_states=ctx, class_labels=y).sample
    out.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # bf16 has an 8-bit mantissa: agreement to a few percent of the output scale.
    assert (out.float() - ref).abs().max() < 0.03 * ref.abs().max()


@pytest.mark.slow
def test_torch_compile_cpu():
    pytest.importorskip("torch._inductor")
    model = _randomize(build_preset("uvic-tiny-class", depth=2))  # softmax, Cog, softmax blocks
    x, t, _, y = _inputs(dict(UVIT_PRESETS["uvic-tiny-class"]), dtype=torch.float32)
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t, class_labels=y).sample, model(x, t, class_labels=y).sample,
                                   rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    t2i = build_preset("uvic-tiny-t2i")
    cls = build_preset("uvit-tiny-class")
    unc = build_preset("uvit-tiny-cifar")
    ctx = torch.randn(2, 5, 16)
    cases = [
        (lambda: unc(torch.randn(2, 3, 16, 16), 1), "hidden_states must have shape"),  # wrong image size
        (lambda: unc(torch.randn(2, 1, 32, 32), 1), "hidden_states must have shape"),  # wrong channel count
        (lambda: unc(torch.randn(3, 32, 32), 1), "hidden_states must have shape"),
        (lambda: t2i(torch.randn(2, 4, 8, 8), 1), "encoder_hidden_states is required"),
        (lambda: t2i(torch.randn(2, 4, 8, 8), 1, torch.randn(2, 4, 16)), "must be a tensor of shape"),
        (lambda: unc(torch.randn(2, 3, 32, 32), 1, ctx), "no text conditioning"),
        (lambda: cls(torch.randn(2, 3, 8, 8), 1), "class_labels is required"),
        (lambda: cls(torch.randn(2, 3, 8, 8), 1, class_labels=torch.tensor([0, 11])), r"lie in \[0, 11\)"),
        (lambda: cls(torch.randn(2, 3, 8, 8), 1, class_labels=torch.tensor([-1, 0])), r"lie in \[0, 11\)"),
        (lambda: cls(torch.randn(2, 3, 8, 8), 1, class_labels=torch.tensor([0.0, 1.0])), "integer tensor"),
        (lambda: cls(torch.randn(2, 3, 8, 8), 1, class_labels=[0, 1]), "integer tensor"),
        (lambda: cls(torch.randn(2, 3, 8, 8), 1, class_labels=torch.tensor([0, 1, 2])), "integer tensor"),
        (lambda: unc(torch.randn(2, 3, 32, 32), 1, class_labels=torch.tensor([0, 1])), "not class-conditional"),
        (lambda: unc(torch.randn(2, 3, 32, 32), torch.ones(3)), "timestep must be a scalar"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"attention": "linear"}, "attention must be"), ({"attention_backend": "flash"}, "attention_backend"),
     ({"img_size": 30, "patch_size": 4}, "divisible"), ({"num_classes": 10, "clip_dim": 8}, "not both")],
)
def test_bad_config_raises(kwargs, match):
    base = {"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2}
    with pytest.raises(ValueError, match=match):
        UViTModel(**{**base, **kwargs})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        build_preset("uvit-xl-nowhere")
    assert build_preset("tiny-cifar").config.attention == "softmax"
    assert build_preset("tiny-cifar", attention="cog").cog_block_names() == [
        "in_blocks.1",
        "mid_block",
        "out_blocks.0",
    ]


# --------------------------------------------------------------------------------------------------------------
# Official config + checkpoint loader
# --------------------------------------------------------------------------------------------------------------

# A tiny version of CogAttn U-ViC/configs/mscoco_uvit_small_np_0_last.py's nnet section.
_TINY_OFFICIAL_T2I = {"name": "uvit_t2i_np", "img_size": 8, "in_chans": 4, "patch_size": 2, "embed_dim": 32,
                      "depth": 4, "num_heads": 2, "mlp_ratio": 4, "qkv_bias": False, "mlp_time_embed": False,
                      "clip_dim": 16, "num_clip_token": 5, "np": True}


def _synthetic_official_checkpoint(path, cfg):
    """A random state dict built from the official key list and shapes alone (not from UViTModel)."""
    D, C, p = cfg["embed_dim"], cfg["in_chans"], cfg["patch_size"]
    n_tokens = 1 + cfg["num_clip_token"] + (cfg["img_size"] // p) ** 2
    g = torch.Generator().manual_seed(7)
    sd = {k: torch.randn(_official_shapes(k, D, C, p, n_tokens, clip_dim=cfg["clip_dim"]), generator=g) * 0.2
          for k in _official_keys(cfg["depth"], text=True)}
    torch.save(sd, path)
    return sd


def test_uvit_from_official_loads_synthetic_checkpoint(tmp_path):
    path = tmp_path / "nnet_ema.pth"
    sd = _synthetic_official_checkpoint(path, _TINY_OFFICIAL_T2I)
    model = uvit_from_official(_TINY_OFFICIAL_T2I, path, attention_backend="reference").eval()
    assert model.config.attention == "cog"  # np=True
    assert model.cog_block_names() == ["in_blocks.1", "mid_block", "out_blocks.0"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k])
    cfg = {k: v for k, v in _TINY_OFFICIAL_T2I.items() if k not in ("name", "np")} | {"attention": "cog"}
    x, t, ctx, _ = _inputs(cfg, dtype=torch.float32)
    with torch.no_grad():
        out = model(x, t, encoder_hidden_states=ctx).sample
        ref = _official_forward(sd, cfg, x, t, context=ctx)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_uvit_from_official_names_and_defaults():
    cifar = {"name": "uvit", "img_size": 32, "patch_size": 2, "embed_dim": 512, "depth": 12, "num_heads": 8,
             "mlp_ratio": 4, "qkv_bias": False, "mlp_time_embed": False, "num_classes": -1}
    with torch.device("meta"):
        m = uvit_from_official(cifar)
        assert sum(p.numel() for p in m.parameters()) == 44_255_328
        coco = {k: v for k, v in cifar.items() if k != "num_classes"} | {"name": "uvit_t2i", "in_chans": 4}
        m = uvit_from_official(coco)  # clip_dim 768 and 77 tokens are libs/uvit_t2i.py's defaults
        assert (m.config.clip_dim, m.config.num_clip_token, m.config.attention) == (768, 77, "softmax")
        assert sum(p.numel() for p in m.parameters()) == 44_692_644
        m = uvit_from_official({**coco, "name": "uvit_t2i_np", "np": True, "use_checkpoint": True})
        assert m.config.attention == "cog" and m.gradient_checkpointing


@pytest.mark.parametrize(
    "change, error, match",
    [({"name": "dit"}, ValueError, "unknown official nnet name"),
     ({"norm_eps": 1e-6}, ValueError, "unknown keys"),
     ({"qk_scale": 0.1}, ValueError, "qk_scale"),
     ({"num_classes": 10}, ValueError, "no class conditioning"),
     ({"depth": 6}, ValueError, "does not match"),
     ({"embed_dim": 64}, ValueError, "does not match")],
)
def test_uvit_from_official_errors(tmp_path, change, error, match):
    path = tmp_path / "nnet_ema.pth"
    _synthetic_official_checkpoint(path, _TINY_OFFICIAL_T2I)
    with pytest.raises(error, match=match):
        uvit_from_official({**_TINY_OFFICIAL_T2I, **change}, path)


def test_uvit_from_official_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nnet_ema.pth"):
        uvit_from_official(_TINY_OFFICIAL_T2I, tmp_path / "nnet_ema.pth")
