"""Seeded generation for every pipeline: one `generate`, one folder writer, one grid writer.

Image i is generated from `torch.Generator("cpu").manual_seed(seed + i)` (EDM2's one-generator-per-seed rule),
so an image does not depend on batch size or process count. The same code serves the three kinds of condition:
- unconditional `UViCPipeline`s: nothing;
- class-conditional `UViCPipeline`s: `class_labels` (the folder writer defaults to the balanced i % num_labels;
  `random_class_labels` draws U-ViT's FID labels), and `guidance_scale` with a null class;
- `UViCText2ImagePipeline`s: `prompts` or `prompt_embeds` (+ `negative_prompt_embeds`, `guidance_scale`).

Pixels are quantised as `torchvision.utils.save_image` does (U-ViT's `sample2dir`): uint8(255 x + 0.5), clipped.
Loading a pipeline from a training run or checkpoint is `uvic.training.runs.load_pipeline`; this module only
opens pipeline directories (`load_pretrained`), so it never imports the training code.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from diffusers import DiffusionPipeline, SchedulerMixin
from PIL import Image
from tqdm.auto import tqdm

from uvic.io import atomic_write, check_model_dir, quantize_uint8
from uvic.pipelines.export import pipeline_class_name
from uvic.pipelines.pipeline_uvic import UViCPipeline
from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline


logger = logging.getLogger(__name__)

__all__ = [
    "PIPELINE_CLASSES",
    "ImageConditions",
    "attach_text_encoder",
    "balanced_class_labels",
    "check_model_dir",
    "class_labels_for",
    "random_class_labels",
    "check_grid_size",
    "check_output",
    "generate",
    "grid_shape",
    "image_shape",
    "is_pipeline_dir",
    "load_pretrained",
    "mscoco_prompt_embeds",
    "quantize_uint8",
    "sample_to_folder",
    "save_grid",
]

PIPELINE_CLASSES: dict[str, type[DiffusionPipeline]] = {
    "UViCPipeline": UViCPipeline,
    "UViCText2ImagePipeline": UViCText2ImagePipeline,
}


def is_pipeline_dir(path: str | os.PathLike) -> bool:
    """True if `path` holds a saved pipeline (`model_index.json`)."""
    return (Path(path) / "model_index.json").is_file()


def load_pretrained(
    path: str | os.PathLike, sampler: str | None = None, text_encoder: str | None = None
) -> DiffusionPipeline:
    """A `UViCPipeline` or `UViCText2ImagePipeline` from its saved directory (the class named in model_index.json).

    Args:
        path: a `save_pretrained` directory.
        sampler: switch the scheduler to this sampler on the same forward process (`uvic.schedulers.sampler_names()`);
            None keeps the saved one.
        text_encoder: for a text-to-image pipeline without one (training exports hold none): a
            `CLIPTextEncoder` directory, or an open_clip tag such as "openai" / a checkpoint file. Needed for
            text prompts; ignored when the pipeline has a text encoder or is not text-to-image.
    Raises:
        FileNotFoundError: no model_index.json. ValueError: one line for an unreadable index, another pipeline
            class, a component of a class the pipeline does not take (checked before and after loading), a
            component whose config describes another model than its weights (`check_model_dir`, before anything is
            allocated), or a missing or damaged file.
    """
    from uvic.schedulers import convert_scheduler

    path = Path(path)
    if not is_pipeline_dir(path):
        raise FileNotFoundError(f"{path} is not a pipeline directory (no model_index.json)")
    try:
        index = json.loads((path / "model_index.json").read_text())
        name = pipeline_class_name(index)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path / 'model_index.json'} is unreadable ({type(e).__name__}: {e})") from e
    if name not in PIPELINE_CLASSES:
        raise ValueError(f"{path} holds a {name!r} pipeline; expected one of {sorted(PIPELINE_CLASSES)}")
    cls = PIPELINE_CLASSES[name]
    # The component classes `cls.__init__` takes (diffusers reads the same annotations).
    components = {component: wanted for component, types in cls._get_signature_types().items()
                  if (wanted := tuple(t for t in types if isinstance(t, type)
                                      and issubclass(t, (torch.nn.Module, SchedulerMixin))))}
    # Before diffusers builds anything: each component is of a class the pipeline takes, and fits its weights.
    for component, wanted in components.items():
        if isinstance(index.get(component), list) and index[component] != [None, None]:
            named = _component_class(path, component, index[component], cls, wanted)
            if issubclass(named, torch.nn.Module):
                check_model_dir(named, path / component, f"the {component} of {path}")
    try:
        pipe = cls.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - diffusers / safetensors / torch report a damaged file in many types
        raise ValueError(f"cannot load the pipeline in {path}, a file in it is missing or damaged "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e
    for component, wanted in components.items():  # and after: what diffusers built is what the pipeline takes
        value = getattr(pipe, component, None)
        if value is not None and not isinstance(value, wanted):
            raise ValueError(f"the {component} of the pipeline in {path} is a {type(value).__name__}; a {cls.__name__} "
                             f"takes a {_names(wanted)}")
    if sampler is not None:
        pipe.scheduler = convert_scheduler(pipe.scheduler, sampler)
    return attach_text_encoder(pipe, text_encoder)


def _names(types: Sequence[type]) -> str:
    return " or ".join(t.__name__ for t in types if t is not type(None))


def _component_class(path: Path, component: str, entry: list, cls: type, wanted: tuple[type, ...]) -> type:
    """The class model_index.json names for `component`, if it is one of `wanted` (checked before diffusers imports
    and builds it). Only classes of diffusers, transformers and uvic are looked up; nothing else is imported."""
    where = f"{path / 'model_index.json'} names"
    if len(entry) != 2 or not all(isinstance(x, str) for x in entry):
        raise ValueError(f"{where} {entry!r} as the {component}; expected [library, class name]")
    library, class_name = entry
    if library.split(".")[0] not in ("diffusers", "transformers", "uvic"):
        raise ValueError(f"{where} {library}.{class_name} as the {component}; a {cls.__name__} takes a "
                         f"{_names(wanted)}")
    try:
        named = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where} {library}.{class_name} as the {component}, which does not exist ({e})") from e
    if not (isinstance(named, type) and issubclass(named, wanted)):
        raise ValueError(f"{where} {library}.{class_name} as the {component}; a {cls.__name__} takes a "
                         f"{_names(wanted)}")
    return named


def attach_text_encoder(pipe: DiffusionPipeline, text_encoder: str | None) -> DiffusionPipeline:
    """Give a text-to-image pipeline without a text encoder the `CLIPTextEncoder` named by `text_encoder` (a
    directory, an open_clip tag such as "openai", or a checkpoint file); any other pipeline is returned as is.

    Raises:
        ValueError: a directory that holds no loadable `CLIPTextEncoder` (no or a damaged config or weights file,
            pickled weights that are not plain tensors, a config that does not fit the weights).
    """
    if text_encoder is not None and isinstance(pipe, UViCText2ImagePipeline) and pipe.text_encoder is None:
        from uvic.models.text_encoder import CLIPTextEncoder

        pipe.register_modules(text_encoder=CLIPTextEncoder.from_spec(text_encoder))
    return pipe


def balanced_class_labels(num_labels: int, indices: Sequence[int]) -> list[int] | None:
    """Class i % K for image i (a balanced set; K = `num_labels`, the classes without the null class, as
    `UViCPipeline.num_labels` counts them); None for K <= 0 (an unconditional model)."""
    return [i % num_labels for i in indices] if num_labels > 0 else None


@dataclass(frozen=True)
class ImageConditions:
    """The conditions of images 0..num_images-1 of one job (a training task's sample grid or FID set), as
    `generate` takes them: `kwargs(indices)` for the images `indices`.

    Attributes:
        num_images: N.
        class_labels: (N,) class ids, or None.
        prompt_embeds: caption features indexable by an index array -> (n, L, D) (a tensor, or the stored rows of
            `mscoco_prompt_embeds`), or None.
        negative_prompt_embeds: (L, D) unconditional features, with `prompt_embeds`.
        guidance_scale: diffusers' convention; None: the pipeline's default (a class-conditional model's own).
    """

    num_images: int
    class_labels: Sequence[int] | None = None
    prompt_embeds: Any = None
    negative_prompt_embeds: torch.Tensor | None = None
    guidance_scale: float | None = None

    def kwargs(self, indices: Sequence[int]) -> dict[str, Any]:
        """`generate`'s condition arguments for images `indices` (taken modulo N, so a process's padded share
        past the last image is valid)."""
        idx = np.asarray(indices, dtype=np.int64) % self.num_images
        out: dict[str, Any] = {}
        if self.class_labels is not None:
            out["class_labels"] = [self.class_labels[i] for i in idx]
        if self.prompt_embeds is not None:
            out.update(prompt_embeds=self.prompt_embeds[idx], negative_prompt_embeds=self.negative_prompt_embeds)
        if self.guidance_scale is not None:
            out["guidance_scale"] = self.guidance_scale
        return out


def random_class_labels(pipe: UViCPipeline, num_images: int, seed: int = 0) -> list[int]:
    """U-ViT's FID labels (`dataset.sample_label`) for images 0..num_images-1, drawn at once from `seed`, so image
    i gets the same label whatever the process count: uniform over the classes for a latent model (ImageNet 256 /
    512), in training-class proportions (`pipe.config.class_counts`) for a pixel model (ImageNet 64).

    Raises:
        ValueError: the pipeline is not class-conditional, or a pixel model has no `class_counts`.
    """
    k = pipe.num_labels if isinstance(pipe, UViCPipeline) else 0
    if k <= 0:
        raise ValueError("random class labels need a class-conditional pipeline")
    gen = torch.Generator().manual_seed(seed)
    counts = pipe.config.class_counts
    if counts is not None:
        return torch.multinomial(torch.tensor(counts, dtype=torch.float64), num_images, replacement=True,
                                 generator=gen).tolist()
    if pipe.vae is None:
        raise ValueError("random labels of a pixel model follow the training-class frequencies (U-ViT ImageNet 64), "
                         "and this pipeline has no class_counts; pass explicit labels or build the pipeline with "
                         "class_counts=ImageNet(root).class_counts()")
    return torch.randint(0, k, (num_images,), generator=gen).tolist()


def class_labels_for(pipe: DiffusionPipeline, num_images: int, class_labels: Sequence[str] | None = None, *,
                     seed: int = 0, guidance_scale: float | None = None, source: str = "the pipeline") -> list[int] | None:
    """The label of each image 0..num_images-1 as `sample.py --class-labels` means it: None for a pipeline
    without classes; class i % num_labels by default; the given ids cycled; or `["random"]`, U-ViT's FID labels
    (`random_class_labels` from `seed`).

    Raises:
        ValueError: labels for a pipeline without classes, an id outside [0, num_labels) (the null class is not a
            valid request), a token that is not an id, or guidance > 1 on a model without a null class.
    """
    if not isinstance(pipe, UViCPipeline):
        if class_labels:
            raise ValueError(f"{source} is not class-conditional; --class-labels does not apply")
        return None
    if guidance_scale is not None and guidance_scale > 1 and not pipe.config.null_class:
        raise ValueError(f"--guidance-scale {guidance_scale} needs a class-conditional model with a null class; "
                         f"{source} has none (use --guidance-scale 1)")
    if not class_labels:
        return balanced_class_labels(pipe.num_labels, range(num_images))
    if pipe.num_labels <= 0:
        raise ValueError(f"{source} is not class-conditional; --class-labels does not apply")
    if list(class_labels) == ["random"]:
        return random_class_labels(pipe, num_images, seed)
    try:
        ids = [int(x) for x in class_labels]
    except ValueError:
        raise ValueError(f"--class-labels takes class ids or `random`, got {' '.join(class_labels)}") from None
    bad = [i for i in ids if not 0 <= i < pipe.num_labels]
    if bad:
        null = " (the last id is the null class)" if pipe.config.null_class else ""
        raise ValueError(f"--class-labels {bad[0]} is outside [0, {pipe.num_labels}){null}")
    return [ids[i % len(ids)] for i in range(num_images)]


def generate(
    pipe: DiffusionPipeline,
    seeds: Sequence[int],
    *,
    batch_size: int = 64,
    num_inference_steps: int = 50,
    class_labels: Sequence[int] | None = None,
    prompts: Sequence[str] | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    guidance_scale: float | None = None,
    progress: bool | tqdm = False,
) -> np.ndarray:
    """Images for `seeds`, one generator per image, in batches of `batch_size`.

    Args:
        pipe: a `UViCPipeline` or a `UViCText2ImagePipeline`.
        seeds: (N,) one seed per image.
        batch_size: images per pipeline call (the images do not depend on it).
        num_inference_steps: sampler steps.
        class_labels: (N,) class ids, class-conditional `UViCPipeline` only.
        prompts: N captions, text-to-image only (needs the pipeline's text encoder).
        prompt_embeds: (N, L, D) caption features instead of `prompts`.
        negative_prompt_embeds: (L, D) or (1, L, D) unconditional features (default: the empty caption encoded).
        guidance_scale: guidance in diffusers' convention (1 + the official scale), for text-to-image and
            class-conditional pipelines; None: the pipeline's default.
        progress: True shows a bar on stderr (images done / total, images/s, ETA); a `tqdm` bar is advanced
            instead (the folder writer's, which counts the whole job).
    Returns:
        (N, H, W, C) uint8 images.
    """
    if batch_size < 1 or num_inference_steps < 1:
        raise ValueError(f"batch_size and num_inference_steps must be >= 1, got {batch_size} and {num_inference_steps}")
    if len(seeds) == 0:
        raise ValueError("no seeds: pass one seed per image")
    text = isinstance(pipe, UViCText2ImagePipeline)
    if text and (prompts is None) == (prompt_embeds is None):
        raise ValueError("a text-to-image pipeline needs exactly one of prompts and prompt_embeds")
    if not text and (prompts is not None or prompt_embeds is not None):
        raise ValueError("prompts / prompt_embeds need a text-to-image pipeline")
    if text and class_labels is not None:
        raise ValueError("class_labels do not apply to a text-to-image pipeline")
    per_image = {"class_labels": class_labels, "prompt": None if prompts is None else list(prompts),
                 "prompt_embeds": prompt_embeds}
    for name, value in per_image.items():
        if value is not None and len(value) != len(seeds):
            raise ValueError(f"got {len(value)} {name} for {len(seeds)} seeds")
    out = []
    # The bar closes on an error too, so that the error line starts on a line of its own.
    own = nullcontext(progress) if isinstance(progress, tqdm) else _progress_bar(len(seeds), "sampling", not progress)
    with own as bar:
        for k in range(0, len(seeds), batch_size):
            chunk = list(seeds[k : k + batch_size])
            kwargs: dict[str, Any] = {name: v[k : k + batch_size] for name, v in per_image.items() if v is not None}
            if text:
                kwargs.update(negative_prompt_embeds=negative_prompt_embeds)
            else:
                kwargs.update(batch_size=len(chunk))
            if guidance_scale is not None:
                kwargs.update(guidance_scale=guidance_scale)
            gens = [torch.Generator("cpu").manual_seed(int(s)) for s in chunk]
            images = pipe(**kwargs, num_inference_steps=num_inference_steps, generator=gens, output_type="np").images
            out.append(quantize_uint8(images))
            bar.update(len(chunk))
    return np.concatenate(out)


def _progress_bar(total: int, desc: str, disable: bool, initial: int = 0) -> tqdm:
    """A bar on stderr: images done / total, images/s and the time left."""
    return tqdm(total=total, initial=initial, desc=desc, unit="img", disable=disable, file=sys.stderr,
                dynamic_ncols=True)


def sample_to_folder(
    pipe: DiffusionPipeline,
    out_dir: str | os.PathLike,
    num_images: int,
    *,
    seed: int = 0,
    batch_size: int = 64,
    num_inference_steps: int = 50,
    class_labels: Sequence[int] | None = None,
    prompts: Sequence[str] | None = None,
    prompt_embeds: Any = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    guidance_scale: float | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: bool = False,
) -> int:
    """Write images 0..num_images-1 as `{i:06d}.png` (seed `seed + i`); this process does i % P == rank.

    The conditions are per image index i: `class_labels[i]` (default for a class-conditional model: i % classes),
    `prompts[i]`, or `prompt_embeds[idx]` ((n, L, D) for an index array, e.g. `mscoco_prompt_embeds`). Files that
    already exist are skipped, and each file is written to a temporary name then renamed, so an interrupted run
    can simply be restarted. Returns the number of images this process wrote.

    An existing file counts as done only if it reads as a complete PNG (`uvic.data.images.check_image`); a
    truncated or empty one (e.g. from a copy that ran out of space) is generated again. Each file is fsync'ed
    before its rename, and temporary files that an interrupted run left for this process's images are removed.
    `progress` shows a bar on stderr for this process's images (images done / total, images/s, ETA).

    Raises:
        StorageError: before any sampling, when a name this process writes is taken by a directory.
    """
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = range(process_index, num_images, num_processes)
    _check_image_names(out_dir, mine)
    _remove_stale_temporaries(out_dir, set(mine))
    todo = [i for i in mine if not _is_complete_png(out_dir / f"{i:06d}.png")]
    if class_labels is None and not isinstance(pipe, UViCText2ImagePipeline):
        num_labels = pipe.num_labels if isinstance(pipe, UViCPipeline) else 0
        class_labels = balanced_class_labels(num_labels, range(num_images))
    with _progress_bar(len(mine), f"sampling to {out_dir}", not progress, initial=len(mine) - len(todo)) as bar:
        for k in range(0, len(todo), batch_size):
            chunk = todo[k : k + batch_size]
            images = generate(
                pipe, [seed + i for i in chunk], batch_size=batch_size, num_inference_steps=num_inference_steps,
                class_labels=None if class_labels is None else [class_labels[i] for i in chunk],
                prompts=None if prompts is None else [prompts[i] for i in chunk],
                prompt_embeds=None if prompt_embeds is None else prompt_embeds[np.asarray(chunk)],
                negative_prompt_embeds=negative_prompt_embeds, guidance_scale=guidance_scale, progress=bar,
            )
            for i, img in zip(chunk, images):
                # On disk before the rename, so a power cut or a full disk never leaves a short file.
                with atomic_write(out_dir / f"{i:06d}.png") as f:
                    Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).save(f, format="PNG")
    logger.info("process %d wrote %d images to %s", process_index, len(todo), out_dir)
    return len(todo)


def _check_image_names(out_dir: Path, indices: Sequence[int]) -> None:
    """Refuse an image name that a directory holds: no run could ever write it (checked before any sampling)."""
    from uvic.errors import StorageError

    for i in indices:
        if (out_dir / f"{i:06d}.png").is_dir():
            raise StorageError(f"cannot write image {i} to {out_dir / f'{i:06d}.png'}: it is a directory; move it "
                               f"out of the way")


def _is_complete_png(path: Path) -> bool:
    from uvic.data.images import check_image

    if not path.exists():
        return False
    problem = check_image(path)
    if problem is not None:
        logger.warning("%s is damaged (%s): generating it again", path, problem)
    return problem is None


def _remove_stale_temporaries(out_dir: Path, indices: set[int]) -> None:
    """Remove `.{i:06d}.png.tmp{pid}` files for image indices i of this process (no other process writes them)."""
    for tmp in out_dir.glob(".??????.png.tmp*"):
        if tmp.name[1:7].isdigit() and int(tmp.name[1:7]) in indices:
            tmp.unlink(missing_ok=True)


def check_output(grid: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None,
                 num_images: int = 0) -> None:
    """Before any sampling: the grid's format can be written and its folder (or `out_dir`) accepts files, and none
    of the `num_images` names of `out_dir` is a directory.

    Raises:
        ValueError: a grid extension PIL cannot write.
        StorageError: the grid path is a directory, the folder cannot be created or written (read-only, a file
            in the way, no permission), or an image name of `out_dir` is a directory.
    """
    from uvic.errors import StorageError, check_writable

    if grid is not None:
        grid = Path(grid)
        _image_format(grid)
        if grid.is_dir():
            raise StorageError(f"cannot write the grid to {grid}: it is a directory")
    folder = Path(out_dir) if out_dir is not None else (grid.parent if grid is not None else None)
    if folder is not None:
        check_writable(folder, f"to {folder}")
    if out_dir is not None:
        _check_image_names(Path(out_dir), range(num_images))


class _CaptionRows:
    """`prompt_embeds` for `sample_to_folder`: image i -> the stored CLIP features of caption row `rows[i]`."""

    def __init__(self, features: Any, rows: np.ndarray) -> None:
        self.features, self.rows = features, rows

    def __getitem__(self, idx: np.ndarray) -> torch.Tensor:
        return self.features.context(self.rows[idx])

    def __len__(self) -> int:
        return len(self.rows)


def mscoco_prompt_embeds(
    features_root: str | os.PathLike, num_images: int, seed: int = 0, split: str = "val"
) -> tuple[_CaptionRows, torch.Tensor, list[str]]:
    """U-ViT's MS-COCO FID conditions: image i gets a random caption of a random `split` image (drawn from `seed`).

    Returns:
        (prompt_embeds indexable by image index -> (n, 77, 768), the empty-caption features (77, 768), the N
        captions used), for `sample_to_folder(..., prompt_embeds=, negative_prompt_embeds=)`.
    """
    from uvic.data.mscoco import MSCOCOFeatures

    features = MSCOCOFeatures(features_root, split)
    rows = features.draw_caption_rows(num_images, seed)
    captions = features.captions
    return _CaptionRows(features, rows), features.empty_context, [captions[int(r)] for r in rows]


def image_shape(pipe: DiffusionPipeline) -> tuple[int, int, int]:
    """(H, W, C) of the images `pipe` generates, known before sampling (latent size x the VAE's downsampling)."""
    cfg = pipe.transformer.config
    return decoded_shape(cfg.img_size, cfg.in_chans, getattr(pipe, "vae", None))


def decoded_shape(img_size: int, in_chans: int, vae: Any | None) -> tuple[int, int, int]:
    """(H, W, C) of the images a model of `img_size` x `img_size` x `in_chans` inputs makes: those inputs for a pixel
    model (`vae` None), else the VAE's decoding of them (each down block but the last halves the side)."""
    if vae is None:
        return img_size, img_size, in_chans
    side = img_size * 2 ** (len(vae.config.block_out_channels) - 1)
    return side, side, vae.config.out_channels


def grid_shape(n: int, h: int, w: int, c: int, nrow: int | None = None, pad: int = 2, scale: int = 1
               ) -> tuple[int, int, int]:
    """(height, width, channels) of `save_grid`'s grid of n images of (h, w, c) pixels."""
    nrow = nrow or int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / nrow))
    return rows * (h * scale + pad) + pad, nrow * (w * scale + pad) + pad, c


def check_grid_size(pipe: DiffusionPipeline, num_images: int, scale: int = 1) -> None:
    """Before sampling: refuse a grid larger than PIL opens without a decompression-bomb warning
    (`PIL.Image.MAX_IMAGE_PIXELS`), which would also need its size in memory after all the sampling."""
    height, width, c = grid_shape(num_images, *image_shape(pipe), scale=scale)
    if Image.MAX_IMAGE_PIXELS is not None and height * width > Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"a grid of {num_images} images at scale {scale} would be {width} x {height} pixels "
                         f"({height * width * c / 2**30:.3g} GiB), more than image viewers and PIL open "
                         f"({Image.MAX_IMAGE_PIXELS} pixels); lower --grid-scale or --num-images")


def save_grid(images: np.ndarray, path: str | Path, nrow: int | None = None, pad: int = 2, scale: int = 1) -> Path:
    """Tile (N, H, W, C) uint8 images into one PNG, `nrow` per row (default about sqrt(N)).

    `scale` > 1 enlarges every image by pixel repetition first (for tiny images such as 8x8 digits).
    """
    if scale > 1:
        images = images.repeat(scale, axis=1).repeat(scale, axis=2)
    n, h, w, c = images.shape
    nrow = nrow or int(np.ceil(np.sqrt(n)))
    grid = np.full(grid_shape(n, h, w, c, nrow, pad), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, nrow)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + col * (w + pad) : pad + col * (w + pad) + w] = img
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed: a failed write (disk full) leaves no partial grid behind.
    with atomic_write(path) as f:
        Image.fromarray(grid[..., 0] if c == 1 else grid).save(f, format=_image_format(path))
    return path


def _image_format(path: Path) -> str:
    """PIL's format name for the extension of `path`, for writing.

    Raises:
        ValueError: an extension PIL cannot write, naming the ones it can.
    """
    ext = path.suffix.lower()
    fmt = Image.registered_extensions().get(ext)
    if fmt is None or fmt not in Image.SAVE:
        writable = sorted(e for e, f in Image.registered_extensions().items() if f in Image.SAVE and e in
                          (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"))
        raise ValueError(f"cannot write a grid as {path.name!r}: unknown image extension {ext or '(none)'!r}; "
                         f"use one of {', '.join(writable)}")
    return fmt
