"""Classifier-free guidance scales: the conversion from U-ViT's convention and the one default.

uvic's pipelines follow diffusers: eps = eps_u + g (eps_c - eps_u). U-ViT's configs write eps_c + s (eps_c - eps_u),
the same with g = 1 + s (docs/conventions.md, "Guidance"). This module imports nothing, so the config schema reads
the default without loading the pipelines.
"""

from __future__ import annotations


__all__ = ["DEFAULT_GUIDANCE_SCALE", "official_to_guidance_scale"]


def official_to_guidance_scale(scale: float) -> float:
    """U-ViT `config.sample.scale` s -> diffusers `guidance_scale` g = 1 + s (MS-COCO's 1.0 -> 2.0)."""
    return 1.0 + scale


# MS-COCO's official scale (U-ViT configs/mscoco_uvit_small.py, s = 1.0): the text-to-image pipeline's default and
# `sample.guidance_scale`'s.
DEFAULT_GUIDANCE_SCALE = official_to_guidance_scale(1.0)
