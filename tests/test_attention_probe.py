"""The attention probe: the share of negative attention weight per block, against the paper's formula
`sign(p) * softmax(|p|)` computed here by hand in numpy; block names in execution order; nothing left behind."""

import numpy as np
import pytest
import torch
from torch import nn

import uvic.attention_probe as probe_module
from uvic.attention import attention_op, cog_attention, softmax_attention
from uvic.attention_probe import probe_attention
from uvic.models import CogformerConfig, CogformerForCausalLM, UViTModel


def _share(q, k, *, causal=False, keep_keys=None, kind="cog"):
    """The probe's definition, by hand: per query row, the negative weight mass over the whole |weight| mass, with
    weights sign(p) * softmax(|p|) (softmax(p) for softmax) over the kept keys; the mean over rows, heads, items."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, nh, Lq, hd = q.shape
    shares = []
    for b in range(B):
        for h in range(nh):
            for i in range(Lq):
                keys = [j for j in range(k.shape[2]) if (not causal or j <= i)
                        and (keep_keys is None or keep_keys[b][j])]
                if not keys:
                    continue
                p = np.array([q[b, h, i] @ k[b, h, j] / np.sqrt(hd) for j in keys])
                if kind == "cog":
                    w = np.sign(p) * np.exp(np.abs(p)) / np.exp(np.abs(p)).sum()
                else:
                    w = np.exp(p) / np.exp(p).sum()
                shares.append(-w[w < 0].sum() / np.abs(w).sum())
    return float(np.mean(shares))


class _Layer(nn.Module):
    """Calls the op of `kind` on the q, k, v it is given (a stand-in for a model's attention layer)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, **kwargs):
        return attention_op(self.kind)(q, k, v, **kwargs)


class _Block(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.attn = _Layer(kind)

    def forward(self, q, k, v, **kwargs):
        return self.attn(q, k, v, **kwargs)


class _Toy(nn.Module):
    """blocks.0: cog, blocks.1: softmax, blocks.2: cog; each sees the same q, k, v."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block("cog"), _Block("softmax"), _Block("cog")])

    def forward(self, q, k, v, **kwargs):
        return [block(q, k, v, **kwargs) for block in self.blocks]


def test_a_hand_computed_case():
    # One query, three keys, hd = 1: p = q k / 1 = (2, -1, 0.5). Weights sign(p) softmax(|p|):
    # e^2, e^1, e^0.5 over their sum; the negative one is key 1: share = e / (e^2 + e + e^0.5).
    q = torch.tensor([[[[1.0]]]])
    k = torch.tensor([[[[2.0], [-1.0], [0.5]]]])
    model = _Toy()
    with probe_attention(model) as probe:
        model(q, k, k)
    e = np.exp
    assert probe.negative_shares() == pytest.approx({"blocks.0": e(1) / (e(2) + e(1) + e(0.5)), "blocks.1": 0.0,
                                                     "blocks.2": e(1) / (e(2) + e(1) + e(0.5))}, rel=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_shares_match_the_formula_with_masks_rows_heads_and_items(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) * 2 for _ in range(3))
    keep = torch.tensor([[True, True, False, True, True], [False, True, True, True, False]])
    model = _Toy()
    with probe_attention(model) as probe:
        outputs = model(q, k, v, causal=causal, key_padding_mask=keep)
    shares = probe.negative_shares()
    # Rows with no kept key (causal row 0 of item 1: key 0 is padding) are left out, as the hand version does.
    want = _share(q, k, causal=causal, keep_keys=keep.tolist())
    assert list(shares) == ["blocks.0", "blocks.1", "blocks.2"]
    assert shares["blocks.0"] == pytest.approx(want, rel=1e-12) and shares["blocks.2"] == shares["blocks.0"]
    assert shares["blocks.1"] == 0.0 and 0.1 < want < 0.9
    # The forward pass is the op's own.
    torch.testing.assert_close(outputs[0], cog_attention(q, k, v, causal=causal, key_padding_mask=keep))
    torch.testing.assert_close(outputs[1], softmax_attention(q, k, v, causal=causal, key_padding_mask=keep))


def test_long_calls_are_done_in_slices_with_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 4, 6, 8, generator=g), torch.randn(3, 4, 7, 8, generator=g)
    model = _Toy()
    with probe_attention(model) as probe:
        model(q, k, k)
    whole = probe.negative_shares()
    for chunk in (1, 42, 100):  # one row of scores at a time, a head, a few heads
        monkeypatch.setattr(probe_module, "PROBE_CHUNK_SCORES", chunk)
        with probe_attention(model) as probe:
            model(q, k, k)
        assert probe.negative_shares() == pytest.approx(whole, rel=1e-12)


def test_uvit_blocks_in_execution_order_with_the_placement_and_the_formula():
    torch.manual_seed(0)
    model = UViTModel(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=4, num_heads=2,
                      attention="cog").eval()
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([10.0, 500.0])
    inputs = {}
    hook = model.in_blocks[1].attn.register_forward_pre_hook(lambda m, args: inputs.setdefault("x", args[0]))
    with torch.no_grad(), probe_attention(model) as probe:
        model(x, t)
    hook.remove()
    shares = probe.negative_shares()
    assert list(shares) == ["in_blocks.0", "in_blocks.1", "mid_block", "out_blocks.0", "out_blocks.1"]
    assert shares["in_blocks.0"] == shares["out_blocks.1"] == 0.0  # U-ViC keeps softmax in the first and last
    assert all(0 < shares[b] < 1 for b in ("in_blocks.1", "mid_block", "out_blocks.0"))
    # in_blocks.1 from its own input: q, k from the fused qkv projection (rows q | k | v, heads contiguous).
    qkv = (inputs["x"] @ model.in_blocks[1].attn.qkv.weight.detach().T).reshape(2, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
    assert shares["in_blocks.1"] == pytest.approx(_share(qkv[0], qkv[1]), rel=1e-9)


def test_cogformer_layers_and_softmax_everywhere():
    cfg = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 2, "max_position_embeddings": 16, "keep_softmax_first": 1,
           "keep_softmax_last": 1}
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    for attention in ("cog", "softmax"):
        torch.manual_seed(0)
        model = CogformerForCausalLM(CogformerConfig(**cfg, attention=attention)).eval()
        with torch.no_grad(), probe_attention(model) as probe:
            model(input_ids=ids, use_cache=False)
        shares = probe.negative_shares()
        assert list(shares) == [f"model.layers.{i}" for i in range(4)]
        cog = [name for name, share in shares.items() if share > 0]
        assert cog == (["model.layers.1", "model.layers.2"] if attention == "cog" else [])


def test_nothing_is_left_behind_and_probes_do_not_nest():
    model = _Toy()
    q = torch.randn(1, 1, 2, 4)
    assert attention_op("cog") is cog_attention and attention_op("softmax") is softmax_attention
    with pytest.raises(RuntimeError, match="boom"), probe_attention(model):
        with pytest.raises(RuntimeError, match="do not nest"), probe_attention(model):
            pass
        raise RuntimeError("boom")
    # The op is the plain one again, and no module keeps a hook.
    assert attention_op("cog") is cog_attention
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    # Calls from outside the probed model are not recorded.
    with probe_attention(model) as probe:
        attention_op("cog")(q, q, q)
    assert probe.negative_shares() == {}
