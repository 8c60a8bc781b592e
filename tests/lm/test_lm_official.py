"""The official-checkpoint loader, on a synthetic checkpoint in the official format (no download).

The reference forward below is written from the paper and the official format: (in, out) weight matrices used as
`x @ w`, complex (interleaved-pair) RoPE, SwiGLU as (x @ gw) * silu(x @ pw), and Cog weights sign(p) * softmax(|p|)
in every layer but the first and last ("np"), softmax everywhere for "vanilla".
"""

import math

import pytest
import torch

from uvic.lm.official import cogformer_from_official, convert_official_state_dict


V, D, NH, HD, FF, NL = 50, 32, 4, 8, 48, 4


MAX_SEQ = 64


def official_freqs_cis(theta: float = 10000.0, end: int = 2 * MAX_SEQ) -> torch.Tensor:
    """The official `precompute_freqs_cis(head_dim, 2 * max_seq_length)`: (end, HD/2) complex64,
    entry (m, i) = exp(1j * m * theta^(-2i/HD))."""
    freqs = 1.0 / (theta ** (torch.arange(0, HD, 2)[: HD // 2].float() / HD))
    angles = torch.outer(torch.arange(end), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def official_checkpoint(attn_type: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    state = {"embedding.weight": w(V, D, std=1.0), "norm.weight": 1 + w(D, std=0.1), "output.weight": w(V, D)}
    for i in range(NL):
        p = f"layers.{i}."
        state |= {
            p + "attention.qw": w(D, NH * HD, std=0.5),
            p + "attention.kw": w(D, NH * HD, std=0.5),
            p + "attention.vw": w(D, NH * HD),
            p + "attention.ow": w(NH * HD, D),
            p + "ffn.shared_experts.0.gw": w(D, FF),
            p + "ffn.shared_experts.0.pw": w(D, FF),
            p + "ffn.shared_experts.0.ow": w(FF, D),
            p + "attention_norm.weight": 1 + w(D, std=0.1),
            p + "ffn_norm.weight": 1 + w(D, std=0.1),
        }
    state["freqs_cis"] = official_freqs_cis()  # checked against the model's RoPE, not loaded
    state["shortcut_bar"] = torch.zeros(4095)  # unused buffer the loader must skip
    cfg = {
        "vocab_size": V, "n_layers": NL, "max_seq_length": MAX_SEQ, "dim": D, "n_heads": NH, "head_dim": HD,
        "hidden_dim": FF, "norm_eps": 1e-6, "attn_type": attn_type, "shared_expert_recipe": 1,
    }
    return {"model_cfg": cfg, "model": state}


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def complex_rope(x, L):
    """x: (B, L, nh, hd); rotates consecutive pairs (2i, 2i+1) as complex numbers by angle pos * 10000^(-2i/hd)."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    cis = torch.polar(torch.ones(L, HD // 2, dtype=torch.float64), torch.outer(torch.arange(L, dtype=torch.float64), freqs))
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3)


def reference_forward(ckpt, tokens):
    """Straightforward float64 forward of the official architecture; returns logits (B, L, V)."""
    s = {k: v.double() for k, v in ckpt["model"].items() if not k.startswith(("freqs", "shortcut"))}
    B, L = tokens.shape
    h = s["embedding.weight"][tokens]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    for i in range(NL):
        p = f"layers.{i}."
        x = rms(h, s[p + "attention_norm.weight"])
        q = complex_rope((x @ s[p + "attention.qw"]).view(B, L, NH, HD), L).transpose(1, 2)
        k = complex_rope((x @ s[p + "attention.kw"]).view(B, L, NH, HD), L).transpose(1, 2)
        v = (x @ s[p + "attention.vw"]).view(B, L, NH, HD).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(HD)
        cog = ckpt["model_cfg"]["attn_type"] == "np" and 0 < i < NL - 1
        if cog:
            attn = torch.sign(scores) * torch.softmax(scores.abs().masked_fill(~causal, -math.inf), -1)
        else:
            attn = torch.softmax(scores.masked_fill(~causal, -math.inf), -1)
        h = h + (attn @ v).transpose(1, 2).reshape(B, L, NH * HD) @ s[p + "attention.ow"]
        x = rms(h, s[p + "ffn_norm.weight"])
        e = p + "ffn.shared_experts.0."
        h = h + ((x @ s[e + "gw"]) * torch.nn.functional.silu(x @ s[e + "pw"])) @ s[e + "ow"]
    return rms(h, s["norm.weight"]) @ s["output.weight"].T


@pytest.mark.parametrize("attn_type,attention", [("np", "cog"), ("vanilla", "softmax")])
def test_official_checkpoint_matches_reference_forward(tmp_path, attn_type, attention):
    ckpt = official_checkpoint(attn_type)
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    model = cogformer_from_official(path)
    assert model.config.attention == attention
    expected_types = ["softmax", "cog", "cog", "softmax"] if attn_type == "np" else ["softmax"] * NL
    assert model.config.attention_types() == expected_types
    assert model.config.intermediate_size == FF and model.config.head_dim == HD
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(tokens).logits.double()
    ref = reference_forward(ckpt, tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # The mapping matters: with the RoPE permutation or the gate/up roles undone, the outputs differ.
    assert ref.abs().max() > 0.5


def test_mapping_is_not_trivially_equal_when_rope_is_not_permuted():
    """Guards the test above: loading q/k without the pair permutation gives different logits."""
    ckpt = official_checkpoint("np", seed=3)
    config, state = convert_official_state_dict(ckpt["model_cfg"], ckpt["model"])
    from uvic.models.cogformer import CogformerForCausalLM

    model = CogformerForCausalLM(config).eval()
    for i in range(NL):
        for name, key in (("q_proj", "qw"), ("k_proj", "kw")):
            state[f"model.layers.{i}.self_attn.{name}.weight"] = ckpt["model"][f"layers.{i}.attention.{key}"].t()
    model.load_state_dict(state)
    tokens = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(tokens).logits.double()
    assert (got - reference_forward(ckpt, tokens)).abs().max() > 1e-2


def test_prefixed_keys_are_accepted():
    ckpt = official_checkpoint("np")
    prefixed = {"module." + k: v for k, v in ckpt["model"].items()}
    _, a = convert_official_state_dict(ckpt["model_cfg"], ckpt["model"])
    _, b = convert_official_state_dict(ckpt["model_cfg"], prefixed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="trestad/CogAttn"):
        cogformer_from_official(tmp_path / "missing.pt")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an official Cogformer checkpoint"):
        cogformer_from_official(tmp_path / "other.pt")
    ckpt = official_checkpoint("np")
    with pytest.raises(ValueError, match="unknown official attn_type"):
        convert_official_state_dict({**ckpt["model_cfg"], "attn_type": "diff"}, ckpt["model"])
    extra = {**ckpt["model"], "layers.0.attention.lambda_q": torch.zeros(3)}
    with pytest.raises(ValueError, match="does not know"):
        convert_official_state_dict(ckpt["model_cfg"], extra)
    missing = {k: v for k, v in ckpt["model"].items() if k != "layers.2.attention.vw"}
    with pytest.raises(ValueError, match="lacks 'layers.2.attention.vw'"):
        convert_official_state_dict(ckpt["model_cfg"], missing)


def test_pickled_objects_need_explicit_trust(tmp_path):
    import argparse

    ckpt = official_checkpoint("vanilla")
    ckpt["args"] = argparse.Namespace(lr=1.0)  # a non-tensor object, as training scripts often store
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="trust_pickle=True"):
        cogformer_from_official(tmp_path / "ckpt.pt")
    assert cogformer_from_official(tmp_path / "ckpt.pt", trust_pickle=True).config.attention == "softmax"


@pytest.mark.parametrize("theta", [500000.0, 1000.0])
def test_rope_table_with_another_theta_is_refused(tmp_path, theta):
    ckpt = official_checkpoint("np")
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    assert cogformer_from_official(path).config.rope_theta == 10000.0  # the official table loads
    ckpt["model"]["freqs_cis"] = official_freqs_cis(theta)
    torch.save(ckpt, path)
    message = rf"'freqs_cis' is a RoPE table with theta {theta:g}, but this model uses theta 10000"
    with pytest.raises(ValueError, match=message):
        cogformer_from_official(path)


def test_rope_table_of_another_shape_or_kind_is_refused():
    ckpt = official_checkpoint("vanilla")
    short = {**ckpt["model"], "module.freqs_cis": official_freqs_cis(end=MAX_SEQ)}
    del short["freqs_cis"]
    with pytest.raises(ValueError, match=r"'freqs_cis' has shape \(64, 4\).*shape \(128, 4\)"):
        convert_official_state_dict(ckpt["model_cfg"], short)
    real = {**ckpt["model"], "freqs_cis": torch.view_as_real(official_freqs_cis())}
    with pytest.raises(ValueError, match="'freqs_cis' should be a complex RoPE table"):
        convert_official_state_dict(ckpt["model_cfg"], real)
    # A checkpoint saved without the buffer has nothing to check.
    bare = {k: v for k, v in ckpt["model"].items() if k != "freqs_cis"}
    assert convert_official_state_dict(ckpt["model_cfg"], bare)[0].rope_theta == 10000.0
