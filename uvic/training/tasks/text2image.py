"""MS-COCO text-to-image training on extracted features, as U-ViT trains it (task "t2i").

Discrete-time latent diffusion (docs/conventions.md, "MS-COCO text-to-image"): the latent is re-drawn from the
stored VAE moments at every step, the whole context is replaced by the empty-caption features with probability
`data.p_uncond` (classifier-free guidance training), and the loss is the one epsilon loss of
`uvic.training.losses` on the discrete schedule (network time t + 1).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from diffusers import AutoencoderKL
from torch import nn

from uvic.data.mscoco import MSCOCOFeatures, load_empty_context
from uvic.models.autoencoder import load_vae
from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline
from uvic.pipelines.sampling import ImageConditions, mscoco_prompt_embeds
from uvic.schedulers import build_scheduler
from uvic.training.losses import text_to_image_loss
from uvic.training.rng import ShardedRNG
from uvic.training.tasks.diffusion import DiffusionTask


logger = logging.getLogger(__name__)


class Text2ImageTask(DiffusionTask):
    """MS-COCO text-to-image training on extracted features (task "t2i"; `uvic.training.tasks` API).

    The model, the noise process, the parameter groups and the sample grid are `DiffusionTask`'s; the data, the
    loss (context dropout), the conditions of the images (captions) and the pipeline are text-to-image ones.

    Reads: `cfg.model` (a text-conditional UViTConfig), `cfg.diffusion` (discrete, scaled_linear), `cfg.data.root`
    (the output of `python -m uvic.data.mscoco`, split "train"), `cfg.data.p_uncond`, `cfg.data.latent_scale`,
    `cfg.data.vae` (autoencoder for sample grids and the exported pipeline; "" skips both), `cfg.sample.sampler`
    ("uvit_dpm_solver" is the official sampler), `cfg.sample.guidance_scale` and `cfg.sample.num_inference_steps`.
    """

    latent = True

    def __init__(self, cfg: Any) -> None:
        if cfg.diffusion.schedule != "discrete":
            raise ValueError("the t2i task trains the discrete schedule: set diffusion.schedule=discrete")
        if cfg.model.clip_dim is None:
            raise ValueError("the t2i task needs a text-conditional model: set model.clip_dim (768 for CLIP ViT-L/14)")
        super().__init__(cfg)
        self._empty_context: torch.Tensor | None = None

    def _read_data(self) -> MSCOCOFeatures:
        """The "train" split of the features, checked against the model."""
        dataset = MSCOCOFeatures(self.cfg.data.root, "train")
        m = self.cfg.model
        item = dataset[0]
        if tuple(item["x"].shape) != (2 * m.in_chans, m.img_size, m.img_size):
            raise ValueError(f"features in {self.cfg.data.root} have moments {tuple(item['x'].shape)}, but the "
                             f"model expects (2 * in_chans, img_size, img_size) = {(2 * m.in_chans, m.img_size, m.img_size)}")
        if tuple(item["context"].shape) != (m.num_clip_token, m.clip_dim):
            raise ValueError(f"features in {self.cfg.data.root} have contexts {tuple(item['context'].shape)}, but the "
                             f"model expects (num_clip_token, clip_dim) = {(m.num_clip_token, m.clip_dim)}")
        return dataset

    def _test_split(self) -> Callable[[], MSCOCOFeatures] | None:
        """The "val" split of the features (MS-COCO val2014, U-ViT's FID captions), when extracted."""
        root = Path(self.cfg.data.root)
        return (lambda: MSCOCOFeatures(root, "val")) if (root / "val" / "meta.json").is_file() else None

    def _holdout_groups(self) -> np.ndarray:
        """The image of each caption row: an image is held out with all its captions."""
        return self._data().caption_image

    def _validation_inputs(self, batch: dict[str, torch.Tensor],
                           generators: list[torch.Generator]) -> tuple[torch.Tensor, dict[str, Any]]:
        """A latent drawn from the stored moments, and the caption's features (never the empty caption's)."""
        return self._latents(batch["x"], generators), {"encoder_hidden_states": batch["context"]}

    @property
    def empty_context(self) -> torch.Tensor:
        """(L, D) features of the empty caption, the null condition (read once from `data.root`)."""
        if self._empty_context is None:
            self._empty_context = load_empty_context(self.cfg.data.root)
        return self._empty_context

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        return text_to_image_loss(model, batch["x"], batch["context"], self.empty_context, self.noise,
                                  self.cfg.data.latent_scale, rng, p_uncond=self.cfg.data.p_uncond)

    @property
    def num_labels(self) -> int:
        return 0

    @property
    def grid_scale(self) -> int:
        """1: MS-COCO images are drawn as they are."""
        return 1

    def load_vae(self) -> AutoencoderKL:
        """The autoencoder named by `cfg.data.vae` with `scaling_factor = cfg.data.latent_scale`. Raises ValueError
        when `data.vae` is not set."""
        if not self.cfg.data.vae:
            raise ValueError("data.vae is not set: a text-to-image pipeline needs the autoencoder")
        return load_vae(self.cfg.data.vae, self.cfg.data.latent_scale)

    def pipeline(self, model: nn.Module, *, sampler: str | None = None,
                 vae: AutoencoderKL | None = None) -> UViCText2ImagePipeline:
        """A `UViCText2ImagePipeline` around `model` with `sampler` and `vae` (defaults: the configured ones)."""
        vae = vae if vae is not None else self.load_vae()
        scheduler = build_scheduler(sampler or self.cfg.sample.sampler, self.cfg.diffusion)
        return UViCText2ImagePipeline(transformer=model, vae=vae, scheduler=scheduler)

    def image_conditions(self, purpose: str, num_images: int) -> ImageConditions:
        """Caption features, the empty caption's as the negative, `sample.guidance_scale`. A grid shows the first
        `num_images` captions of the val split (train if there is none; fewer if it holds fewer); FID takes U-ViT's
        protocol, a random caption of a random val image for each image (drawn from `sample.seed`)."""
        s, root = self.cfg.sample, Path(self.cfg.data.root)
        if purpose == "fid":
            embeds, empty, _ = mscoco_prompt_embeds(root, num_images, s.seed)
            return ImageConditions(num_images, prompt_embeds=embeds, negative_prompt_embeds=empty,
                                   guidance_scale=s.guidance_scale)
        features = MSCOCOFeatures(root, "val" if self._test_split() is not None else "train")
        rows = np.arange(min(num_images, len(features)))
        return ImageConditions(len(rows), prompt_embeds=features.context(rows),
                               negative_prompt_embeds=self.empty_context, guidance_scale=s.guidance_scale)

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """The model as a `UViCText2ImagePipeline` (needs `data.vae`; otherwise only `out_dir/transformer`), with
        the text encoder of the features (`text_encoder_spec`) when it loads and reproduces them, so that the
        export samples from prompts offline."""
        model = copy.deepcopy(model).float().cpu()
        if not self.cfg.data.vae:
            model.save_pretrained(Path(out_dir) / "transformer")
            logger.warning("data.vae is not set: exported only the transformer (pipeline/transformer)")
            return
        pipe = self.pipeline(model)
        self.attach_text_encoder(pipe)
        pipe.save_pretrained(str(out_dir))

    def text_encoder_spec(self) -> str:
        """`data.text_encoder`, else the `clip` the features' meta.json records ("" if neither names one)."""
        if self.cfg.data.text_encoder:
            return self.cfg.data.text_encoder
        meta = MSCOCOFeatures(self.cfg.data.root, "train").meta
        return str((meta.get("models") or {}).get("clip") or "")

    def attach_text_encoder(self, pipe: UViCText2ImagePipeline) -> None:
        """Give `pipe` the features' text encoder if it loads (offline: a local dir or file, or a cached open_clip
        tag) and encodes the empty caption as the stored features do; otherwise warn and leave it without one."""
        from uvic.pipelines.sampling import attach_text_encoder

        spec = self.text_encoder_spec()
        why = "no data.text_encoder and none recorded in the features' meta.json"
        if spec:
            try:
                attach_text_encoder(pipe, spec)
                with torch.no_grad():
                    empty = pipe.text_encoder.encode_text([""]).float().cpu()[0]
                ok = empty.shape == self.empty_context.shape and torch.allclose(
                    empty, self.empty_context.float(), rtol=1e-3, atol=1e-4)
                why = None if ok else f"{spec} does not give the features in {self.cfg.data.root}"
            except Exception as e:  # noqa: BLE001 - any loading failure (offline, missing file) only costs the encoder
                why = f"{spec} did not load ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        if why is not None:
            pipe.register_modules(text_encoder=None)
            logger.warning("exported without a text encoder (%s); sample.py then needs --clip for prompts", why)
