import json

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, DiffusionPipeline, DPMSolverMultistepScheduler, ImagePipelineOutput

from uvic.config import DiffusionConfig
from uvic.models import UViTModel
from uvic.pipelines import UViCPipeline
from uvic.pipelines.sampling import generate, load_pretrained, sample_to_folder, save_grid
from uvic.schedulers import UViTDPMSolverScheduler, build_scheduler


TINY = {"img_size": 8, "patch_size": 2, "in_chans": 3, "embed_dim": 16, "depth": 2, "num_heads": 2, "attention": "cog"}


def _pipe(sampler="euler_maruyama", **model_kwargs):
    torch.manual_seed(0)
    model = UViTModel(**{**TINY, **model_kwargs}).eval()
    pipe = UViCPipeline(transformer=model, scheduler=build_scheduler(sampler, DiffusionConfig()))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_output_types_and_shapes():
    pipe = _pipe()
    out = pipe(batch_size=2, num_inference_steps=3, generator=_gens([0, 1]), output_type="pt")
    assert isinstance(out, ImagePipelineOutput) and out.images.shape == (2, 3, 8, 8)
    assert out.images.dtype == torch.float32 and 0 <= out.images.min() and out.images.max() <= 1
    (np_images,) = pipe(batch_size=2, num_inference_steps=3, generator=_gens([0, 1]), output_type="np",
                        return_dict=False)
    np.testing.assert_allclose(np_images, out.images.permute(0, 2, 3, 1).numpy())
    pil = pipe(batch_size=1, num_inference_steps=3, output_type="pil").images
    assert pil[0].size == (8, 8)
    with pytest.raises(ValueError, match="output_type"):
        pipe(num_inference_steps=1, output_type="latent")
    with pytest.raises(ValueError, match="generators"):
        pipe(batch_size=3, num_inference_steps=1, generator=_gens([0, 1]))


@pytest.mark.parametrize("sampler", ["euler_maruyama", "dpm_solver"])
def test_deterministic_per_seed_and_independent_of_batch(sampler):
    pipe = _pipe(sampler)
    a = pipe(batch_size=3, num_inference_steps=4, generator=_gens([5, 6, 7]), output_type="pt").images
    b = pipe(batch_size=3, num_inference_steps=4, generator=_gens([5, 6, 7]), output_type="pt").images
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    alone = pipe(batch_size=1, num_inference_steps=4, generator=_gens([6]), output_type="pt").images
    torch.testing.assert_close(alone[0], a[1], rtol=1e-5, atol=1e-6)
    other = pipe(batch_size=1, num_inference_steps=4, generator=_gens([8]), output_type="pt").images
    assert (other[0] - a[1]).abs().max() > 1e-3


def test_latents_are_the_starting_noise():
    pipe = _pipe("dpm_solver")  # deterministic sampler: the output is a function of x_T only
    x_t = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    a = pipe(latents=x_t, num_inference_steps=3, output_type="pt").images
    b = pipe(num_inference_steps=3, batch_size=2, generator=torch.Generator().manual_seed(3), output_type="pt").images
    torch.testing.assert_close(a, b)


def test_save_load_round_trip(tmp_path):
    pipe = _pipe("dpm_solver", attention="cog")
    pipe.save_pretrained(tmp_path)
    loaded = UViCPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.transformer.config.attention == "cog"
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert type(loaded.scheduler) is type(pipe.scheduler)
    assert public(loaded.scheduler.config) == public(pipe.scheduler.config)
    a = pipe(batch_size=2, num_inference_steps=3, generator=_gens([0, 1]), output_type="pt").images
    b = loaded(batch_size=2, num_inference_steps=3, generator=_gens([0, 1]), output_type="pt").images
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_generic_diffusion_pipeline_loads_the_export(tmp_path):
    # model_index.json names [module file, class]: diffusers' rule for a class outside diffusers.
    pipe = _pipe("dpm_solver")
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == ["pipeline_uvic", "UViCPipeline"]
    generic = DiffusionPipeline.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(generic) is UViCPipeline  # the installed class (the saved file only re-exports it)
    generic.set_progress_bar_config(disable=True)
    a = pipe(batch_size=2, num_inference_steps=3, generator=_gens([0, 1]), output_type="pt").images
    b = generic(batch_size=2, num_inference_steps=3, generator=_gens([0, 1]), output_type="pt").images
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # diffusers runs no file from a directory without the flag; the class itself needs none.
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        DiffusionPipeline.from_pretrained(tmp_path)
    assert type(UViCPipeline.from_pretrained(tmp_path)) is UViCPipeline
    # The explicit custom-pipeline form keeps working, and sample.py's loader takes the directory.
    assert type(DiffusionPipeline.from_pretrained(tmp_path, custom_pipeline="pipeline_uvic",
                                                  trust_remote_code=True)) is UViCPipeline
    assert type(load_pretrained(tmp_path)) is UViCPipeline


def test_stock_discrete_scheduler_and_class_labels():
    torch.manual_seed(0)
    model = UViTModel(**{**TINY, "num_classes": 3}).eval()
    pipe = UViCPipeline(model, DDIMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    a = pipe(batch_size=2, num_inference_steps=3, class_labels=[0, 2], generator=_gens([0, 1]), output_type="pt")
    b = pipe(batch_size=2, num_inference_steps=3, class_labels=[1, 2], generator=_gens([0, 1]), output_type="pt")
    assert (a.images[0] - b.images[0]).abs().max() > 0  # the label reaches the model
    torch.testing.assert_close(a.images[1], b.images[1])
    with pytest.raises(ValueError, match="class-conditional"):
        pipe(batch_size=1, num_inference_steps=1)
    with pytest.raises(ValueError, match=r"class labels must be in \[0, 3\)"):
        pipe(batch_size=1, num_inference_steps=1, class_labels=[3])
    with pytest.raises(ValueError, match="not class-conditional"):
        _pipe()(batch_size=1, num_inference_steps=1, class_labels=[0])


def test_folder_sampling_is_sharded_and_resumable(tmp_path):
    from PIL import Image

    pipe = _pipe("dpm_solver")
    n = sample_to_folder(pipe, tmp_path / "one", 5, seed=10, batch_size=5, num_inference_steps=2)
    assert n == 5
    for rank in range(2):  # two "processes", another batch size
        sample_to_folder(pipe, tmp_path / "two", 5, seed=10, batch_size=2, num_inference_steps=2,
                         process_index=rank, num_processes=2)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == [f"{i:06d}.png" for i in range(5)] == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        a = np.asarray(Image.open(tmp_path / "one" / name)).astype(int)
        b = np.asarray(Image.open(tmp_path / "two" / name)).astype(int)
        assert np.abs(a - b).max() <= 1  # same seed -> same image, up to uint8 rounding of fp noise
    (tmp_path / "one" / "000003.png").unlink()
    assert sample_to_folder(pipe, tmp_path / "one", 5, seed=10, batch_size=5, num_inference_steps=2) == 1
    grid = save_grid(generate(pipe, [0, 1, 2], batch_size=2, num_inference_steps=2), tmp_path / "g.png")
    assert Image.open(grid).size == (2 * (8 + 2) + 2, 2 * (8 + 2) + 2)


def _recorded_timesteps(pipe, steps, **call_kwargs):
    """The `timestep` argument of every transformer call during one pipeline run."""
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    try:
        pipe(batch_size=2, num_inference_steps=steps, generator=_gens([0, 1]), output_type="pt", **call_kwargs)
    finally:
        hook.remove()
    for t in seen:
        assert t.shape == (2,) and torch.equal(t, t[:1].expand(2))  # one value per call, broadcast to the batch
    return torch.stack([t[0] for t in seen])


def test_transformer_gets_999t_from_the_continuous_schedulers():
    # Euler-Maruyama on the official grid: network input 999 t for t = 1, ..., 1e-3 (float32, `t * 999`).
    seen = _recorded_timesteps(_pipe("euler_maruyama"), 4)
    grid = torch.tensor(np.linspace(1e-3, 1.0, 4)[::-1].copy()).float()
    assert seen.dtype == torch.float32 and torch.equal(seen, grid * 999)
    assert seen[0] == 999.0
    pipe = _pipe("dpm_solver")
    seen = _recorded_timesteps(pipe, 3)
    assert torch.equal(seen, pipe.scheduler.timesteps * 999) and seen[0] == 999.0
    assert 0 < pipe.scheduler.timesteps.min() and pipe.scheduler.timesteps.max() == 1.0  # continuous t in (0, 1]


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        (DDIMScheduler(num_train_timesteps=1000), [667, 334, 1]),  # diffusers t = 666, 333, 0 ("leading")
        (DDPMScheduler(num_train_timesteps=1000), [667, 334, 1]),
        (DPMSolverMultistepScheduler(num_train_timesteps=1000), [1000, 667, 334]),  # "linspace": 999, 666, 333
    ],
)
@pytest.mark.parametrize("num_classes", [-1, 3])
def test_transformer_gets_t_plus_1_from_discrete_schedulers(scheduler, expected, num_classes):
    # U-ViT's discrete models are trained on n = diffusers t + 1 (docs/conventions.md, "Timesteps"), as the loss feeds them.
    torch.manual_seed(0)
    pipe = UViCPipeline(UViTModel(**{**TINY, "num_classes": num_classes}).eval(), scheduler)
    pipe.set_progress_bar_config(disable=True)
    labels = {"class_labels": [0, 2]} if num_classes > 0 else {}
    seen = _recorded_timesteps(pipe, 3, **labels)
    assert seen.tolist() == expected
    assert torch.equal(seen, pipe.scheduler.timesteps + 1)


def test_transformer_gets_t_plus_1_from_the_official_dpm_solver():
    pipe = UViCPipeline(UViTModel(**TINY).eval(), UViTDPMSolverScheduler())
    pipe.set_progress_bar_config(disable=True)
    seen = _recorded_timesteps(pipe, 5)
    assert seen[0] == 1000.0  # official network time 1000 t at t = 1
    assert torch.equal(seen, pipe.scheduler.timesteps + 1)


def test_official_dpm_solver_on_a_vpsde_model_feeds_999t():
    # `uvit_dpm_solver` for a continuous VP-SDE model is U-ViT's CIFAR-10 monitor sampler (DPM-Solver-fast,
    # noise prediction): continuous t from 1 down to near 1e-4, reaching the network as 999 t like the other
    # VP-SDE samplers; it is deterministic, so x_T alone decides the images.
    pipe = _pipe("uvit_dpm_solver")
    seen = _recorded_timesteps(pipe, 5)
    assert len(seen) == 5 and pipe.scheduler.solver_orders == [3, 2]
    assert torch.equal(seen, pipe.scheduler.timesteps * 999) and seen[0] == 999.0
    assert 1e-4 < pipe.scheduler.timesteps.min() < pipe.scheduler.timesteps.max() == 1.0
    x_t = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    a = pipe(latents=x_t, num_inference_steps=5, generator=_gens([0]), output_type="pt").images
    b = pipe(latents=x_t, num_inference_steps=5, generator=_gens([1]), output_type="pt").images
    torch.testing.assert_close(a, b, rtol=0, atol=0)
