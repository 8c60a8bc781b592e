"""U-ViT's official DPM-Solver samplers, single-step "fast" (order-3 pattern), on U-ViT's two noise schedules.

U-ViT samples with two versions of the official DPM-Solver code; this one scheduler reproduces both:

  MS-COCO FID (U-ViT `eval_t2i_discrete.py` + `dpm_solver_pp.py`), schedule="discrete" (the default):

    NoiseScheduleVP("discrete", betas=SD scaled_linear betas)   # log alpha piecewise-linear in t on knots n/1000
    DPM_Solver(model_fn, ns, predict_x0=True)                    # DPM-Solver++ (data prediction)
    .sample(x_T, steps=50, eps=1/1000, T=1.0)                    # method "fast", order 3, skip "time_uniform"

  i.e. a *single-step* solver whose order pattern for 50 model evaluations is [3] * 16 + [2], on a grid of 51
  points uniform in continuous time from t = 1 down to t = 1e-3. An order-k step spans k grid intervals and its
  intermediate stages sit (up to the lambda round trip) on the grid points in between, so the network sees the
  fractional times 1000 * t = 1000.0, 980.02, 960.04, ..., 20.98. The result is returned at t = 1e-3 with no
  final denoising step.

  CIFAR-10 training monitor (U-ViT `train.py::eval_step` + `dpm_solver_pytorch.py`), schedule="vpsde":

    NoiseScheduleVP("linear")                                    # beta 0.1 -> 20: log alpha = -t^2 (b1-b0)/4 - t b0/2
    DPM_Solver(model_wrapper(noise_pred, time_input_type="0"))   # DPM-Solver (noise prediction)
    .sample(x_T, steps=50, eps=1e-4, adaptive_step_size=False, fast_version=True)

  DPM-Solver-fast of that code: the same order pattern ([3] * 16 + [2] for 50 NFE), but K + 1 = 18 points
  uniform in lambda (half log-SNR) from t = 1 to t = 1e-4, one per solver step, with each step's stages at the
  lambda fractions 1/3, 2/3 (order 3) or 1/2 (order 2); network time 999 t; no final denoising step.

Everything else (the order pattern, the stage updates) is shared, and both solver forms are available on both
schedules (`algorithm_type` "dpmsolver++" = the official `predict_x0=True`, "dpmsolver" = noise prediction).

This module ports these samplers to a diffusers `SchedulerMixin`: one `step()` call per model evaluation.
`timesteps` hold the time t of each evaluation as the project's other schedulers of the same schedule do, so
`uvic.schedulers.timesteps.network_timestep_for` converts them for the network unchanged: "discrete" follows the
diffusers discrete convention (0-based, `t_diffusers = 1000 * t - 1`, fractional here: 999.0, 979.02, ...; the
network gets `t_diffusers + 1`), "vpsde" holds the continuous t in (0, 1] (the network gets `time_scale * t`).
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


# The official choices per schedule (see the module docstring); `None` config fields resolve to these.
_OFFICIAL = {
    "discrete": {"algorithm_type": "dpmsolver++", "skip_type": "time_uniform", "step_grid": "nfe"},
    "vpsde": {"algorithm_type": "dpmsolver", "skip_type": "logSNR", "step_grid": "solver_steps"},
}
_VPSDE_DEFAULTS = {"beta_min": 0.1, "beta_max": 20.0, "time_scale": 999.0}
_VPSDE_T_END = 1e-4  # the CIFAR-10 monitor's eps
# Configs written by these schedulers describe the continuous VP-SDE (`from_config` selects schedule="vpsde").
_VPSDE_SCHEDULERS = ("VPSDEEulerMaruyamaScheduler", "VPSDEDPMSolverScheduler")


class UViTDPMSolverScheduler(SchedulerMixin, ConfigMixin):
    """Single-step DPM-Solver / DPM-Solver++ ("fast" order schedule), as U-ViT's official code samples.

    Every `step()` consumes one epsilon prediction. Inside an order-k solver step the first k-1 calls return the
    intermediate stage sample (where the model is evaluated next) and the k-th returns the solution at the
    step's end time, so a pipeline drives it with the usual `for t in scheduler.timesteps` loop.

    Fields left at None take the official value of the schedule (MS-COCO for "discrete", CIFAR-10 monitor for
    "vpsde"; see the module docstring).

    Args:
        num_train_timesteps: number of discrete training steps N (knots t_n = n / N, n = 1..N); only `len()`
            for "vpsde".
        beta_start, beta_end, beta_schedule, trained_betas: the discrete schedule, as in diffusers'
            `DDPMScheduler` ("scaled_linear" 0.00085 -> 0.012 is Stable Diffusion's and U-ViT's MS-COCO).
        solver_order: 3 gives the official pattern ([3] * (K - 1) + [2] for NFE % 3 == 2, ...); 2 and 1 are
            the lower-order single-step variants of the same code.
        skip_type: "time_uniform" or "logSNR" spacing of the grid (None: "time_uniform" discrete, "logSNR" vpsde).
        t_end: final continuous time; None means the official eps: 1 / N discrete (network time 1), 1e-4 vpsde.
        prediction_type: only "epsilon" (what U-ViT predicts).
        schedule: "discrete" or "vpsde"; None means "vpsde" when any of beta_min / beta_max / time_scale is
            given (so the VP-SDE schedulers' config and `build_scheduler`'s arguments select it), else "discrete".
        beta_min, beta_max: the linear-beta VP-SDE (None: U-ViT's 0.1 and 20); "vpsde" only.
        time_scale: network time per unit of t (None: 999), read by `uvic.schedulers.timesteps`; "vpsde" only.
        algorithm_type: "dpmsolver++" (data prediction, official `predict_x0=True`) or "dpmsolver" (noise
            prediction); None: "dpmsolver++" discrete, "dpmsolver" vpsde.
        step_grid: "nfe" (NFE + 1 grid points; an order-k step spans k intervals, its stages on the points in
            between: `dpm_solver_pp.py`) or "solver_steps" (one grid interval per solver step, stages at the
            uniform subdivision of the step: `dpm_solver_pytorch.py`'s DPM-Solver-fast); None: "nfe" discrete,
            "solver_steps" vpsde.
    """

    # `from_config` switches to and from these: the same betas config as the diffusers schedulers (discrete), the
    # same VP-SDE config as the project's VP-SDE schedulers (schedule "vpsde").
    _compatibles = [
        "DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler", *_VPSDE_SCHEDULERS,
    ]  # fmt: skip
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
        skip_type: str | None = None,
        t_end: float | None = None,
        prediction_type: str = "epsilon",
        schedule: str | None = None,
        beta_min: float | None = None,
        beta_max: float | None = None,
        time_scale: float | None = None,
        algorithm_type: str | None = None,
        step_grid: str | None = None,
    ) -> None:
        vp_args = {"beta_min": beta_min, "beta_max": beta_max, "time_scale": time_scale}
        vp_given = [k for k, v in vp_args.items() if v is not None]
        if schedule is None:
            schedule = "vpsde" if vp_given else "discrete"
        if schedule not in _OFFICIAL:
            raise ValueError(f"schedule must be 'discrete' or 'vpsde', got {schedule!r}")
        if schedule == "discrete" and vp_given:
            raise ValueError(f"{vp_given} describe the continuous VP-SDE; they do not apply to schedule='discrete'")
        official = _OFFICIAL[schedule]
        algorithm_type = official["algorithm_type"] if algorithm_type is None else algorithm_type
        skip_type = official["skip_type"] if skip_type is None else skip_type
        step_grid = official["step_grid"] if step_grid is None else step_grid
        if solver_order not in (1, 2, 3):
            raise ValueError(f"solver_order must be 1, 2 or 3, got {solver_order}")
        if skip_type not in ("time_uniform", "logSNR"):
            raise ValueError(f"skip_type must be 'time_uniform' or 'logSNR', got {skip_type!r}")
        if algorithm_type not in ("dpmsolver++", "dpmsolver"):
            raise ValueError(f"algorithm_type must be 'dpmsolver++' or 'dpmsolver', got {algorithm_type!r}")
        if step_grid not in ("nfe", "solver_steps"):
            raise ValueError(f"step_grid must be 'nfe' or 'solver_steps', got {step_grid!r}")
        if prediction_type != "epsilon":
            raise ValueError(f"only prediction_type='epsilon' is supported, got {prediction_type!r}")
        resolved = {
            "schedule": schedule, "algorithm_type": algorithm_type, "skip_type": skip_type, "step_grid": step_grid,
        }  # fmt: skip

        if schedule == "discrete":
            if trained_betas is not None:
                betas = torch.tensor(trained_betas, dtype=torch.float64)
            elif beta_schedule == "scaled_linear":
                # Same float64 construction as U-ViT's `stable_diffusion_beta_schedule`.
                betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64) ** 2
            elif beta_schedule == "linear":
                betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)
            else:
                raise ValueError(f"unsupported beta_schedule {beta_schedule!r}; expected 'scaled_linear' or 'linear'")
            n = betas.numel()
            self.betas = betas.float()
            self.alphas_cumprod = torch.cumprod(1.0 - betas, 0).float()
            # Knots of the continuous-time extension: t_n = n / N, log alpha_n = 0.5 * sum_{i<=n} log(1 - beta_i).
            self._t_knots = torch.linspace(1.0 / n, 1.0, n, dtype=torch.float64)
            self._log_alpha_knots = 0.5 * torch.log(1.0 - betas).cumsum(0)
        else:
            vp = {k: _VPSDE_DEFAULTS[k] if v is None else float(v) for k, v in vp_args.items()}
            if not 0 <= vp["beta_min"] < vp["beta_max"]:
                raise ValueError(f"need 0 <= beta_min < beta_max, got {vp['beta_min']} and {vp['beta_max']}")
            resolved |= vp
            self.betas = self.alphas_cumprod = None  # no discrete steps: the forward process is continuous in t
        self.register_to_config(**resolved)

        self.init_noise_sigma = 1.0
        self.num_inference_steps: int | None = None
        self.timesteps = torch.empty(0)
        self._steps: list[_Step] = []
        self._stages: list[tuple[int, int]] = []
        self._step_index: int | None = None
        self._begin_index: int | None = None
        self._x_s: torch.Tensor | None = None
        self._outs: list[torch.Tensor] = []

    @classmethod
    def from_config(cls, config=None, return_unused_kwargs: bool = False, **kwargs):
        """diffusers `from_config`; a VP-SDE scheduler's config (it has `beta_min` and no `schedule`) selects
        schedule="vpsde" with its beta_min / beta_max / time_scale, defaulted or not (its `t_eps` is its own end
        time, not this solver's `t_end`)."""
        if isinstance(config, dict) and "schedule" not in config and (
            "beta_min" in config or config.get("_class_name") in _VPSDE_SCHEDULERS
        ):
            config = {k: v for k, v in config.items() if k not in ("t_eps", "_use_default_values")}
            kwargs.setdefault("schedule", "vpsde")
        return super().from_config(config, return_unused_kwargs=return_unused_kwargs, **kwargs)

    # ------------------------------------------------------------------------------------------------------
    # Continuous-time noise schedule (official NoiseScheduleVP "discrete" or "linear"), float64 on CPU.
    # ------------------------------------------------------------------------------------------------------

    def _log_alpha(self, t: torch.Tensor) -> torch.Tensor:
        """log alpha_t (the official `marginal_log_mean_coeff`)."""
        if self.config.schedule == "vpsde":
            b0, b1 = self.config.beta_min, self.config.beta_max
            return -0.25 * t**2 * (b1 - b0) - 0.5 * t * b0
        return _interp(t, self._t_knots, self._log_alpha_knots)

    def _lambda(self, t: torch.Tensor) -> torch.Tensor:
        """Half log-SNR: log(alpha_t) - log(sigma_t)."""
        log_alpha = self._log_alpha(t)
        return log_alpha - 0.5 * torch.log(-torch.expm1(2.0 * log_alpha))

    def _inverse_lambda(self, lam: torch.Tensor) -> torch.Tensor:
        if self.config.schedule == "vpsde":
            # The official closed form: the positive root of (b1 - b0) t^2 / 4 + b0 t / 2 = log(1 + e^(-2 lambda)) / 2.
            b0, b1 = self.config.beta_min, self.config.beta_max
            tmp = 2.0 * (b1 - b0) * torch.logaddexp(-2.0 * lam, torch.zeros_like(lam))
            return tmp / (torch.sqrt(b0**2 + tmp) + b0) / (b1 - b0)
        log_alpha = -0.5 * torch.logaddexp(torch.zeros_like(lam), -2.0 * lam)
        return _interp(log_alpha, self._log_alpha_knots.flip(0), self._t_knots.flip(0))

    def _alpha_sigma(self, t: float) -> tuple[float, float]:
        log_alpha = self._log_alpha(torch.tensor([t], dtype=torch.float64))
        return math.exp(log_alpha.item()), math.sqrt(-math.expm1(2.0 * log_alpha.item()))

    def _grid(self, t_start: float, t_end: float, n: int) -> torch.Tensor:
        """(n + 1,) float64 times from t_start to t_end, uniform in t or in lambda (`skip_type`)."""
        if self.config.skip_type == "time_uniform":
            return torch.linspace(t_start, t_end, n + 1, dtype=torch.float64)
        lam = torch.linspace(
            self._lambda(torch.tensor([t_start], dtype=torch.float64)).item(),
            self._lambda(torch.tensor([t_end], dtype=torch.float64)).item(),
            n + 1,
            dtype=torch.float64,
        )
        return self._inverse_lambda(lam)

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
        cfg = self.config
        vpsde = cfg.schedule == "vpsde"
        n = cfg.num_train_timesteps
        default_end = _VPSDE_T_END if vpsde else 1.0 / n
        t_start, t_end = 1.0, cfg.t_end if cfg.t_end is not None else default_end
        orders = self.fast_orders(num_inference_steps, cfg.solver_order)

        self._steps, self._stages = [], []
        if cfg.step_grid == "nfe":
            # `dpm_solver_pp.py`: `steps` (= NFE) intervals even though it takes fewer solver steps.
            grid = self._grid(t_start, t_end, num_inference_steps)
            lam_grid = self._lambda(grid)
            i = 0
            for order in orders:
                h = (lam_grid[i + order] - lam_grid[i]).item()
                r1 = (lam_grid[i + 1] - lam_grid[i]).item() / h if order >= 2 else None
                r2 = (lam_grid[i + 2] - lam_grid[i]).item() / h if order >= 3 else None
                self._add_step(order, grid[i].item(), grid[i + order].item(), lam_grid[i].item(), h, r1, r2)
                i += order
        else:
            # `dpm_solver_pytorch.py` DPM-Solver-fast: one interval per solver step, its stages subdividing it.
            outer = self._grid(t_start, t_end, len(orders))
            lam_outer = self._lambda(outer)
            for m, order in enumerate(orders):
                s, t, lam_s = outer[m].item(), outer[m + 1].item(), lam_outer[m].item()
                h = lam_outer[m + 1].item() - lam_s
                if cfg.skip_type == "logSNR":  # the official r1 = 1/3, r2 = 2/3 (order 3) or r1 = 1/2 (order 2)
                    rs = [j / order for j in range(1, order)]
                else:
                    inner = self._lambda(torch.linspace(s, t, order + 1, dtype=torch.float64))
                    rs = [(inner[j].item() - lam_s) / h for j in range(1, order)]
                rs += [None] * (2 - len(rs))
                self._add_step(order, s, t, lam_s, h, rs[0], rs[1])

        stage_times = torch.tensor([self._steps[m].times[j] for m, j in self._stages], dtype=torch.float64)
        # vpsde: continuous t (network time_scale * t); discrete: diffusers' 0-based step 1000 t - 1.
        timesteps = stage_times if vpsde else stage_times * n - 1.0
        self.timesteps = timesteps.to(device=device, dtype=torch.float32)
        self.num_inference_steps = num_inference_steps
        self._step_index, self._begin_index = None, None
        self._x_s, self._outs = None, []

    def _add_step(self, order: int, s: float, t: float, lam_s: float, h: float, r1: float | None,
                  r2: float | None) -> None:  # fmt: skip
        times = [s]
        # Intermediate stages at lambda_s + r * h, mapped back to time as the official solver does.
        for r in (r1, r2)[: order - 1]:
            times.append(self._inverse_lambda(torch.tensor([lam_s + r * h], dtype=torch.float64)).item())
        self._steps.append(_Step(order=order, times=tuple(times), t=t, r1=r1, r2=r2))
        self._stages.extend((len(self._steps) - 1, j) for j in range(order))

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
        """One model evaluation of the solver.

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
            self._x_s, self._outs = sample, []

        work = torch.promote_types(sample.dtype, torch.float32)  # the solver's arithmetic, in >= float32
        if self.config.algorithm_type == "dpmsolver++":
            # Data prediction at this stage: x0 = (x - sigma * eps) / alpha.
            alpha, sigma = self._alpha_sigma(st.times[j])
            self._outs.append((sample.to(work) - sigma * model_output.to(work)) / alpha)
            prev = self._advance(st, j)
        else:
            self._outs.append(model_output.to(work))
            prev = self._advance_noise(st, j)
        self._step_index += 1
        prev = prev.to(sample.dtype)
        if not return_dict:
            return (prev,)
        return SchedulerOutput(prev_sample=prev)

    def _advance(self, st: _Step, j: int) -> torch.Tensor:
        """DPM-Solver++: the next sample after stage j of `st` (official dpm_solver_{first,second,third}_update
        with predict_x0=True)."""
        lam = lambda u: self._lambda(torch.tensor([u], dtype=torch.float64)).item()  # noqa: E731
        s = st.times[0]
        h = lam(st.t) - lam(s)
        _, sigma_s = self._alpha_sigma(s)
        x, x0 = self._x_s.to(self._outs[0].dtype), self._outs
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

    def _advance_noise(self, st: _Step, j: int) -> torch.Tensor:
        """DPM-Solver (noise prediction): the next sample after stage j of `st` (official
        dpm_solver_{first,second,third}_update with predict_x0=False, Lu et al. 2022 Alg. 1 and 2)."""
        lam = lambda u: self._lambda(torch.tensor([u], dtype=torch.float64)).item()  # noqa: E731
        log_alpha = lambda u: self._log_alpha(torch.tensor([u], dtype=torch.float64)).item()  # noqa: E731
        s = st.times[0]
        h = lam(st.t) - lam(s)
        x, eps = self._x_s.to(self._outs[0].dtype), self._outs
        u = st.t if j == st.order - 1 else st.times[j + 1]  # where this call's result lives
        ratio = math.exp(log_alpha(u) - log_alpha(s))  # alpha_u / alpha_s
        _, sigma_u = self._alpha_sigma(u)
        if j == st.order - 1:  # the step's solution at t
            phi_1 = math.expm1(h)
            out = ratio * x - (sigma_u * phi_1) * eps[0]
            if st.order == 2:
                out = out - (0.5 / st.r1) * (sigma_u * phi_1) * (eps[1] - eps[0])
            elif st.order == 3:
                phi_2 = phi_1 / h - 1.0
                out = out - (1.0 / st.r2) * (sigma_u * phi_2) * (eps[2] - eps[0])
            return out
        if j == 0:  # first-order prediction of the stage-1 sample
            return ratio * x - (sigma_u * math.expm1(st.r1 * h)) * eps[0]
        # j == 1 inside an order-3 step: the stage-2 sample uses eps at s and s1
        phi_12 = math.expm1(st.r2 * h)
        phi_22 = phi_12 / (st.r2 * h) - 1.0
        return ratio * x - (sigma_u * phi_12) * eps[0] - (st.r2 / st.r1) * (sigma_u * phi_22) * (eps[1] - eps[0])

    def add_noise(
        self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """Forward process alpha_t x0 + sigma_t noise at (B,) timesteps in this scheduler's convention: integer
        diffusers steps ("discrete", alpha_t^2 = alphas_cumprod[t]) or continuous t ("vpsde")."""
        if self.config.schedule == "vpsde":
            log_alpha = self._log_alpha(timesteps.detach().to("cpu", torch.float64))
            alpha, sigma = log_alpha.exp(), torch.sqrt(-torch.expm1(2.0 * log_alpha))
            shape = (-1, *([1] * (original_samples.dim() - 1)))
            alpha = alpha.to(original_samples.device, original_samples.dtype).view(shape)
            sigma = sigma.to(original_samples.device, original_samples.dtype).view(shape)
            return alpha * original_samples + sigma * noise
        abar = self.alphas_cumprod.to(device=original_samples.device)[timesteps.long()].to(original_samples.dtype)
        abar = abar.view(-1, *([1] * (original_samples.dim() - 1)))
        return abar.sqrt() * original_samples + (1.0 - abar).sqrt() * noise

    def __len__(self) -> int:
        return self.config.num_train_timesteps
