"""Diffusers pipelines for U-ViT / U-ViC models, and seed-per-image sampling helpers."""

from uvic.pipelines.pipeline_uvic import UViCPipeline


__all__ = ["UViCPipeline"]
