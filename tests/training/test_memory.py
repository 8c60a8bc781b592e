"""The memory a run needs, counted from its config before anything is built: the parameter count is the built
model's, and configs far beyond this machine are refused by train.py in one line (exit 2) without building."""

import pytest

from uvic.config import load_config
from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM
from uvic.models.uvit import UViTModel
from uvic.training.memory import (
    GIB,
    check_memory,
    cogformer_parameter_count,
    estimate_memory,
    machine_memory,
    parameter_count,
    uvit_parameter_count,
)


_UVIT = {"img_size": 8, "patch_size": 2, "in_chans": 3, "embed_dim": 16, "depth": 4, "num_heads": 2}


@pytest.mark.parametrize("extra", [
    {}, {"depth": 5}, {"num_classes": 11}, {"clip_dim": 12, "num_clip_token": 5}, {"mlp_time_embed": True},
    {"qkv_bias": True}, {"conv": False, "skip": False}, {"mlp_ratio": 2.5, "in_chans": 4, "patch_size": 4},
    {"attention": "softmax"},
])
def test_the_uvit_count_is_the_built_models(extra):
    kwargs = {**_UVIT, **extra}
    model = UViTModel(**kwargs)
    defaults = {k: v.default for k, v in __import__("inspect").signature(UViTModel.__init__).parameters.items()
                if k != "self"}
    assert uvit_parameter_count(**{**defaults, **kwargs}) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("extra", [{}, {"head_dim": 6}, {"tie_word_embeddings": True}, {"num_hidden_layers": 3}])
def test_the_cogformer_count_is_the_built_models(extra):
    config = CogformerConfig(**{"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                                "num_attention_heads": 2, **extra})
    model = CogformerForCausalLM(config)
    model.tie_weights()  # a Cogformer's head is its own, whatever the config says
    assert cogformer_parameter_count(**config.to_dict()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", ["configs/cifar10_uvic_s2.yaml", "configs/lm_tiny.yaml",
                                    "configs/demo_digits.yaml"])
def test_a_run_config_counts_what_its_task_builds(config):
    from uvic.training.tasks import build_task

    cfg = load_config(config)
    model = build_task(cfg).build_model()
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    est = check_memory(cfg)  # fits this machine
    assert est.total <= machine_memory()


def test_the_estimate_is_its_parts():
    """The formula of uvic/training/memory.py, by hand for U-ViT-S/2 on CIFAR-10 with batch 128."""
    cfg = load_config("configs/cifar10_uvic_s2.yaml", ["train.mixed_precision='no'"])
    est = estimate_memory(cfg, processes=1)
    n = 44_255_328  # U-ViT-S/2 (CIFAR-10), as built by test_a_run_config_counts_what_its_task_builds
    assert est.parameters == n and est.state == n * 20  # weights, grads, 2 Adam moments, EMA: fp32
    assert est.activations == 128 * 257 * (512 + 2048) * 13 * 4 and est.batch == 128 * 3 * 32 * 32 * 4
    assert estimate_memory(cfg, processes=4).micro_batch == 32
    with pytest.raises(ValueError, match=r"needs at least 4\.9 GiB per process .* more than this machine's 1\.0 "
                                         r"GiB of memory"):
        check_memory(cfg, limit=GIB)


@pytest.fixture
def no_blocks(monkeypatch):
    """Building more than 50 U-ViT blocks or Cogformer layers, even on the meta device, fails the test: a refused
    config is refused from its numbers (a depth of 100000 built blocks for minutes)."""
    import uvic.models.cogformer as cogformer
    import uvic.models.uvit as uvit

    for module, name in ((uvit, "UViTBlock"), (cogformer, "CogformerDecoderLayer")):
        cls = getattr(module, name)
        real_init, calls = cls.__init__, []

        def init(self, *args, _real=real_init, _calls=calls, **kwargs):
            _calls.append(1)
            if len(_calls) > 50:
                raise AssertionError("blocks were built for a config that cannot fit")
            _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)


@pytest.mark.parametrize("config, overrides, parts", [
    ("configs/cifar10_uvic_s2.yaml", ["model.embed_dim=1000000"], "168,000,420,000,096 parameters"),
    ("configs/cifar10_uvic_s2.yaml", ["data.image_size=100000"], "GiB for a batch of images of data.image_size"),
    ("configs/cifar10_uvic_s2.yaml", ["model.depth=100000", "model.embed_dim=4096"], "21,814,884,130,912 parameters"),
    ("configs/lm_tiny.yaml", ["model.vocab_size=1000000000"], "128,000,213,568 parameters"),
])
def test_a_run_that_cannot_fit_exits_2_in_one_line_building_nothing(tmp_path, run_script, no_blocks, config,
                                                                     overrides, parts):
    import time

    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 20)
    run = tmp_path / "run"
    t0 = time.time()
    code, _, err = run_script("train.py", config, *overrides, f"train.run_dir={run}", "train.log_with=none",
                              f"data.path={text}" if "lm" in config else "train.cpu_threads=1")
    assert code == 2 and "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("train.py: error: config sections model/data/train: this run needs at least ") and (
        "GiB of memory" in line and parts in line), line
    assert time.time() - t0 < 60 and not run.exists()
