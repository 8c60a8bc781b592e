"""The guidance facts (`uvic.guidance`): U-ViT's scale s is diffusers' g = 1 + s, and the one default is MS-COCO's
official s = 1, which the text-to-image pipeline and the config's sample section both use."""

import inspect

import torch

from uvic.config import SampleConfig
from uvic.guidance import DEFAULT_GUIDANCE_SCALE, official_to_guidance_scale
from uvic.pipelines.pipeline_uvic import guided_epsilon
from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline


def test_official_scale_to_diffusers_guidance():
    g = torch.Generator().manual_seed(0)
    e_c, e_u = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    for s in (0.0, 0.4, 0.7, 1.0):  # ImageNet 64, 256, 512 and MS-COCO
        official = e_c + s * (e_c - e_u)  # U-ViT's cfg_nnet
        torch.testing.assert_close(guided_epsilon(e_c, e_u, official_to_guidance_scale(s)), official)


def test_the_default_is_ms_cocos_official_scale_in_the_pipeline_and_the_config():
    assert DEFAULT_GUIDANCE_SCALE == 2.0  # U-ViT configs/mscoco_uvit_small.py: sample.scale = 1.0
    assert inspect.signature(UViCText2ImagePipeline.__call__).parameters["guidance_scale"].default == 2.0
    assert SampleConfig().guidance_scale == 2.0
