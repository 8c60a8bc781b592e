"""Diffusers pipelines for U-ViT / U-ViC models (`sampling`: seeded generation, folder and grid writers)."""

from uvic.pipelines.pipeline_uvic import UViCPipeline
from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline


__all__ = ["UViCPipeline", "UViCText2ImagePipeline"]
