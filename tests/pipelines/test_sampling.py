"""The one seeded generate / folder writer with text-to-image pipelines: FID folder from extracted val features
(sharding, resume), prompts, sampler switch, sample.py. (Unconditional and class-conditional pipelines:
test_pipeline_uvic.py and test_scripts.py.)"""

import json

import numpy as np
import pytest
from PIL import Image

from uvic.data.mscoco import MSCOCOFeatures
from uvic.models import build_preset
from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline
from uvic.pipelines.sampling import generate, load_pretrained, mscoco_prompt_embeds, sample_to_folder
from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler


@pytest.fixture(scope="module")
def setup(tmp_path_factory, make_tiny_coco):
    tmp = tmp_path_factory.mktemp("t2i")
    _, vae, te = make_tiny_coco(tmp, 3)
    pipe = UViCText2ImagePipeline(transformer=build_preset("uvic-tiny-t2i", attention_backend="torch").eval(),
                                  vae=vae.eval(), scheduler=UViTDPMSolverScheduler(), text_encoder=te)
    pipe.save_pretrained(tmp / "pipe")
    te.save_pretrained(tmp / "clip")
    bare = UViCText2ImagePipeline(transformer=pipe.transformer, vae=vae, scheduler=UViTDPMSolverScheduler())
    bare.save_pretrained(tmp / "bare")  # as exported by training: no text encoder
    return tmp, pipe


def test_fid_folder_is_sharded_resumable_and_follows_seeds(setup):
    tmp, pipe = setup
    pipe.set_progress_bar_config(disable=True)
    embeds, empty, captions = mscoco_prompt_embeds(tmp / "feat", 5, seed=3)
    kw = {"seed": 3, "num_inference_steps": 3, "guidance_scale": 2.0, "prompt_embeds": embeds,
          "negative_prompt_embeds": empty}
    assert sample_to_folder(pipe, tmp / "one", 5, batch_size=2, **kw) == 5
    for rank in (0, 1):  # two "processes", different batch size
        sample_to_folder(pipe, tmp / "two", 5, batch_size=3, process_index=rank, num_processes=2, **kw)
    for i in range(5):
        a = np.asarray(Image.open(tmp / "one" / f"{i:06d}.png"))
        b = np.asarray(Image.open(tmp / "two" / f"{i:06d}.png"))
        assert a.shape == (16, 16, 3) and np.abs(a.astype(int) - b.astype(int)).max() <= 1
    assert sample_to_folder(pipe, tmp / "one", 5, batch_size=2, **kw) == 0  # resume: nothing left

    # Image i = caption row rows[i] with generator seed + i.
    features = MSCOCOFeatures(tmp / "feat", "val")
    rows = features.draw_caption_rows(5, 3)
    assert captions == [features.captions[r] for r in rows]
    ref = generate(pipe, [3 + 4], batch_size=1, num_inference_steps=3, guidance_scale=2.0,
                   prompt_embeds=features.context(rows[4:5]), negative_prompt_embeds=features.empty_context)
    assert np.abs(ref[0].astype(int) - np.asarray(Image.open(tmp / "one" / "000004.png")).astype(int)).max() <= 1


def test_prompts_and_sampler_switch(setup):
    tmp, _ = setup
    pipe = load_pretrained(tmp / "pipe", sampler="dpm_solver")
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.scheduler.config.beta_schedule == "scaled_linear"
    images = generate(pipe, [0, 1], batch_size=2, num_inference_steps=3, prompts=["a cat", "a dog"])
    assert images.shape == (2, 16, 16, 3) and images.dtype == np.uint8
    # A pipeline without a text encoder gets one for prompts; the images equal the full pipeline's.
    bare = load_pretrained(tmp / "bare", text_encoder=str(tmp / "clip"))
    full = load_pretrained(tmp / "pipe")
    for p in (bare, full):
        p.set_progress_bar_config(disable=True)
    kw = {"batch_size": 1, "num_inference_steps": 2, "prompts": ["a cat"]}
    np.testing.assert_array_equal(generate(bare, [5], **kw), generate(full, [5], **kw))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_pretrained(tmp / "nowhere")
    with pytest.raises(ValueError, match="does not apply to a discrete model"):
        load_pretrained(tmp / "pipe", sampler="euler_maruyama")
    with pytest.raises(ValueError, match="exactly one of prompts and prompt_embeds"):
        generate(full, [5], batch_size=1)
    with pytest.raises(ValueError, match="class_labels do not apply"):
        generate(full, [5], prompts=["a cat"], class_labels=[0])


def test_sample_script_text_to_image(setup, monkeypatch, capsys):
    """sample.py on a UViCText2ImagePipeline dir: a grid from prompts, a FID folder from extracted captions (the
    script runs in this process, as tests/test_sample_cli.py runs it, which saves three interpreter start-ups)."""
    import runpy
    import sys
    from pathlib import Path

    tmp, pipe = setup
    root = Path(__file__).resolve().parents[2]

    def run(*args):
        """sample.py PIPE ARGS in this process: (exit code, stderr)."""
        monkeypatch.setattr(sys, "argv", ["sample.py", str(tmp / "pipe"), *args])
        try:
            runpy.run_path(str(root / "sample.py"), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err

    code, err = run("--grid", str(tmp / "grid.png"), "--num-images", "2", "--steps", "2", "--prompt", "a cat",
                    "--prompt", "a dog", "--seed", "5")
    assert code == 0, err
    grid = np.asarray(Image.open(tmp / "grid.png"))
    pipe.set_progress_bar_config(disable=True)
    expect = generate(pipe, [5, 6], batch_size=2, num_inference_steps=2, prompts=["a cat", "a dog"])
    assert grid.ndim == 3 and grid.shape[2] == 3
    # The first grid cell is image 0 (the grid pads cells; find the exact image somewhere in the grid).
    h, w = expect.shape[1:3]
    cells = [grid[y:y + h, x:x + w] for y in range(grid.shape[0] - h + 1) for x in range(grid.shape[1] - w + 1)]
    assert any(np.abs(c.astype(int) - expect[0].astype(int)).max() <= 1 for c in cells)

    code, err = run("--out-dir", str(tmp / "script_fid"), "--num-images", "3", "--steps", "2", "--batch-size", "2",
                    "--features", str(tmp / "feat"), "--seed", "3")
    assert code == 0, err
    direct = tmp / "direct_fid"
    embeds, empty, captions = mscoco_prompt_embeds(tmp / "feat", 3, seed=3)
    sample_to_folder(pipe, direct, 3, seed=3, batch_size=2, num_inference_steps=2, prompt_embeds=embeds,
                     negative_prompt_embeds=empty)
    assert json.loads((tmp / "script_fid" / "captions.json").read_text()) == captions
    for i in range(3):
        a = np.asarray(Image.open(tmp / "script_fid" / f"{i:06d}.png")).astype(int)
        assert np.abs(a - np.asarray(Image.open(direct / f"{i:06d}.png")).astype(int)).max() <= 1

    code, err = run("--grid", str(tmp / "g2.png"))  # no prompts: a clear CLI error (an exception would propagate)
    assert code == 2 and "needs --prompt" in err and "Traceback" not in err
