"""DPM-Solver++ exactly as U-ViT samples MS-COCO (`dpm_solver_pp.py`, `DPM_Solver.sample(method="fast")`).

The official text-to-image FID protocol (U-ViT `eval_t2i_discrete.py`, reference doc Sec. 2.2) runs:

    NoiseScheduleVP("discrete", betas=SD scaled_linear betas)   # log alpha piecewise-linear in t on knots n/1000
    DPM_Solver(model_fn, ns, predict_x0=True)                    # DPM-Solver++ (data prediction)
    .sample(x_T, steps=50, eps=1/1000, T=1.0)                    # method "fast", order 3, skip "time_uniform"

i.e. a *single-step* solver whose order pattern for 50 model evaluations is [3] * 16 + [2], on a grid of 51
points uniform in continuous time from t = 1 down to t = 1e-3. An order-k step spans k grid intervals and its
intermediate stages sit (up to the lambda round trip) on the grid points in between, so the network sees the
fractional times 1000 * t = 1000.0, 980.02, 960.04, ..., 20.98. The result is returned at t = 1e-3 with no
final denoising step.

This module ports that sampler to a diffusers `SchedulerMixin`: one `step()` call per model evaluation.
`timesteps` follow the diffusers discrete convention (0-based, `t_diffusers = 1000 * t - 1`, fractional here:
999.0, 979.02, ...); the network input of the U-ViT MS-COCO model is `t_diffusers + 1` (reference doc Sec. 2.2,
"U-ViT timestep = diffusers timestep + 1"), applied by the pipeline, like for every other diffusers scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin, SchedulerOutput


__all__ = ["UViTDPMSolverScheduler"]


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation on increasing knots `xp`, extended linearly past both ends (as the
    official `interpolate_fn`). All tensors 1-D."""
    idx = torch.searchsorted(xp, x).clamp(1, xp.numel() - 1)
    x0, x1, y0, y1 = xp[idx - 1], xp[idx], fp[idx - 1], fp[idx]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


@dataclass(frozen=True)
class _Step:
    """One solver step (an order-k macro step) from time s to time t, with its intermediate stages."""

    order: int
    times: tuple[float, ...]  # continuous stage times (s, s1, s2)[:order]
    t: float  # continuous end time
    r1: float | None
    r2: float | None


class UViTDPMSolverScheduler(SchedulerMixin, ConfigMixin):
    """Single-step DPM-Solver++ ("fast" order schedule) on the continuous-time extension of a discrete schedule.

    Every `step()` consumes one epsilon prediction. Inside an order-k solver step the first k-1 calls return the
    intermediate stage sample (where the model is evaluated next) and the k-th returns the solution at the
    step's end time, so a pipeline drives it with the usual `for t in scheduler.timesteps` loop.

    Args:
        num_train_timesteps: number of discrete training steps N (knots t_n = n / N, n = 1..N).
        beta_start, beta_end, beta_schedule, trained_betas: the discrete schedule, as in diffusers'
            `DDPMScheduler` ("scaled_linear" 0.00085 -> 0.012 is Stable Diffusion's and U-ViT's MS-COCO).
        solver_order: 3 gives the official pattern ([3] * (K - 1) + [2] for NFE % 3 == 2, ...); 2 and 1 are
            the lower-order single-step variants of the same code.
        skip_type: "time_uniform" (official) or "logSNR" spacing of the grid.
        t_end: final continuous time; None means 1 / N (the official `eps=1/N`, i.e. network time 1).
        prediction_type: only "epsilon" (what U-ViT predicts).
    """

    # Same betas config as these diffusers schedulers, so `from_config` switches between them.
    _compatibles = ["DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler"]
    order = 1  # one model evaluation per `step()` call (diffusers uses this for progress-bar bookkeeping)

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_start: float = 0.00085,
        beta_end: float = 0.012,
        beta_schedule: str = "scaled_linear",
        trained_betas: list[float] | None = None,
        solver_order: int = 3,
        skip_type: str = "time_uniform",
        t_end: float | None = None,
        prediction_type: str = "epsilon",
    ) -> None:
        if trained_betas is not None:
            betas = torch.tensor(trained_betas, dtype=torch.float64)
        elif beta_schedule == "scaled_linear":
            # Same float64 construction as U-ViT's `stable_diffusion_beta_schedule`.
            betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64) ** 2
        elif beta_schedule == "linear":
            betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)
        else:
            raise ValueError(f"unsupported beta_schedule {beta_schedule!r}; expected 'scaled_linear' or 'linear'")
        if solver_order not in (1, 2, 3):
            raise ValueError(f"solver_order must be 1, 2 or 3, got {solver_order}")
        if skip_type not in ("time_uniform", "logSNR"):
            raise ValueError(f"skip_type must be 'time_uniform' or 'logSNR', got {skip_type!r}")
        if prediction_type != "epsilon":
            raise ValueError(f"only prediction_type='epsilon' is supported, got {prediction_type!r}")
        n = betas.numel()
        self.betas = betas.float()
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0).float()
        # Knots of the continuous-time extension: t_n = n / N, log alpha_n = 0.5 * sum_{i<=n} log(1 - beta_i).
        self._t_knots = torch.linspace(1.0 / n, 1.0, n, dtype=torch.float64)
        self._log_alpha_knots = 0.5 * torch.log(1.0 - betas).cumsum(0)
        self.init_noise_sigma = 1.0
        self.num_inference_steps: int | None = None
        self.timesteps = torch.empty(0)
        self._steps: list[_Step] = []
        self._stages: list[tuple[int, int]] = []
        self._step_index: int | None = None
        self._begin_index: int | None = None
        self._x_s: torch.Tensor | None = None
        self._x0s: list[torch.Tensor] = []

    # ------------------------------------------------------------------------------------------------------
    # Continuous-time noise schedule (official NoiseScheduleVP("discrete")), float64 on CPU.
    # ------------------------------------------------------------------------------------------------------

    def _log_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return _interp(t, self._t_knots, self._log_alpha_knots)

    def _lambda(self, t: torch.Tensor) -> torch.Tensor:
        """Half log-SNR: log(alpha_t) - log(sigma_t)."""
        log_alpha = self._log_alpha(t)
        return log_alpha - 0.5 * torch.log(-torch.expm1(2.0 * log_alpha))

    def _inverse_lambda(self, lam: torch.Tensor) -> torch.Tensor:
        log_alpha = -0.5 * torch.logaddexp(torch.zeros_like(lam), -2.0 * lam)
        return _interp(log_alpha, self._log_alpha_knots.flip(0), self._t_knots.flip(0))

    def _alpha_sigma(self, t: float) -> tuple[float, float]:
        log_alpha = self._log_alpha(torch.tensor([t], dtype=torch.float64))
        return math.exp(log_alpha.item()), math.sqrt(-math.expm1(2.0 * log_alpha.item()))

    # ------------------------------------------------------------------------------------------------------
    # Public scheduler API
    # ------------------------------------------------------------------------------------------------------

    @staticmethod
    def fast_orders(nfe: int, solver_order: int = 3) -> list[int]:
        """Order of each solver step for `nfe` model evaluations (official `get_time_steps_for_dpm_solver_fast`).

        For order 3: K = nfe // 3 + 1 steps, ending in [2, 1], [1] or [2] for nfe % 3 == 0, 1, 2 (50 -> [3]*16+[2]).
        """
        if nfe < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {nfe}")
        if solver_order == 3:
            k = nfe // 3 + 1
            tail = {0: [2, 1], 1: [1], 2: [2]}[nfe % 3]
            return [3] * (k - len(tail)) + tail
        if solver_order == 2:
            return [2] * (nfe // 2) + [1] * (nfe % 2)
        return [1] * nfe

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """Build the grid, the order pattern and the per-evaluation timesteps for `num_inference_steps` NFE."""
        n = self.config.num_train_timesteps
        t_start, t_end = 1.0, self.config.t_end if self.config.t_end is not None else 1.0 / n
        orders = self.fast_orders(num_inference_steps, self.config.solver_order)
        # The official "fast" method spaces `steps` (= NFE) intervals even though it takes fewer solver steps.
        if self.config.skip_type == "time_uniform":
            grid = torch.linspace(t_start, t_end, num_inference_steps + 1, dtype=torch.float64)
        else:
            lam = torch.linspace(
                self._lambda(torch.tensor([t_start], dtype=torch.float64)).item(),
                self._lambda(torch.tensor([t_end], dtype=torch.float64)).item(),
                num_inference_steps + 1,
                dtype=torch.float64,
            )
            grid = self._inverse_lambda(lam)
        lam_grid = self._lambda(grid)

        self._steps, self._stages, i = [], [], 0
        for order in orders:
            s, t = grid[i].item(), grid[i + order].item()
            h = (lam_grid[i + order] - lam_grid[i]).item()
            r1 = (lam_grid[i + 1] - lam_grid[i]).item() / h if order >= 2 else None
            r2 = (lam_grid[i + 2] - lam_grid[i]).item() / h if order >= 3 else None
            times = [s]
            # Intermediate stages at lambda_s + r * h, mapped back to time as the official solver does.
            for r in (r1, r2)[: order - 1]:
                times.append(self._inverse_lambda(torch.tensor([lam_grid[i].item() + r * h], dtype=torch.float64)).item())
            self._steps.append(_Step(order=order, times=tuple(times), t=t, r1=r1, r2=r2))
            self._stages.extend((len(self._steps) - 1, j) for j in range(order))
            i += order

        stage_times = torch.tensor([self._steps[m].times[j] for m, j in self._stages], dtype=torch.float64)
        self.timesteps = (stage_times * n - 1.0).to(device=device, dtype=torch.float32)
        self.num_inference_steps = num_inference_steps
        self._step_index, self._begin_index = None, None
        self._x_s, self._x0s = None, []

    @property
    def step_index(self) -> int | None:
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start at evaluation `begin_index` (must be the first stage of a solver step)."""
        self._begin_index = begin_index

    @property
    def solver_orders(self) -> list[int]:
        """Order of each solver step of the current schedule."""
        return [s.order for s in self._steps]

    def scale_model_input(self, sample: torch.Tensor, timestep: float | torch.Tensor | None = None) -> torch.Tensor:
        return sample

    def _index_for_timestep(self, timestep: float | torch.Tensor) -> int:
        ts = self.timesteps.to(torch.float64).cpu()
        value = torch.as_tensor(timestep, dtype=torch.float64).flatten()[0].cpu()
        return int(torch.argmin((ts - value).abs()))

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,
        return_dict: bool = True,
    ) -> SchedulerOutput | tuple[torch.Tensor]:
        """One model evaluation of DPM-Solver++.

        Args:
            model_output: (B, C, H, W) epsilon predicted at `sample` and `timestep` (guidance already applied).
            timestep: the current entry of `self.timesteps`.
            sample: (B, C, H, W) the sample the model was evaluated at.
            generator: unused (the solver is deterministic); accepted for diffusers compatibility.
        Returns:
            SchedulerOutput whose `prev_sample` (B, C, H, W) is where the model is evaluated next (the solution
            at t_end after the last call).
        """
        if self.num_inference_steps is None:
            raise ValueError("call `set_timesteps(num_inference_steps)` before `step()`")
        if self._step_index is None:
            self._step_index = self._begin_index if self._begin_index is not None else self._index_for_timestep(timestep)
        if self._step_index >= len(self._stages):
            raise ValueError(f"step() called more than num_inference_steps={self.num_inference_steps} times")
        m, j = self._stages[self._step_index]
        st = self._steps[m]
        if j == 0:
            self._x_s, self._x0s = sample, []

        # Data prediction at this stage (DPM-Solver++): x0 = (x - sigma * eps) / alpha, computed in >= float32.
        work = torch.promote_types(sample.dtype, torch.float32)
        alpha, sigma = self._alpha_sigma(st.times[j])
        self._x0s.append((sample.to(work) - sigma * model_output.to(work)) / alpha)

        prev = self._advance(st, j)
        self._step_index += 1
        prev = prev.to(sample.dtype)
        if not return_dict:
            return (prev,)
        return SchedulerOutput(prev_sample=prev)

    def _advance(self, st: _Step, j: int) -> torch.Tensor:
        """The next sample after stage j of solver step `st` (official dpm_solver_{first,second,third}_update)."""
        lam = lambda u: self._lambda(torch.tensor([u], dtype=torch.float64)).item()  # noqa: E731
        s = st.times[0]
        h = lam(st.t) - lam(s)
        _, sigma_s = self._alpha_sigma(s)
        x, x0 = self._x_s.to(self._x0s[0].dtype), self._x0s
        final = j == st.order - 1
        if final:
            alpha_t, sigma_t = self._alpha_sigma(st.t)
            phi_1 = math.expm1(-h)
            out = (sigma_t / sigma_s) * x - (alpha_t * phi_1) * x0[0]
            if st.order == 2:
                out = out - (0.5 / st.r1) * (alpha_t * phi_1) * (x0[1] - x0[0])
            elif st.order == 3:
                phi_2 = phi_1 / h + 1.0
                out = out + (1.0 / st.r2) * (alpha_t * phi_2) * (x0[2] - x0[0])
            return out
        if j == 0:  # first-order prediction of the stage-1 sample
            alpha_1, sigma_1 = self._alpha_sigma(st.times[1])
            return (sigma_1 / sigma_s) * x - (alpha_1 * math.expm1(-st.r1 * h)) * x0[0]
        # j == 1 inside an order-3 step: the stage-2 sample uses x0 at s and s1
        alpha_2, sigma_2 = self._alpha_sigma(st.times[2])
        phi_12 = math.expm1(-st.r2 * h)
        phi_22 = phi_12 / (st.r2 * h) + 1.0
        return (
            (sigma_2 / sigma_s) * x
            - (alpha_2 * phi_12) * x0[0]
            + (st.r2 / st.r1) * (alpha_2 * phi_22) * (x0[1] - x0[0])
        )

    def add_noise(
        self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """Forward process at integer diffusers timesteps (B,): sqrt(abar) x0 + sqrt(1 - abar) noise."""
        abar = self.alphas_cumprod.to(device=original_samples.device)[timesteps.long()].to(original_samples.dtype)
        abar = abar.view(-1, *([1] * (original_samples.dim() - 1)))
        return abar.sqrt() * original_samples + (1.0 - abar).sqrt() * noise

    def __len__(self) -> int:
        return self.config.num_train_timesteps
