"""The `Task` protocol, what every training task implements (see the package's docstring), and where a task's
periodic samples go (`sample_path`). The task modules import these from here, so that the package, whose table names
them, is not imported back by them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol


if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, DiffusionPipeline
    from torch import nn
    from torch.utils.data import Dataset

    from uvic.pipelines.sampling import ImageConditions
    from uvic.training.rng import ShardedRNG


class Task(Protocol):
    """The task interface used by `uvic.training.loop.train`, the validation loss and the FID evaluator.

    `makes_images` (a class attribute) says whether the task's model makes images: only then do `load_vae`,
    `pipeline` and `image_conditions` apply (the others raise ValueError) and FID while training is possible.
    """

    makes_images: bool

    def build_model(self) -> nn.Module:
        """A freshly initialised model (float32, on CPU)."""

    def build_dataset(self) -> Dataset:
        """The training set; items are dicts of tensors. With validation on (`train.val_every` > 0) it holds no
        example of `validation_set()`."""

    def validation_set(self) -> Dataset:
        """The held-out examples of the validation loss: the data's test split where it has one, else
        `data.val_fraction` of the data held out by a fixed seed (`uvic.training.validation.hold_out`), the same
        for every run, which `build_dataset` leaves out when validating. Items are `build_dataset`'s, in a fixed
        order (validation scores the first `train.val_examples`)."""

    def validation_split(self) -> str:
        """What `validation_set()` holds, in a few words for the run's records and reports (e.g. "the data's test
        split", "data.val_fraction=0.1 of the data, held out")."""

    def param_groups(self, model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW parameter groups (`{"params": [...], "weight_decay": w}`); every trainable parameter once."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        """Scalar loss of a (per-process) batch; all randomness comes from `rng`."""

    def validation_losses(self, model: nn.Module, batch: dict[str, torch.Tensor],
                          index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example values `{"val_loss": (B,), ...}` of the held-out examples `index` ((B,) int64, positions in
        `validation_set()`), whose items `batch` holds; called without gradients, on the model in eval mode.

        Deterministic: example i's random draws (noise, times, latents) come from
        `uvic.training.validation.example_generators` and nothing else, so a value depends on the weights and the
        example only, not on the batch, the process count or the run's seed; no label or context dropout."""

    def validation_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """The logged metrics of one validation from the means over the held-out set of `validation_losses`'
        values: at least `val_loss`, plus task extras (the LM's `val_ppl`)."""

    def load_vae(self) -> AutoencoderKL | None:
        """The autoencoder of a latent model (its config's `scaling_factor` is the training latent scale, checked
        against the model); None for a pixel-space model. Raises ValueError for a latent model whose autoencoder
        is not configured, and for a task without images."""

    def pipeline(self, model: nn.Module, *, sampler: str | None = None,
                 vae: AutoencoderKL | None = None) -> DiffusionPipeline:
        """The pipeline that samples `model` (not copied). `sampler`: a `uvic.schedulers.SAMPLER_TABLE` name, None
        for the config's `sample.sampler`; `vae`: the autoencoder of a latent model, None for `load_vae()`.
        Raises ValueError for a task whose model has no image pipeline (the LM)."""

    def image_conditions(self, purpose: Literal["grid", "fid"], num_images: int) -> ImageConditions:
        """The conditions of images 0..n-1 of a sample grid or of FID while training (image i comes from seed
        `sample.seed + i`): balanced class labels; class labels with the model's guidance; caption features with
        the empty caption's as the negative and `sample.guidance_scale`. n is `num_images` or, where the task
        has fewer conditions to show (a grid of stored captions), less."""

    def on_sample(self, model: nn.Module, step: int, run_dir: Path) -> Path | None:
        """Periodic qualitative output from the sampling weights (main process only) at `sample_path`, e.g. a
        sample grid. Returns the file written (the loop shows it in the trackers under `samples`), or None when
        nothing was written."""

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """Write the final artefact from the sampling weights (main process only), e.g. a pipeline directory."""


def sample_path(run_dir: str | Path, step: int, suffix: str) -> Path:
    """Where `on_sample` writes the samples of `step`: `run_dir/samples/step_{step:07d}{suffix}`."""
    return Path(run_dir) / "samples" / f"step_{step:07d}{suffix}"
