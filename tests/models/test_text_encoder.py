"""CLIP text features: official padding, equivalence with transformers' CLIPTextModel, loading, offline errors."""

import json
import warnings

import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from uvic.models.text_encoder import EOT_TOKEN_ID, CLIPTextEncoder, load_clip_state_dict, tokenize


CAPTIONS = [
    "A man riding a wave on top of a surfboard.",
    "",
    "TWO dogs,   playing with a frisbee!! in 3 parks & 12 trees",
    "a very long caption " + "with many many words " * 30,
    "A café in Zürich; people's umbrellas (red/blue).",
]

TINY = {"vocab_size": 49408, "context_length": 77, "width": 32, "heads": 4, "layers": 2}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """transformers' CLIPTokenizer on open_clip's bundled OpenAI BPE (vocab.json + merges.txt written here)."""
    d = tmp_path_factory.mktemp("clip_tok")
    st = SimpleTokenizer()
    rename = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {rename.get(k, k): v for k, v in st.encoder.items()}
    merges = sorted(st.bpe_ranks, key=st.bpe_ranks.get)
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    tok = CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"), model_max_length=77)
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == EOT_TOKEN_ID
    return tok


def test_tokenize_matches_official_hf_call(hf_tokenizer):
    # U-ViT libs/clip.py FrozenCLIPEmbedder's exact tokenizer call.
    ref = hf_tokenizer(CAPTIONS, truncation=True, max_length=77, return_length=True,
                       return_overflowing_tokens=False, padding="max_length", return_tensors="pt")["input_ids"]
    ours = tokenize(CAPTIONS)
    assert ours.shape == (len(CAPTIONS), 77)
    torch.testing.assert_close(ours, ref)
    # The empty caption (the CFG null context): SOT then EOT everywhere.
    assert ours[1, 0] == 49406 and (ours[1, 1:] == EOT_TOKEN_ID).all()
    # Long captions are truncated with EOT last; open_clip's own tokenizer pads with 0 instead.
    assert ours[3, -1] == EOT_TOKEN_ID
    assert (SimpleTokenizer()(CAPTIONS[:1])[0, 20:] == 0).all()


def _copy_to_hf(enc: CLIPTextEncoder) -> CLIPTextModel:
    c = enc.config
    hf = CLIPTextModel(CLIPTextConfig(
        vocab_size=c.vocab_size, hidden_size=c.width, intermediate_size=int(c.width * c.mlp_ratio),
        num_hidden_layers=c.layers, num_attention_heads=c.heads, max_position_embeddings=c.context_length,
        hidden_act="quick_gelu", layer_norm_eps=1e-5)).eval()
    src, w = enc.text.state_dict(), c.width
    dst = {
        "text_model.embeddings.token_embedding.weight": src["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": src["positional_embedding"],
        "text_model.final_layer_norm.weight": src["ln_final.weight"],
        "text_model.final_layer_norm.bias": src["ln_final.bias"],
    }
    for i in range(c.layers):
        a, b = f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}."
        for j, name in enumerate(["q", "k", "v"]):
            dst[b + f"self_attn.{name}_proj.weight"] = src[a + "attn.in_proj_weight"][j * w:(j + 1) * w]
            dst[b + f"self_attn.{name}_proj.bias"] = src[a + "attn.in_proj_bias"][j * w:(j + 1) * w]
        pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
                 "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
        for x, y in pairs.items():
            dst[b + y + ".weight"], dst[b + y + ".bias"] = src[a + x + ".weight"], src[a + x + ".bias"]
    # transformers >= 5 dropped the "text_model." prefix from CLIPTextModel's own state dict.
    if not any(k.startswith("text_model.") for k in hf.state_dict()):
        dst = {k.removeprefix("text_model."): v for k, v in dst.items()}
    missing, unexpected = hf.load_state_dict(dst, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    return hf


def test_features_equal_transformers_clip_text_model(hf_tokenizer):
    torch.manual_seed(0)
    enc = CLIPTextEncoder(**TINY).eval()
    hf = _copy_to_hf(enc)
    ids = hf_tokenizer(CAPTIONS, truncation=True, max_length=77, padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(input_ids=ids).last_hidden_state
        ours = enc.encode_text(CAPTIONS)
        zero_padded = enc(SimpleTokenizer()(CAPTIONS))
    assert ours.shape == (len(CAPTIONS), 77, 32)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    # Padding with 0 (open_clip's default) gives different features after EOT: the pad id matters.
    assert (zero_padded[0, 20:] - ref[0, 20:]).abs().max() > 1e-2
    torch.testing.assert_close(zero_padded[0, :12], ref[0, :12], atol=2e-5, rtol=1e-4)


def test_loads_text_tower_from_full_open_clip_state_dict():
    from open_clip.model import CLIP

    torch.manual_seed(0)
    clip = CLIP(embed_dim=16, vision_cfg={"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
                text_cfg={"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
                quick_gelu=True).eval()
    enc = CLIPTextEncoder(**TINY).eval()
    enc.load_text_state_dict(clip.state_dict())
    ids = tokenize(CAPTIONS[:2])
    with torch.no_grad():
        tokens = enc(ids)
        pooled = tokens[torch.arange(2), ids.argmax(dim=-1)] @ clip.text_projection
        torch.testing.assert_close(pooled, clip.encode_text(ids), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="lacks text-tower keys"):
        enc.load_text_state_dict({"visual.proj": torch.zeros(1)})


def test_loads_openai_torchscript_archive(tmp_path):
    """OpenAI distributes ViT-L-14.pt as TorchScript; a traced module with the same parameter names stands in."""
    torch.manual_seed(0)
    src = CLIPTextEncoder(**TINY).eval()

    class Jit(torch.nn.Module):
        def __init__(self, t):
            super().__init__()
            self.token_embedding, self.positional_embedding = t.token_embedding, t.positional_embedding
            self.transformer, self.ln_final = t.transformer, t.ln_final

        def forward(self, x):
            return self.ln_final(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated in recent torch
        torch.jit.trace(Jit(src.text), torch.zeros(1, 32)).save(str(tmp_path / "ViT-L-14.pt"))
    dst = CLIPTextEncoder(**TINY).eval()
    with pytest.raises(ValueError, match="TorchScript archive, which is not loaded"):  # it holds code
        load_clip_state_dict(tmp_path / "ViT-L-14.pt")
    dst.load_text_state_dict(load_clip_state_dict(tmp_path / "ViT-L-14.pt", trust_torchscript=True))
    with torch.no_grad():
        torch.testing.assert_close(dst.encode_text(CAPTIONS[:2]), src.encode_text(CAPTIONS[:2]))


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    enc = CLIPTextEncoder(**TINY).eval()
    enc.save_pretrained(tmp_path / "te")
    back = CLIPTextEncoder.from_pretrained(tmp_path / "te").eval()
    with torch.no_grad():
        torch.testing.assert_close(back.encode_text(CAPTIONS[:2]), enc.encode_text(CAPTIONS[:2]))


def test_from_open_clip_tag_path(tmp_path, monkeypatch):
    """The tag path: open_clip resolves the file (patched to a tiny full-CLIP state dict) and the config sizes."""
    import open_clip
    from open_clip.model import CLIP

    torch.manual_seed(0)
    text_cfg = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2}
    clip = CLIP(embed_dim=16, vision_cfg={"image_size": 16, "patch_size": 8, "width": 32, "layers": 1,
                                          "head_width": 16}, text_cfg=text_cfg, quick_gelu=True).eval()
    torch.save(clip.state_dict(), tmp_path / "open_clip_pytorch_model.bin")
    monkeypatch.setattr(open_clip, "get_model_config", lambda name: {"embed_dim": 16, "text_cfg": text_cfg})
    monkeypatch.setattr(open_clip, "download_pretrained", lambda cfg, cache_dir=None: str(tmp_path / "open_clip_pytorch_model.bin"))
    enc = CLIPTextEncoder.from_open_clip("openai")
    assert enc.config.quick_gelu is True and enc.config.width == 32 and not enc.training
    ids = tokenize(CAPTIONS[:2])
    with torch.no_grad():
        pooled = enc(ids)[torch.arange(2), ids.argmax(dim=-1)] @ clip.text_projection
        torch.testing.assert_close(pooled, clip.encode_text(ids), atol=1e-5, rtol=1e-4)


def test_offline_without_weights_is_a_clear_error(tmp_path, no_network):
    with pytest.raises(FileNotFoundError, match="could not load open_clip ViT-L-14 'openai' weights"):
        CLIPTextEncoder.from_open_clip("openai", cache_dir=tmp_path / "empty_cache")
    with pytest.raises(FileNotFoundError, match="neither a local checkpoint file"):
        CLIPTextEncoder.from_open_clip(tmp_path / "missing.pt")
