"""Forward diffusion processes for training, and the epsilon-prediction loss.

One epsilon loss (`eps_prediction_loss`, U-ViT's `LSimple`) serves every diffusion task; the text-to-image task
adds classifier-free-guidance context dropout and latents drawn from stored VAE moments (`text_to_image_loss`).
The validation loss is the same per-sample loss (`eps_losses`) at times stratified over the schedule and noise
drawn per example (`stratified_eps_losses`).

A noise process picks the time, perturbs x_0 and says which timestep value the network embeds (always through
`uvic.schedulers.timesteps.network_timestep`, which the pipelines use too):
- `VPSDENoise`: continuous VP-SDE (U-ViT CIFAR-10, `sde.LSimple`): t ~ U(0, 1), network time 999 t.
- `DiscreteNoise`: DDPM, t ~ U{0..T-1}, network time t + 1 (U-ViT's n in 1..T, as for MS-COCO), so diffusers' stock
  samplers drive the trained model through the pipeline. alpha_bar is `DiscreteSchedule.alphas_cumprod`: U-ViT's
  float64 construction (diffusers' `DDPMScheduler` builds the same betas in float32; they differ by rounding).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from uvic.models.autoencoder import sample_latents
from uvic.schedulers.noise_schedule import SCHEDULE_PRESETS, VPSDE, DiscreteSchedule
from uvic.schedulers.timesteps import network_timestep
from uvic.training.rng import ShardedRNG


class NoiseProcess(Protocol):
    def sample_time(self, rng: ShardedRNG, batch_size: int) -> torch.Tensor: ...

    def time_at(self, q: torch.Tensor) -> torch.Tensor: ...

    def alpha_bar(self, t: torch.Tensor) -> torch.Tensor: ...

    def model_time(self, t: torch.Tensor) -> torch.Tensor: ...


class VPSDENoise:
    """Continuous VP-SDE; `t` is (B,) float in [0, 1)."""

    def __init__(self, sde: VPSDE, time_scale: float = SCHEDULE_PRESETS["vpsde"]["time_scale"]) -> None:
        self.sde = sde
        self.time_scale = time_scale

    def sample_time(self, rng: ShardedRNG, batch_size: int) -> torch.Tensor:
        return rng.rand(batch_size)

    def time_at(self, q: torch.Tensor) -> torch.Tensor:
        """The q-quantile of `sample_time`'s distribution, U(0, 1): q itself."""
        return q

    def alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        return self.sde.alpha_bar(t)

    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        return network_timestep(t, "vpsde", self.time_scale)


class DiscreteNoise:
    """Discrete DDPM; `t` is (B,) int64 in [0, T). alpha_bar is `DiscreteSchedule`'s (float64, as U-ViT builds it)."""

    def __init__(self, num_train_timesteps: int, beta_schedule: str, beta_start: float, beta_end: float) -> None:
        schedule = DiscreteSchedule(num_train_timesteps, beta_start, beta_end, beta_schedule)
        self.alphas_cumprod = schedule.alphas_cumprod  # (T,) float64
        self.num_train_timesteps = num_train_timesteps

    def sample_time(self, rng: ShardedRNG, batch_size: int) -> torch.Tensor:
        return rng.randint(self.num_train_timesteps, batch_size)

    def time_at(self, q: torch.Tensor) -> torch.Tensor:
        """The q-quantile of `sample_time`'s distribution, U{0..T-1}: floor(q T), int64."""
        return (q * self.num_train_timesteps).floor().long().clamp(0, self.num_train_timesteps - 1)

    def alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        return self.alphas_cumprod.to(t.device)[t]

    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        return network_timestep(t, "discrete")


def build_noise_process(diffusion: Any) -> NoiseProcess:
    """The training process for a `uvic.config.DiffusionConfig`."""
    if diffusion.schedule == "vpsde":
        return VPSDENoise(VPSDE(diffusion.beta_min, diffusion.beta_max), diffusion.time_scale)
    if diffusion.schedule == "discrete":
        return DiscreteNoise(
            diffusion.num_train_timesteps, diffusion.beta_schedule, diffusion.beta_start, diffusion.beta_end
        )
    raise ValueError(f"unknown diffusion schedule {diffusion.schedule!r}; expected 'vpsde' or 'discrete'")


def eps_prediction_loss(
    model: torch.nn.Module, x0: torch.Tensor, noise: NoiseProcess, rng: ShardedRNG, **model_kwargs: Any
) -> torch.Tensor:
    """U-ViT's `LSimple`: mean over C, H, W of (eps - eps_hat)^2 per sample, then the mean over the batch.

    Args:
        model: returns an object with `.sample` (B, C, H, W), called as model(x_t, timestep, **model_kwargs).
        x0: (B, C, H, W) clean data in the model's range.
        noise: the forward process.
        rng: the run's sharded generator (time and noise).
    Returns:
        A scalar float32 loss.
    """
    t = noise.sample_time(rng, x0.shape[0])
    eps = rng.randn(*x0.shape).to(x0.dtype)
    return eps_losses(model, x0, t, eps, noise, **model_kwargs).mean()


def eps_losses(model: torch.nn.Module, x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, noise: NoiseProcess,
               **model_kwargs: Any) -> torch.Tensor:
    """Per-sample epsilon loss at given times and noise: mean over C, H, W of (eps - model(x_t, t))^2.

    Args:
        x0: (B, C, H, W) clean data; t: (B,) times of `noise`; eps: (B, C, H, W) the noise of x_t.
    Returns:
        (B,) float32.
    """
    b = x0.shape[0]
    ab = noise.alpha_bar(t).to(torch.float32).view(b, *([1] * (x0.dim() - 1)))
    x_t = ab.sqrt() * x0 + (1.0 - ab).sqrt() * eps
    eps_hat = model(x_t, noise.model_time(t), **model_kwargs).sample
    return (eps - eps_hat.float()).pow(2).flatten(1).mean(1)


def stratified_eps_losses(model: torch.nn.Module, x0: torch.Tensor, noise: NoiseProcess,
                          generators: list[torch.Generator], num_times: int, **model_kwargs: Any) -> torch.Tensor:
    """Per-example epsilon loss averaged over `num_times` = K times spanning the schedule (the validation loss).

    Example b's k-th time is the (k + u_bk) / K quantile of the training distribution of t (stratified sampling:
    one time in each K-quantile), with its own noise; u_b (K,) and then eps_b (K, C, H, W) are drawn on the CPU from
    `generators[b]`, so the value does not depend on the batch it is in.

    Args:
        x0: (B, C, H, W) clean data; generators: B generators, one per example.
    Returns:
        (B,) float32: the mean over the K times of `eps_losses`.
    """
    device = x0.device
    u = torch.stack([torch.rand(num_times, generator=g) for g in generators])  # (B, K)
    eps = torch.stack([torch.randn(num_times, *x0.shape[1:], generator=g) for g in generators])  # (B, K, C, H, W)
    t = noise.time_at((torch.arange(num_times) + u) / num_times).to(device)
    eps = eps.to(device=device, dtype=x0.dtype)
    total = sum(eps_losses(model, x0, t[:, k], eps[:, k], noise, **model_kwargs) for k in range(num_times))
    return total / num_times


def drop_context(context: torch.Tensor, empty_context: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Replace the whole context of the samples where `drop` is True by the empty-caption features.

    Args:
        context: (B, L, D) caption features.
        empty_context: (L, D) or (1, L, D) features of "" (not zeros, not a learned token).
        drop: (B,) bool.
    Returns:
        (B, L, D).
    """
    empty = empty_context.to(device=context.device, dtype=context.dtype).reshape(1, *context.shape[1:])
    return torch.where(drop.to(context.device)[:, None, None], empty, context)


def text_to_image_loss(
    model: torch.nn.Module,
    moments: torch.Tensor,
    context: torch.Tensor,
    empty_context: torch.Tensor,
    noise: NoiseProcess,
    scaling_factor: float,
    rng: ShardedRNG,
    p_uncond: float = 0.1,
) -> torch.Tensor:
    """`eps_prediction_loss` of a text-conditional U-ViT on stored features (U-ViT `LSimple` + `CFGDataset`).

    Args:
        model: called as `model(x_t, timestep, encoder_hidden_states=context)` returning `.sample` (B, C, h, w).
        moments: (B, 2C, h, w) stored VAE moments [mean, logvar]; a latent is drawn from them here.
        context: (B, L, D) caption features.
        empty_context: (L, D) features of the empty caption (the guidance null condition).
        noise: the forward process (U-ViT MS-COCO: `DiscreteNoise` with SD's scaled_linear betas).
        scaling_factor: `vae.config.scaling_factor` (0.23010 for U-ViT MS-COCO).
        rng: source of every random draw (latent, dropout, time, noise), in that order.
        p_uncond: probability of training a sample on the empty context.
    Returns:
        Scalar float32 loss.
    """
    if not 0.0 <= p_uncond <= 1.0:
        raise ValueError(f"p_uncond must be in [0, 1], got {p_uncond}")
    B, two_c, h, w = moments.shape
    device = moments.device
    z0 = sample_latents(moments.float(), scaling_factor, eps=rng.randn(B, two_c // 2, h, w).to(device))
    ctx = drop_context(context, empty_context, rng.rand(B).to(device) < p_uncond)
    return eps_prediction_loss(model, z0, noise, rng, encoder_hidden_states=ctx)
