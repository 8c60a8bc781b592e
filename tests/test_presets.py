"""uvic/presets.py: the official U-ViT configs are presets (their `nnet` sections come from the preset table)."""

import inspect

import pytest

from uvic.pipelines.pipeline_uvic import OFFICIAL_IMAGENET
from uvic.presets import official_nnet


# The `config.nnet` sections as baofff/U-ViT's config files write them (configs/<name>.py), the reference.
_OFFICIAL = {"mlp_ratio": 4, "qkv_bias": False, "mlp_time_embed": False}
_IMAGENET = {
    "imagenet64_uvit_mid": {"img_size": 64, "patch_size": 4, "in_chans": 3, "embed_dim": 768, "depth": 16,
                            "num_heads": 12, "num_classes": 1000},
    "imagenet64_uvit_large": {"img_size": 64, "patch_size": 4, "in_chans": 3, "embed_dim": 1024, "depth": 20,
                              "num_heads": 16, "num_classes": 1000},
    "imagenet256_uvit_large": {"img_size": 32, "patch_size": 2, "in_chans": 4, "embed_dim": 1024, "depth": 20,
                               "num_heads": 16, "num_classes": 1001},
    "imagenet256_uvit_huge": {"img_size": 32, "patch_size": 2, "in_chans": 4, "embed_dim": 1152, "depth": 28,
                              "num_heads": 16, "num_classes": 1001, "conv": False},
    "imagenet512_uvit_large": {"img_size": 64, "patch_size": 4, "in_chans": 4, "embed_dim": 1024, "depth": 20,
                               "num_heads": 16, "num_classes": 1001},
    "imagenet512_uvit_huge": {"img_size": 64, "patch_size": 4, "in_chans": 4, "embed_dim": 1152, "depth": 28,
                              "num_heads": 16, "num_classes": 1001, "conv": False},
}
_MSCOCO_SMALL = {"name": "uvit_t2i", "img_size": 32, "in_chans": 4, "patch_size": 2, "embed_dim": 512, "depth": 12,
                 "num_heads": 8, "mlp_ratio": 4, "qkv_bias": False, "mlp_time_embed": False, "clip_dim": 768,
                 "num_clip_token": 77}


def _model_kwargs(nnet: dict) -> dict:
    """An official nnet section with the keys that are `UViTModel`'s defaults left out (they must be defaults)."""
    from uvic.models import UViTModel

    defaults = {k: p.default for k, p in inspect.signature(UViTModel.__init__).parameters.items()}
    for key in _OFFICIAL:
        assert nnet.get(key, defaults[key]) == defaults[key], key
    return {k: v for k, v in nnet.items() if k not in _OFFICIAL}


@pytest.mark.parametrize("name", sorted(_IMAGENET))
def test_official_imagenet_nnet_is_its_preset(name):
    assert set(OFFICIAL_IMAGENET) == set(_IMAGENET)
    assert OFFICIAL_IMAGENET[name]["nnet"] == _model_kwargs({"name": "uvit", **_OFFICIAL, **_IMAGENET[name]})


def test_official_mscoco_nnet_is_its_preset():
    assert official_nnet("uvit-s2-mscoco") == _model_kwargs(_MSCOCO_SMALL)
    assert official_nnet("uvic-s2-mscoco") == official_nnet("uvit-s2-mscoco")  # Cog is the caller's `np` flag
    with pytest.raises(ValueError, match="unknown preset 'uvit-xl'"):
        official_nnet("uvit-xl")
