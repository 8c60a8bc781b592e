import dataclasses
import inspect
import typing

import pytest
import yaml

from uvic.config import Config, UViTConfig, config_from_dict, load_config, validate_ranges
from uvic.errors import ConfigError
from uvic.models import UViTModel
from uvic.values import RANGES


def test_model_config_fields_are_the_model_kwargs():
    params = [p for p in inspect.signature(UViTModel.__init__).parameters if p != "self"]
    assert [f.name for f in dataclasses.fields(UViTConfig)] == params
    # and the model accepts the config as is
    model = UViTModel(**{**dataclasses.asdict(Config().model), "embed_dim": 16, "depth": 2, "num_heads": 2,
                         "img_size": 8})
    assert model.config.attention == "cog"
    # One default for the attention switch, in the schema and in the model.
    assert inspect.signature(UViTModel.__init__).parameters["attention"].default == UViTConfig.attention == "cog"


def test_defaults_are_the_official_cifar10_recipe():
    cfg = Config()
    t = cfg.train
    assert (t.lr, t.weight_decay, t.betas, t.warmup_steps, t.batch_size, t.ema_decay) == (
        2e-4, 0.03, (0.99, 0.999), 2500, 128, 0.9999)
    assert t.lr_schedule == "constant" and t.grad_clip == 0.0 and t.max_steps == 500_000
    assert cfg.diffusion.schedule == "vpsde" and (cfg.diffusion.beta_min, cfg.diffusion.beta_max) == (0.1, 20.0)
    m = cfg.model
    assert (m.img_size, m.patch_size, m.embed_dim, m.depth, m.num_heads, m.qkv_bias, m.mlp_time_embed) == (
        32, 2, 512, 12, 8, False, False)
    assert cfg.data.random_flip


def test_yaml_deltas_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  depth: 13\ntrain:\n  lr: 1e-4\n  betas: [0.9, 0.9]\n")
    cfg = load_config(p, ["train.batch_size=64", "model.attention=softmax", "train.mixed_precision=bf16"])
    assert cfg.model.depth == 13 and cfg.train.lr == 1e-4 and cfg.train.betas == (0.9, 0.9)
    assert cfg.train.batch_size == 64 and cfg.model.attention == "softmax" and cfg.train.mixed_precision == "bf16"
    assert cfg.model.embed_dim == 512  # untouched default
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0


def test_to_yaml_round_trips():
    cfg = load_config(None, ["model.clip_dim=768", "train.lr=3e-4"])
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.lrr=1", "unknown config key.*train.lrr"),
        ("nosection.x=1", "unknown config key.*nosection"),
        ("train.batch_size=1.5", "train.batch_size: expected int"),
        ("train.batch_size=abc", "train.batch_size: expected int"),
        ("model.qkv_bias=1", "model.qkv_bias: expected bool"),
        ("model.attention=linear", "model.attention.*not one of"),
        ("data.name=imagenet", r"^config key data.name: 'imagenet' is not one of \['cifar10', 'image_folder', 'digits'"),
        ("train.betas=[0.9]", "train.betas: expected a list of 2"),
        ("train.lr=fast", "train.lr"),
        ("train=3", "train must be a mapping"),
        ("novalue", "must look like section.key=value"),
        ("train.log_every=0", r"train.log_every: must be >= 1, got 0"),
        ("train.grad_accum_steps=-1", r"train.grad_accum_steps: must be >= 1, got -1"),
        ("train.batch_size=0", r"train.batch_size: must be >= 1, got 0"),
    ],
)
def test_bad_keys_and_types_are_errors(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def test_an_empty_run_dir_and_an_unread_val_path_are_refused():
    # An empty run dir would train into (and export over) the current directory.
    for task in ("diffusion", "t2i", "lm"):
        for empty in ("''", "' '"):
            with pytest.raises(ConfigError, match=r"^config key train.run_dir: must not be empty"):
                load_config(None, [f"task={task}", f"train.run_dir={empty}"])
    # No LM task reads held-out data, so the key does not exist.
    with pytest.raises(ConfigError, match=r"^unknown config key\(s\) \['data.val_path'\]"):
        load_config(None, ["task=lm", "data.val_path=val.bin"])


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_a_directory_or_binary_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"config file {tmp_path} is a directory, not a YAML file or a run dir (no config.yaml in it)"
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x8d\x00\xff binary")
    with pytest.raises(ConfigError) as e:
        load_config(binary)
    assert str(e.value).startswith(f"cannot read config file {binary}: UnicodeDecodeError: 'utf-8' codec can't decode")


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    uvit = load_config(root / "cifar10_uvit_s2.yaml")
    uvic = load_config(root / "cifar10_uvic_s2.yaml")
    assert uvit.model.attention == "softmax" and uvic.model.attention == "cog"
    assert dataclasses.replace(uvit.model, attention="cog") == uvic.model
    demo = load_config(root / "demo_digits.yaml")
    assert demo.data.name == "digits" and demo.model.in_chans == 1 and demo.model.attention == "cog"  # a U-ViC


def test_attention_choices_are_exactly_the_attention_kinds_of_the_op():
    from uvic.attention import ATTENTIONS, AttentionKind
    from uvic.config import CHOICES

    assert CHOICES["model.attention"]() == ATTENTIONS == typing.get_args(AttentionKind) == ("cog", "softmax")
    for kind in ATTENTIONS:  # each one builds a model and an LM; anything else is rejected by the config
        cfg = load_config(None, [f"model.attention={kind}"])
        assert UViTModel(**{**dataclasses.asdict(cfg.model), "embed_dim": 16, "depth": 2}).config.attention == kind
        assert load_config(None, ["task=lm", f"model.attention={kind}"]).model.attention == kind
    with pytest.raises(ConfigError, match=r"^config key model.attention: 'linear' is not one of \['cog', 'softmax'\]$"):
        load_config(None, ["task=lm", "model.attention=linear"])


# YAML syntax errors and values out of range are one clear ConfigError.


def test_yaml_syntax_errors_name_the_file_or_override_and_the_position(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("train:\n  lr: 1e-4\n  betas: [0.9, 0.99\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    # The position yaml itself reports (0-based there), printed 1-based.
    with pytest.raises(yaml.YAMLError) as raw:
        yaml.safe_load(p.read_text())
    mark = raw.value.problem_mark
    assert str(e.value) == (f"config file {p} is not valid YAML: {raw.value.problem} at line {mark.line + 1}, "
                            f"column {mark.column + 1}")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^override 'train.betas=\[0.9' is not valid YAML: .* at line 1"):
        load_config(None, ["train.betas=[0.9"])


def test_every_numeric_field_has_a_range():
    from uvic.config import LMRunConfig, Text2ImageRunConfig, numeric_fields

    for cfg in (Config(), Text2ImageRunConfig(), LMRunConfig()):
        keys = numeric_fields(cfg)
        assert "train.max_steps" in keys and "train.betas" in keys and "data.num_workers" in keys
        assert not [k for k in keys if k not in RANGES]
        assert validate_ranges(cfg) is cfg  # the defaults are in range
    assert "model.vocab_size" in numeric_fields(LMRunConfig()) and "model.head_dim" in numeric_fields(LMRunConfig())


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=0", "config key train.max_steps: must be >= 1, got 0"),
    ("train.warmup_steps=-1", "config key train.warmup_steps: must be >= 0, got -1"),
    ("train.lr=-2e-4", "config key train.lr: must be > 0, got -0.0002"),
    ("train.lr=.nan", "config key train.lr: must be a finite number, got nan"),
    ("train.betas=[0.9,1.5]", "config key train.betas: must be in [0, 1), got (0.9, 1.5)"),
    ("train.ema_decay=1.1", "config key train.ema_decay: must be in [0, 1], got 1.1"),
    ("train.seed=-1", "config key train.seed: must be in [0, 2**32), got -1"),
    ("train.save_every=-5", "config key train.save_every: must be >= 0, got -5"),
    ("model.num_classes=0", "config key model.num_classes: must be -1 (unconditional) or >= 1, got 0"),
    ("model.depth=0", "config key model.depth: must be >= 1, got 0"),
    ("task=t2i data.p_uncond=2", "config key data.p_uncond: must be in [0, 1], got 2.0"),
    ("diffusion.beta_end=0", "config key diffusion.beta_end: must be in (0, 1), got 0.0"),
    ("diffusion.beta_max=0.05", "config keys diffusion.beta_min / beta_max: beta_max (0.05) must be >= beta_min (0.1)"),
    ("sample.num_inference_steps=0", "config key sample.num_inference_steps: must be >= 1, got 0"),
])
def test_values_out_of_range_are_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, override.split(" "))
    assert str(e.value) == message


@pytest.mark.parametrize("override, message", [
    ("model.vocab_size=0", "config key model.vocab_size: must be >= 1, got 0"),
    ("model.head_dim=-8", "config key model.head_dim: must be >= 1, got -8"),
    ("data.block_size=0", "config key data.block_size: must be >= 1, got 0"),
    ("train.min_lr_ratio=-0.1", "config key train.min_lr_ratio: must be in [0, 1], got -0.1"),
])
def test_lm_values_out_of_range_are_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task=lm", override])
    assert str(e.value) == message


def test_shipped_configs_resolve_to_the_stored_run_configs():
    """Each file in configs/ (and each task's defaults) resolves to the run config stored in
    tests/data_files/resolved_configs.json, so moving a value between a config file, a preset and a dataclass
    default cannot change a run (a stored key that is gone is a difference too)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent
    stored = json.loads((root / "data_files" / "resolved_configs.json").read_text())

    def stored_keys(resolved, expected):  # fields added later (with their defaults) are not in the store
        return {k: stored_keys(resolved[k], v) if isinstance(v, dict) else resolved[k]
                for k, v in expected.items() if k in resolved}

    for name, expected in stored.items():  # configs added later are not in the store either
        if name.startswith("<defaults"):
            cfg = load_config(None, [name.strip("<>").split()[1]])
        else:
            cfg = load_config(root.parent / "configs" / name)
        assert stored_keys(cfg.to_dict(), expected) == expected, name


def test_model_section_defaults_are_the_model_signatures():
    from uvic.config import LMModelConfig
    from uvic.models import CogformerConfig

    # The LM section leaves out the generation settings and token ids (the export takes them from the tokenizer).
    lm_only = ("use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "kwargs")
    for section, fn, exclude in ((UViTConfig, UViTModel.__init__, ()),
                                 (LMModelConfig, CogformerConfig.__init__, lm_only)):
        # uvic.config writes the fields out (it does not import diffusers / transformers): the same names in the
        # same order, with the signature's defaults and types.
        params, hints = inspect.signature(fn).parameters, typing.get_type_hints(fn)
        fields, section_hints = dataclasses.fields(section), typing.get_type_hints(section)
        assert [f.name for f in fields] == [p for p in params if p not in ("self", *exclude)]
        assert all(f.default == params[f.name].default for f in fields)
        assert all(section_hints[f.name] == hints[f.name] for f in fields)
    assert UViTConfig().img_size == 224  # the model's default, not the CIFAR-10 run's
    assert Config().model == UViTConfig.from_preset("uvic-s2-cifar10")  # the run's default is a preset


def test_loading_configs_imports_no_model_library():
    """`train.py --dry-run` and a config error cost the torch import, not diffusers' and transformers' (seconds):
    uvic.config reads the model signatures from source, the presets from uvic.presets, the sampler names from the
    table of class paths."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from uvic.config import load_config\n"
            "for name in ('cifar10_uvic_s2', 'mscoco_uvic_s2', 'imagenet256_uvic_l2', 'lm_tiny'):\n"
            "    load_config(f'configs/{name}.yaml')\n"
            "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-3000:] + r.stdout


def test_a_model_section_starts_from_its_preset_and_overrides_it(tmp_path):
    from uvic.config import LMModelConfig
    from uvic.models import COGFORMER_PRESETS, UVIT_PRESETS

    p = tmp_path / "c.yaml"
    p.write_text("model:\n  preset: uvit-s2-mscoco\n  depth: 16\n")
    cfg = load_config(p, ["model.attention_backend=torch"])
    assert dataclasses.asdict(cfg.model) == {**dataclasses.asdict(UViTConfig()), **UVIT_PRESETS["uvit-s2-mscoco"],
                                             "depth": 16, "attention_backend": "torch"}
    assert "preset" not in cfg.to_dict()["model"] and config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    # An override may name the preset; keys of the file still win over it.
    assert load_config(p, ["model.preset=uvic-s2-cifar10"]).model == UViTConfig.from_preset("uvic-s2-cifar10",
                                                                                           depth=16)
    lm = load_config(None, ["task=lm", "model.preset=tiny", "model.vocab_size=300"]).model
    assert lm == LMModelConfig(**{**COGFORMER_PRESETS["tiny"], "vocab_size": 300})
    with pytest.raises(ConfigError, match=r"^config key model.preset: unknown preset 'uvit-xl'; available: \["):
        load_config(None, ["model.preset=uvit-xl"])
    with pytest.raises(ConfigError, match=r"^config key model.preset: unknown Cogformer preset '7B'"):
        load_config(None, ["task=lm", "model.preset=7B"])
    with pytest.raises(ConfigError, match=r"unknown config key.*train.preset"):
        load_config(None, ["train.preset=fast"])


def test_a_diffusion_section_names_its_schedule():
    """`diffusion: {preset: stable-diffusion}` is Stable Diffusion's discrete schedule (the values diffusers' SD
    configs hold), other keys override it, and the schedules' and samplers' defaults are the same presets."""
    import torch
    from diffusers import DDPMScheduler

    from uvic.config import DiffusionConfig
    from uvic.schedulers import DiscreteSchedule, UViTDPMSolverScheduler, VPSDEEulerMaruyamaScheduler, build_scheduler

    d = load_config(None, ["task=t2i", "diffusion.preset=stable-diffusion", "diffusion.beta_end=0.02"]).diffusion
    assert (d.schedule, d.num_train_timesteps, d.beta_schedule, d.beta_start, d.beta_end) == (
        "discrete", 1000, "scaled_linear", 0.00085, 0.02)
    assert (d.beta_min, d.beta_max, d.time_scale) == (0.1, 20.0, 999.0)  # the other fields keep their defaults
    def config(scheduler):
        return {k: v for k, v in scheduler.config.items() if not k.startswith("_")}

    sd = DiffusionConfig.from_preset("stable-diffusion")
    assert config(build_scheduler("uvit_dpm_solver", sd)) == config(UViTDPMSolverScheduler())
    assert DiscreteSchedule().betas.equal(sd_betas := build_scheduler("uvit_dpm_solver", sd).noise_schedule.betas)
    assert sd_betas.equal(torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2)
    vp = DiffusionConfig.from_preset("vpsde")
    assert vp == DiffusionConfig() and (vp.beta_min, vp.beta_max, vp.time_scale) == (0.1, 20.0, 999.0)
    assert config(build_scheduler("euler_maruyama", vp)) == config(VPSDEEulerMaruyamaScheduler())
    # The discrete defaults are DDPM's linear betas, diffusers' own defaults (not Stable Diffusion's).
    ddpm = DiffusionConfig(schedule="discrete")
    assert ddpm == DiffusionConfig.from_preset("ddpm")
    assert (ddpm.beta_schedule, ddpm.beta_start, ddpm.beta_end) == tuple(
        DDPMScheduler().config[k] for k in ("beta_schedule", "beta_start", "beta_end"))
    with pytest.raises(ConfigError, match=r"^config key diffusion.preset: unknown schedule preset 'sdxl'"):
        load_config(None, ["diffusion.preset=sdxl"])


def test_a_new_sampler_and_preset_are_choices_in_the_config_yaml_and_clis(tmp_path, monkeypatch, capsys):
    """One entry in SAMPLER_TABLE and one in UVIT_PRESETS reach config validation, YAML files, train.py --dry-run,
    sample.py --sampler and the training task's pipeline, with no other edit."""
    import re
    import runpy
    import sys
    from pathlib import Path

    from uvic.models import UVIT_PRESETS
    from uvic.schedulers import SAMPLER_TABLE, VPSDEEulerMaruyamaScheduler
    from uvic.training.tasks.diffusion import DiffusionTask

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match="sample.sampler: 'dummy' is not one of"):
        load_config(None, ["sample.sampler=dummy"])
    with pytest.raises(ConfigError, match="model.preset: unknown preset 'uvic-dummy'"):
        load_config(None, ["model.preset=uvic-dummy"])

    dummy_scheduler = type("DummyScheduler", (VPSDEEulerMaruyamaScheduler,), {})
    monkeypatch.setitem(SAMPLER_TABLE["vpsde"], "dummy", dummy_scheduler)
    dummy_model = {"img_size": 8, "patch_size": 2, "in_chans": 3, "embed_dim": 16, "depth": 2, "num_heads": 2,
                   "attention": "cog"}
    monkeypatch.setitem(UVIT_PRESETS, "uvic-dummy", dummy_model)

    p = tmp_path / "dummy.yaml"
    p.write_text("model:\n  preset: uvic-dummy\nsample:\n  sampler: dummy\n")
    cfg = load_config(p)
    assert {k: getattr(cfg.model, k) for k in dummy_model} == dummy_model and cfg.sample.sampler == "dummy"
    pipe = DiffusionTask(cfg).pipeline(DiffusionTask(cfg).build_model())
    assert type(pipe.scheduler) is dummy_scheduler

    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", ["train.py", str(p), "--dry-run"])
    runpy.run_path("train.py", run_name="__main__")
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["embed_dim"] == 16 and printed["sample"]["sampler"] == "dummy"
    monkeypatch.setattr(sys, "argv", ["sample.py", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path("sample.py", run_name="__main__")
    choices = re.search(r"--sampler \{([^}]*)\}", capsys.readouterr().out)[1].split(",")
    assert e.value.code == 0 and "dummy" in choices and "euler_maruyama" in choices


def test_fid_while_training_defaults_are_the_harness_defaults():
    """train.eval_fid_mode / eval_fid_dims default to what `python -m uvic.fid` does (the config does not import the
    harness to read them; this pins the two statements together)."""
    from uvic.config import TrainConfig
    from uvic.fid.inception import DEFAULT_DIMS, DEFAULT_MODE

    assert (TrainConfig().eval_fid_mode, TrainConfig().eval_fid_dims) == (DEFAULT_MODE, DEFAULT_DIMS)


def test_the_old_lm_placement_key_loads_with_one_warning(tmp_path):
    """`model.num_softmax_layers` (k for both ends) still loads, as does a run config saved before the rename (k and
    the ends as null, which followed it); each with one FutureWarning, and an end given apart wins."""
    from uvic.config import LMModelConfig

    with pytest.warns(FutureWarning, match=r"config section model: num_softmax_layers is the old name") as record:
        cfg = load_config(None, ["task=lm", "model.preset=600M", "model.num_softmax_layers=1",
                                 "model.keep_softmax_last=0"])
    assert len(record) == 1 and (cfg.model.keep_softmax_first, cfg.model.keep_softmax_last) == (1, 0)
    old = yaml.safe_load(load_config(None, ["task=lm"]).to_yaml())  # a run config as the old version saved it
    del old["model"]["keep_softmax_first"], old["model"]["keep_softmax_last"]
    old["model"].update(num_softmax_layers=3, keep_softmax_first=None, keep_softmax_last=None)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.warns(FutureWarning) as record:
        loaded = load_config(tmp_path / "config.yaml")
    assert len(record) == 1 and loaded.model == LMModelConfig(keep_softmax_first=3, keep_softmax_last=3)
    with pytest.raises(ConfigError, match=r"^config key model.num_softmax_layers must be an int >= 0, got -1$"):
        load_config(None, ["task=lm", "model.num_softmax_layers=-1"])
