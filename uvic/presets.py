"""Model presets, name -> constructor kwargs, for both model families, and U-ViT's VAE latent scale.

    UVIT_PRESETS       `uvic.models.UViTModel` kwargs: `uvit-<size>-<data>` (softmax) and `uvic-<size>-<data>` (Cog)
    COGFORMER_PRESETS  `uvic.models.CogformerConfig` kwargs: "tiny", "141M", "600M", "1B"
    UVIT_VAE_SCALE     the latent scale of U-ViT's MS-COCO autoencoder (`uvic.models.autoencoder`)

A preset is the only place a model size is written; a run config names one with `model: {preset: NAME}` and
`uvic.config` reads these tables when it loads a config. They are plain data and this module imports no model
code, so that `train.py --dry-run` or a config error does not wait for diffusers and transformers, which the model
modules import (docs/conventions.md, "Import-time behaviour"). The model modules re-export them:
`uvic.models.UVIT_PRESETS` is this dict.
"""

from __future__ import annotations

from typing import Any


__all__ = ["UVIT_PRESETS", "COGFORMER_PRESETS", "UVIT_VAE_SCALE", "uvit_preset", "official_nnet", "cogformer_preset"]

# U-ViT configs/mscoco_uvit_small.py: autoencoder scale_factor (logs: "Create autoencoder with scale_factor=0.2301").
UVIT_VAE_SCALE = 0.23010


# ---------------------------------------------------------------------------------------------------------
# U-ViT / U-ViC (uvic.models.UViTModel)
# ---------------------------------------------------------------------------------------------------------

# Architectures only; the official configs under baofff/U-ViT `configs/` hold the rest of each recipe.
# Parameter counts (U-ViT and U-ViC alike) are in the comments; tests check them.
_S = {"embed_dim": 512, "depth": 12, "num_heads": 8}
_T2I = {"clip_dim": 768, "num_clip_token": 77}
_M = {"embed_dim": 768, "depth": 16, "num_heads": 12}
_L = {"embed_dim": 1024, "depth": 20, "num_heads": 16}
_H = {"embed_dim": 1152, "depth": 28, "num_heads": 16, "conv": False}  # the Huge configs drop the final conv
_BASE_PRESETS: dict[str, dict[str, Any]] = {
    # U-ViT-S/2 CIFAR-10 (U-ViT configs/cifar10_uvit_small.py): 44,255,328.
    "s2-cifar10": {"img_size": 32, "patch_size": 2, "in_chans": 3, **_S},
    # U-ViT-S/4 CelebA 64 (U-ViT configs/celeba64_uvit_small.py): 44,292,228.
    "s4-celeba64": {"img_size": 64, "patch_size": 4, "in_chans": 3, **_S},
    # U-ViT-S/2 MS-COCO on 4x32x32 SD latents (U-ViT configs/mscoco_uvit_small.py; U-ViC: CogAttn
    # U-ViC/configs/mscoco_uvit_small_np_0_last.py): 44,692,644.
    "s2-mscoco": {"img_size": 32, "patch_size": 2, "in_chans": 4, **_S, **_T2I},
    # U-ViT-S/2-Deep MS-COCO (README: --config.nnet.depth=16): 58,345,636.
    "s2-deep-mscoco": {"img_size": 32, "patch_size": 2, "in_chans": 4, **_S, "depth": 16, **_T2I},
    # ImageNet 64 pixels, 1000 classes and no null class (configs/imagenet64_uvit_{mid,large}.py):
    # M/4 130,940,292 (paper: 131M); L/4 286,827,652 (287M).
    "m4-imagenet64": {"img_size": 64, "patch_size": 4, "in_chans": 3, **_M, "num_classes": 1000},
    "l4-imagenet64": {"img_size": 64, "patch_size": 4, "in_chans": 3, **_L, "num_classes": 1000},
    # ImageNet 256 / 512 on SD latents, 1000 classes + the CFG null class (configs/imagenet{256,512}_uvit_*.py):
    # L/2 286,763,172; H/2 500,832,016 (501M); L/4 286,861,524; H/4 500,942,656.
    "l2-imagenet256": {"img_size": 32, "patch_size": 2, "in_chans": 4, **_L, "num_classes": 1001},
    "h2-imagenet256": {"img_size": 32, "patch_size": 2, "in_chans": 4, **_H, "num_classes": 1001},
    "l4-imagenet512": {"img_size": 64, "patch_size": 4, "in_chans": 4, **_L, "num_classes": 1001},
    "h4-imagenet512": {"img_size": 64, "patch_size": 4, "in_chans": 4, **_H, "num_classes": 1001},
    # Tiny models for tests (65, 22 and 18 tokens; 5 blocks so U-ViC has both kinds) and the CPU demo, the model
    # of configs/demo_digits.yaml (1x8x8 digits in 4x4 patches, 5 tokens, 7 blocks, 2,322,106 parameters). For the
    # demo, 2x2 patches (16 tokens) trained 2.5x slower per sample and gave blobs, and 160 wide for 3,200 steps beat
    # 192 wide for 5,000 (digit-classifier confidence 0.83 vs 0.78).
    "tiny-cifar": {"img_size": 32, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 4, "num_heads": 2},
    "tiny-t2i": {"img_size": 8, "patch_size": 2, "in_chans": 4, "embed_dim": 32, "depth": 4, "num_heads": 2,
                 "clip_dim": 16, "num_clip_token": 5},
    "tiny-class": {"img_size": 8, "patch_size": 2, "in_chans": 3, "embed_dim": 32, "depth": 4, "num_heads": 2,
                   "num_classes": 11},
    "demo": {"img_size": 8, "patch_size": 4, "in_chans": 1, "embed_dim": 160, "depth": 6, "num_heads": 4},
}

UVIT_PRESETS: dict[str, dict[str, Any]] = {
    f"{prefix}-{name}": {**kwargs, "attention": attention}
    for name, kwargs in _BASE_PRESETS.items()
    for prefix, attention in (("uvit", "softmax"), ("uvic", "cog"))
}


def uvit_preset(name: str) -> dict[str, Any]:
    """The `UViTModel` kwargs of preset `name` (a copy of `UVIT_PRESETS[name]`); the one preset lookup, used by
    `uvic.models.build_preset` and by a config's `model: {preset: NAME}`.

    A name without the `uvit-` / `uvic-` prefix (e.g. "tiny-cifar") means the softmax flavour.
    """
    if name not in UVIT_PRESETS and f"uvit-{name}" in UVIT_PRESETS:
        name = f"uvit-{name}"
    if name not in UVIT_PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(UVIT_PRESETS)}")
    return dict(UVIT_PRESETS[name])


def official_nnet(preset: str) -> dict[str, Any]:
    """The official `config.nnet` (baofff/U-ViT configs) of the model of `preset`, as `uvit_from_official` takes it:
    the nnet class ("uvit", or "uvit_t2i" for a text-conditional preset) and the preset's sizes. The official
    configs' other keys (mlp_ratio 4, no qkv bias, no time-embedding MLP) are `UViTModel`'s defaults; softmax or
    Cog is the official `np` flag, which the caller sets, so the preset's `attention` is dropped.
    """
    nnet = uvit_preset(preset)
    nnet.pop("attention")
    return {"name": "uvit_t2i" if "clip_dim" in nnet else "uvit", **nnet}


# ---------------------------------------------------------------------------------------------------------
# Cogformer (uvic.models.CogformerConfig)
# ---------------------------------------------------------------------------------------------------------

# Paper Sec. 4.1 (141M) and App. C (600M, 1B). All share RoPE, SwiGLU and the 32000-token Llama vocabulary.
# "tiny" is a CPU-sized model over bytes (vocab 257: the 256 byte values + end-of-text, `uvic.lm.data`).
COGFORMER_PRESETS: dict[str, dict] = {
    "tiny": {
        "vocab_size": 257, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
        "num_attention_heads": 4, "max_position_embeddings": 256,
        "keep_softmax_first": 1, "keep_softmax_last": 1,
    },
    "141M": {
        "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "max_position_embeddings": 2048,
        "keep_softmax_first": 1, "keep_softmax_last": 1,
    },
    "600M": {
        "vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4608, "num_hidden_layers": 16,
        "num_attention_heads": 24, "max_position_embeddings": 4096,
        "keep_softmax_first": 2, "keep_softmax_last": 2,
    },
    "1B": {
        "vocab_size": 32000, "hidden_size": 1792, "intermediate_size": 5376, "num_hidden_layers": 22,
        "num_attention_heads": 28, "max_position_embeddings": 4096,
        "keep_softmax_first": 3, "keep_softmax_last": 3,
    },
}


def cogformer_preset(name: str) -> dict[str, Any]:
    """The `CogformerConfig` kwargs of preset `name` ("tiny", "141M", "600M", "1B"); the one preset lookup, used by
    `uvic.models.cogformer_config` and by an LM config's `model: {preset: NAME}`."""
    if name not in COGFORMER_PRESETS:
        raise ValueError(f"unknown Cogformer preset {name!r}; expected one of {sorted(COGFORMER_PRESETS)}")
    return dict(COGFORMER_PRESETS[name])
