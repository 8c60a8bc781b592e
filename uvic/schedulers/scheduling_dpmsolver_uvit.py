"""U-ViT's official single-step DPM-Solver ("fast" order pattern), as diffusers schedulers.

U-ViT samples with two versions of the official DPM-Solver code, one per kind of model; each is a scheduler here,
and both run the same solver (`_SingleStepDPMSolver`: order pattern, stage updates) on their noise schedule
(`uvic.schedulers.noise_schedule`):

  `UViTDPMSolverScheduler`, MS-COCO FID (U-ViT `eval_t2i_discrete.py` + `dpm_solver_pp.py`):

    NoiseScheduleVP("discrete", betas=SD scaled_linear betas)   # log alpha piecewise-linear in t on knots n/1000
    DPM_Solver(model_fn, ns, predict_x0=True)                    # DPM-Solver++ (data prediction)
    .sample(x_T, steps=50, eps=1/1000, T=1.0)                    # method "fast", order 3, skip "time_uniform"

  i.e. a *single-step* solver whose order pattern for 50 model evaluations is [3] * 16 + [2], on a grid of 51
  points uniform in continuous time from t = 1 down to t = 1e-3. An order-k step spans k grid intervals and its
  intermediate stages sit (up to the lambda round trip) on the grid points in between, so the network sees the
  fractional times 1000 * t = 1000.0, 980.02, 960.04, ..., 20.98. The result is returned at t = 1e-3 with no
  final denoising step.

  `VPSDEDPMSolverFastScheduler`, CIFAR-10 training monitor (U-ViT `train.py::eval_step` + `dpm_solver_pytorch.py`):

    NoiseScheduleVP("linear")                                    # beta 0.1 -> 20, the VP-SDE
    DPM_Solver(model_wrapper(noise_pred, time_input_type="0"))   # DPM-Solver (noise prediction)
    .sample(x_T, steps=50, eps=1e-4, adaptive_step_size=False, fast_version=True)

  DPM-Solver-fast of that code: the same order pattern ([3] * 16 + [2] for 50 NFE), but K + 1 = 18 points
  uniform in lambda (half log-SNR) from t = 1 to t = 1e-4, one per solver step, with each step's stages at the
  lambda fractions 1/3, 2/3 (order 3) or 1/2 (order 2); network time 999 t; no final denoising step.

Both take `algorithm_type` "dpmsolver++" (the official `predict_x0=True`) or "dpmsolver" (noise prediction).
One `step()` call is one model evaluation. `timesteps` hold the time of each evaluation as the other schedulers of
the same schedule do, so `uvic.schedulers.timesteps.network_timestep_for` converts them for the network
unchanged: diffusers' 0-based discrete steps (`t_diffusers = 1000 t - 1`, fractional here: 999.0, 979.02, ...;
the network gets `t_diffusers + 1`), or the continuous t in (0, 1] of the VP-SDE (the network gets 999 t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin, SchedulerOutput

from uvic.schedulers.noise_schedule import SCHEDULE_PRESETS, DiscreteSchedule, NoiseSchedule
from uvic.schedulers.scheduling_vpsde import _VPSDESchedulerBase


_VP, _SD = SCHEDULE_PRESETS["vpsde"], SCHEDULE_PRESETS["stable-diffusion"]


__all__ = ["UViTDPMSolverScheduler", "VPSDEDPMSolverFastScheduler"]


@dataclass(frozen=True)
class _Step:
    """One solver step (an order-k macro step) from time s to time t, with its intermediate stages."""

    order: int
    times: tuple[float, ...]  # continuous stage times (s, s1, s2)[:order]
    t: float  # continuous end time
    r1: float | None
    r2: float | None


class _SingleStepDPMSolver:
    """The official single-step DPM-Solver / DPM-Solver++ with the "fast" order pattern, on `self.noise_schedule`.

    A scheduler class mixes it in, sets `noise_schedule`, calls `_check_solver` from its `__init__`, `_plan`
    from `set_timesteps` (with its own grid rule, `_plan_grid`) and `_solve` once per model evaluation. Its config
    holds `solver_order`, `skip_type` and `algorithm_type`. The schedule arithmetic is float64 on the CPU.
    """

    noise_schedule: NoiseSchedule

    @staticmethod
    def _check_solver(solver_order: int, skip_type: str, algorithm_type: str, prediction_type: str) -> None:
        if solver_order not in (1, 2, 3):
            raise ValueError(f"solver_order must be 1, 2 or 3, got {solver_order}")
        if skip_type not in ("time_uniform", "logSNR"):
            raise ValueError(f"skip_type must be 'time_uniform' or 'logSNR', got {skip_type!r}")
        if algorithm_type not in ("dpmsolver++", "dpmsolver"):
            raise ValueError(f"algorithm_type must be 'dpmsolver++' or 'dpmsolver', got {algorithm_type!r}")
        if prediction_type != "epsilon":
            raise ValueError(f"only prediction_type='epsilon' is supported, got {prediction_type!r}")

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

    @property
    def solver_orders(self) -> list[int]:
        """Order of each solver step of the current schedule."""
        return [s.order for s in self._steps]

    # Schedule values at one time, as python floats.
    def _log_alpha(self, t: float) -> float:
        """log alpha_t (the official `marginal_log_mean_coeff`)."""
        return 0.5 * self.noise_schedule.log_alpha_bar(torch.tensor([t], dtype=torch.float64)).item()

    def _lambda(self, t: float) -> float:
        return self.noise_schedule.lambda_(torch.tensor([t], dtype=torch.float64)).item()

    def _alpha_sigma(self, t: float) -> tuple[float, float]:
        log_alpha = self._log_alpha(t)
        return math.exp(log_alpha), math.sqrt(-math.expm1(2.0 * log_alpha))

    def _solver_grid(self, t_start: float, t_end: float, n: int) -> torch.Tensor:
        """(n + 1,) float64 times from t_start to t_end, uniform in t or in lambda (`skip_type`)."""
        if self.config.skip_type == "time_uniform":
            return torch.linspace(t_start, t_end, n + 1, dtype=torch.float64)
        lam = torch.linspace(self._lambda(t_start), self._lambda(t_end), n + 1, dtype=torch.float64)
        return self.noise_schedule.t_from_lambda(lam)

    def _plan(self, nfe: int, t_end: float) -> torch.Tensor:
        """Plan the solver steps for `nfe` evaluations from t = 1 to `t_end`; returns the (nfe,) float64 stage
        times, one per model evaluation, and resets the stage state."""
        self._steps: list[_Step] = []
        self._stages: list[tuple[int, int]] = []
        self._plan_grid(self.fast_orders(nfe, self.config.solver_order), nfe, 1.0, t_end)
        self._x_s, self._outs = None, []
        return torch.tensor([self._steps[m].times[j] for m, j in self._stages], dtype=torch.float64)

    def _plan_grid(self, orders: list[int], nfe: int, t_start: float, t_end: float) -> None:
        """Place the solver steps of `orders` between t_start and t_end (`_add_step` for each)."""
        raise NotImplementedError

    def _add_step(self, order: int, s: float, t: float, lam_s: float, h: float, r1: float | None,
                  r2: float | None) -> None:
        times = [s]
        # Intermediate stages at lambda_s + r * h, mapped back to time as the official solver does.
        for r in (r1, r2)[: order - 1]:
            times.append(self.noise_schedule.t_from_lambda(torch.tensor([lam_s + r * h], dtype=torch.float64)).item())
        self._steps.append(_Step(order=order, times=tuple(times), t=t, r1=r1, r2=r2))
        self._stages.extend((len(self._steps) - 1, j) for j in range(order))

    def _solve(self, index: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Model evaluation number `index`: eps at `sample` -> where the model is evaluated next (the solution at
        the step's end after its last stage), in the sample's dtype."""
        m, j = self._stages[index]
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
        return prev.to(sample.dtype)

    def _advance(self, st: _Step, j: int) -> torch.Tensor:
        """DPM-Solver++: the next sample after stage j of `st` (official dpm_solver_{first,second,third}_update
        with predict_x0=True)."""
        s = st.times[0]
        h = self._lambda(st.t) - self._lambda(s)
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
        s = st.times[0]
        h = self._lambda(st.t) - self._lambda(s)
        x, eps = self._x_s.to(self._outs[0].dtype), self._outs
        u = st.t if j == st.order - 1 else st.times[j + 1]  # where this call's result lives
        ratio = math.exp(self._log_alpha(u) - self._log_alpha(s))  # alpha_u / alpha_s
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


class UViTDPMSolverScheduler(_SingleStepDPMSolver, SchedulerMixin, ConfigMixin):
    """U-ViT's MS-COCO sampler: single-step DPM-Solver++ ("fast" orders) on a discrete DDPM schedule
    (`dpm_solver_pp.py`; see the module docstring). The defaults are the official ones.

    Every `step()` consumes one epsilon prediction. Inside an order-k solver step the first k-1 calls return the
    intermediate stage sample (where the model is evaluated next) and the k-th returns the solution at the
    step's end time, so a pipeline drives it with the usual `for t in scheduler.timesteps` loop. The grid has
    NFE + 1 points; an order-k step spans k intervals and its stages sit on the points in between.

    Args:
        num_train_timesteps: number of discrete training steps N (knots t_n = n / N, n = 1..N).
        beta_start, beta_end, beta_schedule, trained_betas: the discrete schedule (`DiscreteSchedule`), as in
            diffusers' `DDPMScheduler`; the defaults are Stable Diffusion's, U-ViT's MS-COCO schedule
            (`SCHEDULE_PRESETS["stable-diffusion"]`).
        solver_order: 3 gives the official pattern ([3] * (K - 1) + [2] for NFE % 3 == 2, ...); 2 and 1 are
            the lower-order single-step variants of the same code.
        skip_type: "time_uniform" (official) or "logSNR" spacing of the grid.
        t_end: final continuous time; None is the official eps 1 / N (network time 1).
        prediction_type: only "epsilon" (what U-ViT predicts).
        algorithm_type: "dpmsolver++" (data prediction, official `predict_x0=True`) or "dpmsolver" (noise
            prediction).
    """

    # `from_config` switches to and from these: the same betas config.
    _compatibles = ["DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler"]
    order = 1  # one model evaluation per `step()` call (diffusers uses this for progress-bar bookkeeping)

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = _SD["num_train_timesteps"],
        beta_start: float = _SD["beta_start"],
        beta_end: float = _SD["beta_end"],
        beta_schedule: str = _SD["beta_schedule"],
        trained_betas: list[float] | None = None,
        solver_order: int = 3,
        skip_type: str = "time_uniform",
        t_end: float | None = None,
        prediction_type: str = "epsilon",
        algorithm_type: str = "dpmsolver++",
    ) -> None:
        self._check_solver(solver_order, skip_type, algorithm_type, prediction_type)
        self.noise_schedule = DiscreteSchedule(num_train_timesteps, beta_start, beta_end, beta_schedule, trained_betas)
        self.betas = self.noise_schedule.betas.float()
        self.alphas_cumprod = self.noise_schedule.alphas_cumprod.float()

        self.init_noise_sigma = 1.0
        self.num_inference_steps: int | None = None
        self.timesteps = torch.empty(0)
        self._steps, self._stages = [], []
        self._step_index: int | None = None
        self._begin_index: int | None = None
        self._x_s, self._outs = None, []

    def _plan_grid(self, orders: list[int], nfe: int, t_start: float, t_end: float) -> None:
        # `dpm_solver_pp.py`: `steps` (= NFE) intervals even though it takes fewer solver steps.
        grid = self._solver_grid(t_start, t_end, nfe)
        lam_grid = self.noise_schedule.lambda_(grid)
        i = 0
        for order in orders:
            h = (lam_grid[i + order] - lam_grid[i]).item()
            r1 = (lam_grid[i + 1] - lam_grid[i]).item() / h if order >= 2 else None
            r2 = (lam_grid[i + 2] - lam_grid[i]).item() / h if order >= 3 else None
            self._add_step(order, grid[i].item(), grid[i + order].item(), lam_grid[i].item(), h, r1, r2)
            i += order

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """Build the grid, the order pattern and the per-evaluation timesteps for `num_inference_steps` NFE."""
        n = self.config.num_train_timesteps
        t_end = self.config.t_end if self.config.t_end is not None else 1.0 / n
        stage_times = self._plan(num_inference_steps, t_end)
        # diffusers' 0-based step: 1000 t - 1.
        self.timesteps = (stage_times * n - 1.0).to(device=device, dtype=torch.float32)
        self.num_inference_steps = num_inference_steps
        self._step_index, self._begin_index = None, None

    @property
    def step_index(self) -> int | None:
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start at evaluation `begin_index` (must be the first stage of a solver step)."""
        self._begin_index = begin_index

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
        prev = self._solve(self._step_index, model_output, sample)
        self._step_index += 1
        if not return_dict:
            return (prev,)
        return SchedulerOutput(prev_sample=prev)

    def add_noise(
        self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """Forward process alpha_t x0 + sigma_t noise at (B,) integer diffusers steps (alpha_t^2 = alphas_cumprod[t])."""
        abar = self.alphas_cumprod.to(device=original_samples.device)[timesteps.long()].to(original_samples.dtype)
        abar = abar.view(-1, *([1] * (original_samples.dim() - 1)))
        return abar.sqrt() * original_samples + (1.0 - abar).sqrt() * noise

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class VPSDEDPMSolverFastScheduler(_SingleStepDPMSolver, _VPSDESchedulerBase):
    """U-ViT's CIFAR-10 training-monitor sampler: DPM-Solver-fast on the VP-SDE (`dpm_solver_pytorch.py`; see the
    module docstring). The defaults are the official ones.

    One `step()` per model evaluation, as `UViTDPMSolverScheduler`. The grid has one interval per solver step,
    its stages at the uniform subdivision of the step (in lambda for "logSNR": fractions 1/3, 2/3 or 1/2).

    Args:
        beta_min, beta_max: the VP-SDE (`uvic.schedulers.noise_schedule.VPSDE`).
        time_scale: network time per unit of t (U-ViT: 999), read by `uvic.schedulers.timesteps`.
        t_eps: the final time (the monitor's eps).
        num_train_timesteps: only reported by `len()`.
        solver_order, skip_type, algorithm_type, prediction_type: as for `UViTDPMSolverScheduler` (the monitor:
            order 3, "logSNR", "dpmsolver").
    """

    @register_to_config
    def __init__(
        self,
        beta_min: float = _VP["beta_min"],
        beta_max: float = _VP["beta_max"],
        time_scale: float = _VP["time_scale"],
        t_eps: float = 1e-4,
        num_train_timesteps: int = 1000,
        solver_order: int = 3,
        skip_type: str = "logSNR",
        algorithm_type: str = "dpmsolver",
        prediction_type: str = "epsilon",
    ) -> None:
        self._check_solver(solver_order, skip_type, algorithm_type, prediction_type)
        if not 0 <= beta_min < beta_max:
            raise ValueError(f"need 0 <= beta_min < beta_max, got {beta_min} and {beta_max}")
        self.noise_schedule = self.sde
        self._steps, self._stages = [], []
        self._x_s, self._outs = None, []
        self._reset()

    def _grid(self, num_inference_steps: int) -> torch.Tensor:
        """The (n + 1,) evaluation times, then t_eps (where the last evaluation's result lives)."""
        stage_times = self._plan(num_inference_steps, self.config.t_eps)
        return torch.cat([stage_times, torch.tensor([self.config.t_eps], dtype=torch.float64)])

    def _plan_grid(self, orders: list[int], nfe: int, t_start: float, t_end: float) -> None:
        # `dpm_solver_pytorch.py` DPM-Solver-fast: one interval per solver step, its stages subdividing it.
        outer = self._solver_grid(t_start, t_end, len(orders))
        lam_outer = self.noise_schedule.lambda_(outer)
        for m, order in enumerate(orders):
            s, t, lam_s = outer[m].item(), outer[m + 1].item(), lam_outer[m].item()
            h = lam_outer[m + 1].item() - lam_s
            if self.config.skip_type == "logSNR":  # the official r1 = 1/3, r2 = 2/3 (order 3) or r1 = 1/2 (order 2)
                rs = [j / order for j in range(1, order)]
            else:
                inner = self.noise_schedule.lambda_(torch.linspace(s, t, order + 1, dtype=torch.float64))
                rs = [(inner[j].item() - lam_s) / h for j in range(1, order)]
            rs += [None] * (2 - len(rs))
            self._add_step(order, s, t, lam_s, h, rs[0], rs[1])

    def _update(self, i: int, eps: torch.Tensor, sample: torch.Tensor, generator) -> torch.Tensor:
        return self._solve(i, eps, sample)
