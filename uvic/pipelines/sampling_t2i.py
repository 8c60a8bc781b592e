"""Seed-per-image text-to-image sampling: prompt grids and the MS-COCO FID folder (U-ViT protocol).

FID protocol (reference doc Sec. 2.2 and 5): 30,000 images, each conditioned on a random caption of a random
val2014 image, guidance scale 2.0 (official `scale=1.0`), 50-NFE `UViTDPMSolverScheduler`, saved as PNG.
Image i uses caption row `rows[i]` (drawn once from `seed`) and the generator `seed + i`, so the folder does
not depend on batch size or process count; `captions.json` records which caption each file used.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline


logger = logging.getLogger(__name__)

__all__ = ["load_t2i_pipeline", "generate_t2i", "sample_t2i_to_folder", "T2I_SAMPLERS"]

T2I_SAMPLERS = ("uvit_dpm_solver", "dpm_solver", "ddim", "ddpm")


def load_t2i_pipeline(
    source: str | os.PathLike, sampler: str | None = None, text_encoder: str | None = None
) -> UViCText2ImagePipeline:
    """A `UViCText2ImagePipeline` from its directory; `sampler` swaps the scheduler on the same betas.

    "uvit_dpm_solver" is the official DPM-Solver++; "dpm_solver" / "ddim" / "ddpm" are diffusers' stock
    `DPMSolverMultistepScheduler` / `DDIMScheduler` / `DDPMScheduler`. `text_encoder` (a `CLIPTextEncoder`
    directory, an open_clip tag such as "openai", or a checkpoint file) is added when the pipeline has none,
    which text prompts need (pipelines exported by training hold no text encoder).
    """
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

    from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler

    source = Path(source)
    if not (source / "model_index.json").is_file():
        raise FileNotFoundError(f"{source} is not a pipeline directory (no model_index.json)")
    pipe = UViCText2ImagePipeline.from_pretrained(str(source))
    if sampler is not None:
        table = {"uvit_dpm_solver": UViTDPMSolverScheduler, "dpm_solver": DPMSolverMultistepScheduler,
                 "ddim": DDIMScheduler, "ddpm": DDPMScheduler}
        if sampler not in table:
            raise ValueError(f"unknown sampler {sampler!r}; expected one of {sorted(table)}")
        c = pipe.scheduler.config
        keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
        pipe.scheduler = table[sampler](**{k: c[k] for k in keys})
    if text_encoder is not None and pipe.text_encoder is None:
        from uvic.models.text_encoder import CLIPTextEncoder

        te = (CLIPTextEncoder.from_pretrained(text_encoder) if Path(text_encoder).is_dir()
              else CLIPTextEncoder.from_open_clip(text_encoder))
        pipe.register_modules(text_encoder=te.eval())
    return pipe


def generate_t2i(
    pipe: UViCText2ImagePipeline,
    seeds: list[int],
    batch_size: int,
    num_inference_steps: int,
    guidance_scale: float,
    prompts: list[str] | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
) -> np.ndarray:
    """(N, H, W, 3) uint8 images, image k from `prompts[k]` (or `prompt_embeds[k]`, (N, L, D)) and seed `seeds[k]`."""
    if (prompts is None) == (prompt_embeds is None):
        raise ValueError("pass exactly one of prompts and prompt_embeds")
    n = len(prompts) if prompts is not None else prompt_embeds.shape[0]
    if n != len(seeds):
        raise ValueError(f"got {n} prompts for {len(seeds)} seeds")
    out = []
    for k in range(0, n, batch_size):
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds[k : k + batch_size]]
        kw = {"prompt": prompts[k : k + batch_size]} if prompts is not None else {
            "prompt_embeds": prompt_embeds[k : k + batch_size]}
        images = pipe(**kw, negative_prompt_embeds=negative_prompt_embeds, guidance_scale=guidance_scale,
                      num_inference_steps=num_inference_steps, generator=gens, output_type="np").images
        # The same uint8 rounding as torchvision.utils.save_image (U-ViT `sample2dir`).
        out.append((images * 255 + 0.5).clip(0, 255).astype(np.uint8))
    return np.concatenate(out)


def sample_t2i_to_folder(
    pipe: UViCText2ImagePipeline,
    features_root: str | os.PathLike,
    out_dir: str | os.PathLike,
    num_images: int = 30_000,
    seed: int = 0,
    batch_size: int = 50,
    num_inference_steps: int = 50,
    guidance_scale: float = 2.0,
    split: str = "val",
    process_index: int = 0,
    num_processes: int = 1,
) -> int:
    """Write `{i:06d}.png` for i < num_images, conditioned on random captions of the extracted `split` features.

    This process does i % num_processes == process_index; existing files are skipped and each file is written
    to a temporary name then renamed, so an interrupted run can be restarted. Returns the images written here.
    """
    from uvic.data.mscoco import MSCOCOFeatures

    features = MSCOCOFeatures(features_root, split)
    rows = features.draw_caption_rows(num_images, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if process_index == 0:
        captions = features.captions
        (out_dir / "captions.json").write_text(json.dumps([captions[int(r)] for r in rows]))
    todo = [i for i in range(process_index, num_images, num_processes) if not (out_dir / f"{i:06d}.png").exists()]
    empty = features.empty_context
    for k in range(0, len(todo), batch_size):
        chunk = todo[k : k + batch_size]
        images = generate_t2i(pipe, [seed + i for i in chunk], batch_size, num_inference_steps, guidance_scale,
                              prompt_embeds=features.context(rows[chunk]), negative_prompt_embeds=empty)
        for i, img in zip(chunk, images):
            final = out_dir / f"{i:06d}.png"
            tmp = out_dir / f".{final.name}.tmp{os.getpid()}"
            Image.fromarray(img).save(tmp, format="PNG")
            os.replace(tmp, final)
    logger.info("process %d wrote %d images to %s", process_index, len(todo), out_dir)
    return len(todo)
