import pytest
import torch
from diffusers import DDPMScheduler

from uvic.config import DiffusionConfig
from uvic.schedulers import VPSDE
from uvic.training.ema import EMA
from uvic.training.losses import DiscreteNoise, build_noise_process, eps_prediction_loss
from uvic.training.rng import ShardedRNG


def test_ema_is_an_exact_copy_then_a_constant_decay_average():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.9)
    for a, b in zip(ema.model.parameters(), model.parameters()):
        assert torch.equal(a, b) and not a.requires_grad
    expected = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        expected = [0.9 * e + 0.1 * p.detach() for e, p in zip(expected, model.parameters())]
    for e, a in zip(expected, ema.model.parameters()):
        torch.testing.assert_close(a, e)
    with pytest.raises(ValueError, match="decay"):
        EMA(model, 1.5)


def test_sharded_rng_gives_each_process_its_rows_of_one_stream():
    one = ShardedRNG(7, 0, 1, "cpu")
    two = [ShardedRNG(7, r, 2, "cpu") for r in range(2)]
    full = one.randn(6, 3)
    torch.testing.assert_close(torch.cat([r.randn(3, 3) for r in two]), full)
    state = one.state_dict()
    a = one.rand(4)
    one.load_state_dict(state)
    torch.testing.assert_close(one.rand(4), a)


class _Recorder(torch.nn.Module):
    """A 'model' that predicts eps_hat = 0.5 x_t and records its inputs."""

    def forward(self, x, t):
        self.seen = (x, t)
        return type("Out", (), {"sample": 0.5 * x})()


def test_vpsde_loss_is_uvit_lsimple():
    x0 = torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    noise, model = build_noise_process(DiffusionConfig()), _Recorder()
    loss = eps_prediction_loss(model, x0, noise, ShardedRNG(3, 0, 1, "cpu"))
    # replay the same draws: t ~ U(0,1), eps ~ N(0, I)
    rng = ShardedRNG(3, 0, 1, "cpu")
    t, eps = rng.rand(5), rng.randn(5, 2, 4, 4)
    ab = torch.exp(-(0.1 * t + 9.95 * t**2)).view(-1, 1, 1, 1)
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
    torch.testing.assert_close(model.seen[1], 999 * t)  # the network time
    torch.testing.assert_close(model.seen[0], x_t)
    torch.testing.assert_close(loss, ((eps - 0.5 * x_t) ** 2).mean(dim=(1, 2, 3)).mean())
    assert isinstance(noise.sde, VPSDE)


def test_discrete_noise_uses_uvit_float64_alphas_diffusers_timesteps():
    noise = build_noise_process(DiffusionConfig(schedule="discrete", beta_schedule="scaled_linear",
                                                beta_start=0.00085, beta_end=0.012))
    assert isinstance(noise, DiscreteNoise)
    # U-ViT's stable_diffusion_beta_schedule, in float64; diffusers' float32 alphas agree to rounding.
    uvit = torch.cumprod(1 - torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2, 0)
    ref = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    t = torch.tensor([0, 499, 999])
    assert noise.alpha_bar(t).dtype == torch.float64 and torch.equal(noise.alpha_bar(t), uvit[t])
    assert noise.alpha_bar(torch.tensor(999)).item() == pytest.approx(0.0046600985, rel=1e-8)
    torch.testing.assert_close(noise.alpha_bar(t).float(), ref.alphas_cumprod[t])
    assert torch.equal(noise.model_time(t), t + 1)  # U-ViT's n = diffusers t + 1 (docs/conventions.md, "Timesteps")
    # The network sees n = t + 1 for the t whose alpha_bar noised x_0: replay the draws with eps_hat = 0.
    x0, model = torch.randn(64, 1, 2, 2), _Recorder()
    eps_prediction_loss(model, x0, noise, ShardedRNG(0, 0, 1, "cpu"))
    rng = ShardedRNG(0, 0, 1, "cpu")
    t_drawn, eps = rng.randint(1000, 64), rng.randn(64, 1, 2, 2)
    ab = uvit[t_drawn].float().view(-1, 1, 1, 1)
    torch.testing.assert_close(model.seen[0], ab.sqrt() * x0 + (1 - ab).sqrt() * eps)
    assert model.seen[1].dtype == torch.int64 and torch.equal(model.seen[1], t_drawn + 1)
