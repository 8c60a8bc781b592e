"""One config schema for training and sampling: frozen dataclasses, YAML deltas and dotted overrides.

    cfg = load_config("configs/cifar10_uvic_s2.yaml", ["train.batch_size=64", "model.depth=13"])
    model = UViTModel(**dataclasses.asdict(cfg.model))

Every config dataclass of the built-in tasks lives here. A run config's class depends on `task`, through the table
`TASKS` (task name -> run-config class; the training-task classes are `uvic.training.tasks.TASK_CLASSES`):

    task          class                  sections
    "diffusion"   `Config`               model (UViTConfig), diffusion, data (DataConfig), train, sample
    "t2i"         `Text2ImageRunConfig`  the same, with data = Text2ImageDataConfig (stored MS-COCO features)
    "class_cond"  `ClassCondRunConfig`   the same, with data = ImageNetDataConfig (ImageNet pixels or features)
    "lm"          `LMRunConfig`          model (LMModelConfig), data (LMDataConfig), train (LMTrainConfig)

The diffusion defaults are the official CIFAR-10 U-ViT-S/2 recipe (U-ViT `configs/cifar10_uvit_small.py`; see
docs/conventions.md, "Training recipes"), the LM defaults the paper's Sec. 4.1 recipe; `configs/*.yaml` files hold
only what differs. Unknown keys and values of the wrong type are errors that name the key, never silently ignored.
The value rules (a value against its type hint, the range of every numeric key) live in `uvic.values`, which the
checks of a saved model's config.json share (`uvic.models.config_check`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from uvic.attention import ATTENTIONS, BACKENDS, renamed_placement
from uvic.data.imagenet import LATENT_SCALE as IMAGENET_LATENT_SCALE
from uvic.data.images import DATASETS
from uvic.errors import ConfigError
from uvic.guidance import DEFAULT_GUIDANCE_SCALE
from uvic.lm.data import TOKEN_DTYPES
from uvic.lm.synthetic import SYNTHETIC_TASKS
from uvic.presets import UVIT_VAE_SCALE, cogformer_preset, uvit_preset
from uvic.schedulers import sampler_names
from uvic.schedulers.noise_schedule import SCHEDULE_PRESETS, schedule_preset
from uvic.values import RANGES, coerce


class PresetSection:
    """A config section that can start from a named entry of a preset table (the one place those values are
    written): in YAML, `preset: NAME` starts the section from it and the section's other keys override it."""

    # The table's one lookup: name -> the section's fields; raises ValueError for an unknown name.
    preset_kwargs: ClassVar[Callable[[str], dict[str, Any]]]

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Any:
        """The section of preset `name`, with field overrides."""
        return cls(**{**cls.preset_kwargs(name), **overrides})


class ModelSection(PresetSection):
    """A `model` section: a frozen dataclass whose fields are a model's keyword arguments, with the types and
    defaults of the model's own signature, written out field for field (tests/test_config.py keeps the two equal,
    so a new constructor argument fails there until its field is written here).

    Its presets are the model family's preset table (the one place a model size is written):

        model:
          preset: uvit-s2-cifar10
          depth: 13
    """


@dataclass(frozen=True)
class UViTConfig(ModelSection):
    """`UViTModel.__init__` keyword arguments, field for field, with the model's defaults; `preset:` names an entry
    of `UVIT_PRESETS`."""

    preset_kwargs = staticmethod(uvit_preset)

    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    mlp_time_embed: bool = False
    num_classes: int = -1
    clip_dim: int | None = None
    num_clip_token: int = 77
    conv: bool = True
    skip: bool = True
    attention: str = "cog"
    keep_softmax_first: int = 1
    keep_softmax_last: int = 1
    attention_backend: str = "auto"


_VP, _DDPM = SCHEDULE_PRESETS["vpsde"], SCHEDULE_PRESETS["ddpm"]


@dataclass(frozen=True)
class DiffusionConfig(PresetSection):
    """The forward process the model is trained on; it decides the loss and which samplers apply.

    `schedule="vpsde"`: continuous VP-SDE, beta(t) = beta_min + t (beta_max - beta_min), t ~ U(0, 1), the
    network sees `time_scale * t` (U-ViT CIFAR-10). `schedule="discrete"`: DDPM with `num_train_timesteps`
    steps and diffusers' beta schedules; the network sees the diffusers timestep t in [0, T - 1] plus one (U-ViT's
    1-based n, as for MS-COCO). Both conversions: `uvic.schedulers.timesteps.network_timestep`.

    `preset: NAME` names an entry of `uvic.schedulers.noise_schedule.SCHEDULE_PRESETS` ("vpsde", "ddpm",
    "stable-diffusion"). The defaults are U-ViT's VP-SDE and, for the discrete fields, DDPM's linear betas
    (diffusers' `DDPMScheduler` defaults); Stable Diffusion's betas are `preset: stable-diffusion`.
    """

    preset_kwargs = staticmethod(schedule_preset)

    schedule: Literal["vpsde", "discrete"] = _VP["schedule"]
    beta_min: float = _VP["beta_min"]
    beta_max: float = _VP["beta_max"]
    time_scale: float = _VP["time_scale"]
    num_train_timesteps: int = _DDPM["num_train_timesteps"]
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = _DDPM["beta_schedule"]
    beta_start: float = _DDPM["beta_start"]
    beta_end: float = _DDPM["beta_end"]


@dataclass(frozen=True)
class DataConfig:
    """Which image dataset (`name`: "cifar10" | "image_folder" | "digits" | "fashion_mnist") and how it is read (task "diffusion")."""

    name: str = "cifar10"
    root: str = "data/cifar10"
    image_size: int = 32
    # Random horizontal flip, drawn on the training device from the run's seeded generator.
    random_flip: bool = True
    download: bool = True
    num_workers: int = 2
    # image_folder: leave out files that are not readable images (logged) instead of stopping with their name.
    skip_bad_images: bool = False
    # With train.val_every > 0, the share of a dataset without a test split (image_folder, digits) held out for
    # the validation loss, chosen by a fixed seed; CIFAR-10 validates on its test batch and trains on all 50,000.
    val_fraction: float = 0.1


@dataclass(frozen=True)
class Text2ImageDataConfig:
    """MS-COCO features from `python -m uvic.data.mscoco` (task "t2i"; U-ViT's t2i pipeline has no flip)."""

    root: str = "data/coco256_features"
    num_workers: int = 2
    # Probability of replacing the whole context by the empty-caption features (classifier-free guidance training).
    p_uncond: float = 0.1
    # The VAE latent scale (U-ViT MS-COCO: 0.23010, not SD's 0.18215); it becomes `vae.config.scaling_factor`.
    latent_scale: float = UVIT_VAE_SCALE
    # The autoencoder for sample grids and the exported pipeline: U-ViT's autoencoder_kl.pth or a diffusers dir.
    vae: str = ""
    # The CLIP text encoder the exported pipeline carries (a CLIPTextEncoder dir, an open_clip tag or checkpoint
    # file); "" takes the one the features' meta.json records. It must reproduce the stored features.
    text_encoder: str = ""
    # With train.val_every > 0 and no "val" split under root: the share of the training images (with all their
    # captions) held out for the validation loss.
    val_fraction: float = 0.05


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and logging. `batch_size` is global: per process x processes x accumulation."""

    run_dir: str = "runs/cifar10_uvic_s2"
    seed: int = 1234
    max_steps: int = 500_000
    batch_size: int = 128
    grad_accum_steps: int = 1
    # None: whatever `accelerate launch --mixed_precision` / the accelerate config says.
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None
    lr: float = 2e-4
    weight_decay: float = 0.03
    betas: tuple[float, float] = (0.99, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 2500
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 0.0
    ema_decay: float = 0.9999
    gradient_checkpointing: bool = False
    allow_tf32: bool = True
    # torch.set_num_threads for CPU runs; 0 keeps torch's default (one per core).
    cpu_threads: int = 0
    log_every: int = 10
    sample_every: int = 5000
    save_every: int = 50_000
    keep_checkpoints: int = 3
    # "tensorboard", "wandb" (pip install -e ".[wandb]"), "none", or a list such as [tensorboard, wandb].
    log_with: str | tuple[str, ...] = "tensorboard"
    # "" starts fresh (and refuses a run_dir that already has checkpoints), "latest" or a checkpoint path.
    resume: str = ""
    # FID while training (uvic.training.evaluation): every eval_every steps (0 = off), fid{eval_num_images} of the
    # sampling weights against eval_reference (stats .npz, image folder or dataset spec, as `python -m uvic.fid`
    # takes), with eval_sampler / eval_steps ("" / None: the sample section's). The Inception weights: the
    # harness's lookup and checksum unless eval_fid_weights / eval_fid_weights_sha256 ("none": no check) are set.
    # eval_fid_dims: the FID-Inception feature layer (`python -m uvic.fid --dims`): 2048, pool3, is the standard FID;
    # 64, 192 and 768 are quicker (a 64-d covariance instead of a 2048-d one) but give numbers of another scale.
    # eval_fid_mode: the FID pipeline (`python -m uvic.fid --mode`), "pytorch-fid" (U-ViT's numbers) or "tf"; a
    # statistics reference must have been computed in it.
    eval_every: int = 0
    eval_num_images: int = 10_000
    eval_reference: str = ""
    eval_sampler: str = ""
    eval_steps: int | None = None
    eval_fid_weights: str = ""
    eval_fid_weights_sha256: str = ""
    eval_fid_dims: int = 2048
    eval_fid_mode: str = "pytorch-fid"
    # Held-out validation loss (uvic.training.validation): every val_every steps and at the last step (0 = off),
    # the mean loss of the sampling weights over the first val_examples (0: all) examples of the held-out set (the
    # data's test split, else data.val_fraction of the data, which training then never sees), in batches of
    # val_batch_size examples; a diffusion task scores each example at val_timesteps times spanning the schedule.
    # The same weights give the same value in any run, seed or process count (metrics.jsonl: {"step", "val_loss"}).
    val_every: int = 0
    val_examples: int = 10_000
    val_batch_size: int = 64
    val_timesteps: int = 8
    # With each validation: the share of negative attention weight per block (metrics.jsonl: "attn_neg_share"), on
    # the first val_probe_examples held-out examples (0 = off).
    val_probe_examples: int = 4


@dataclass(frozen=True)
class SampleConfig:
    """Sampling during training (grids) and the default sampler of the exported pipeline."""

    # U-ViT's own DPM-Solver for either schedule: the CIFAR-10 training monitor's (noise prediction, logSNR grid)
    # for "vpsde", the MS-COCO evaluation sampler (DPM-Solver++, time-uniform) for "discrete".
    # A name of `uvic.schedulers.SAMPLER_TABLE` (checked by `CHOICES`).
    sampler: str = "uvit_dpm_solver"
    num_inference_steps: int = 50
    # Text-to-image and class-conditional runs with a null class; diffusers' convention (1 + the official scale:
    # MS-COCO's 1.0 is 2.0, ImageNet 256's 0.4 is 1.4).
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    num_images: int = 64
    seed: int = 0
    # Images per pipeline call for the grids (the images do not depend on it).
    batch_size: int = 64


class BaseRunConfig:
    """Serialisation shared by the run configs. A run config is a frozen dataclass deriving from this with a `task`
    field (its row of `TASKS`), a `train` section (`TrainConfig`) and a `data` section with `num_workers`."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (tuples become lists), the form stored in run dirs and checkpoints."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_derived(self, given: dict[str, Any]) -> Any:
        """This config with the values that follow others unless the config sets them (`given`: the nested dict it
        was built from); none here (see `ClassCondRunConfig`)."""
        return self


@dataclass(frozen=True)
class Config(BaseRunConfig):
    """Everything one diffusion run needs. `task` picks the training task (see `uvic.training.tasks`)."""

    task: str = "diffusion"
    # U-ViC-S/2: Cog attention in every block but the first and last executed ones (paper Sec. 4).
    model: UViTConfig = field(default_factory=lambda: UViTConfig.from_preset("uvic-s2-cifar10"))
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)


@dataclass(frozen=True)
class Text2ImageRunConfig(Config):
    """A text-to-image run (`task: t2i`): `Config` with the stored-features data section."""

    task: str = "t2i"
    data: Text2ImageDataConfig = field(default_factory=Text2ImageDataConfig)


@dataclass(frozen=True)
class ImageNetDataConfig:
    """ImageNet for class-conditional training (task "class_cond"; `uvic.data.imagenet`)."""

    # "pixels": the folder holding train/<wnid>/, cropped and resized to image_size (ImageNet 64);
    # "features": the output of `python -m uvic.data.imagenet` (ImageNet 256 / 512 latents).
    source: Literal["pixels", "features"] = "pixels"
    root: str = "data/imagenet"
    image_size: int = 64
    # Classes the data must hold; model.num_classes is this (no null class) or this + 1 (the last id is the null class),
    # and follows it unless the config sets model.num_classes: + 1 exactly when p_uncond > 0 trains the null class.
    num_classes: int = 1000
    # Pixels only (the features hold each image as is and flipped).
    random_flip: bool = True
    # Label dropout to the null class (U-ViT's p_uncond: 0.15 for L, 0.1 for H; 0 for ImageNet 64).
    p_uncond: float = 0.0
    # The VAE latent scale of U-ViT's ImageNet autoencoder (0.18215); it becomes `vae.config.scaling_factor`.
    latent_scale: float = IMAGENET_LATENT_SCALE
    # Features only: the autoencoder for sample grids and the exported pipeline (U-ViT's autoencoder_kl.pth or a dir).
    vae: str = ""
    num_workers: int = 8
    # With train.val_every > 0: the share of the training images (12,812 of ILSVRC-2012's; features: both flips of
    # each) held out for the validation loss.
    val_fraction: float = 0.01


@dataclass(frozen=True)
class ClassCondRunConfig(Config):
    """A class-conditional ImageNet run (`task: class_cond`): `Config` with the ImageNet data section."""

    task: str = "class_cond"
    data: ImageNetDataConfig = field(default_factory=ImageNetDataConfig)

    def with_derived(self, given: dict[str, Any]) -> Any:
        """`model.num_classes` follows the data unless `given` sets it: `data.num_classes`, plus the null class
        when labels are dropped to it (`data.p_uncond` > 0), so that a run on fewer classes changes one key (a
        preset's own value, such as ImageNet 256's 1001, is replaced too)."""
        model = given.get("model")
        if isinstance(model, dict) and "num_classes" in model:
            return self
        num_classes = self.data.num_classes + (1 if self.data.p_uncond > 0 else 0)
        return dataclasses.replace(self, model=dataclasses.replace(self.model, num_classes=num_classes))


# ---------------------------------------------------------------------------------------------------------
# Language models (Cogformer)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LMModelConfig(ModelSection):
    """`CogformerConfig.__init__`'s architecture kwargs with its defaults (the paper's 141M model, Sec. 4.1);
    `preset:` names an entry of `COGFORMER_PRESETS`. Not here: the generation settings and special-token ids
    (`use_cache`, `pad_token_id`, `bos_token_id`, `eos_token_id`, `tie_word_embeddings`), which the LM task's
    export takes from the tokenizer."""

    preset_kwargs = staticmethod(cogformer_preset)

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention: str = "cog"
    keep_softmax_first: int = 1
    keep_softmax_last: int = 1
    attention_backend: str = "auto"
    initializer_range: float = 0.02

    @staticmethod
    def renamed(data: dict[str, Any], where: str) -> dict[str, Any]:
        """`data` with the old placement read: `num_softmax_layers` = k for both ends (an end given apart wins) and
        ends written as null (as run configs saved before the rename hold them: they followed k); one FutureWarning."""
        if "num_softmax_layers" not in data and not any(data.get(k, 0) is None for k in _ENDS):
            return data
        data = dict(data)
        try:
            ends = renamed_placement(data.pop("num_softmax_layers", None), *(data.pop(k, None) for k in _ENDS),
                                     old="num_softmax_layers", where=f"config section {where}",
                                     stacklevel=5)
        except ValueError as e:
            raise ConfigError(f"config key {where}.{e}") from None
        return {**data, **{k: v for k, v in zip(_ENDS, ends) if v is not None}}


_ENDS = ("keep_softmax_first", "keep_softmax_last")


@dataclass(frozen=True)
class LMDataConfig:
    """Token data: a `.bin` of token ids or a text file plus a tokenizer (see `uvic.lm.data.load_tokens`), or a
    synthetic task generated on the fly (`uvic.lm.synthetic`)."""

    # "": the tokens of `path`; "mqar" / "induction": synthetic sequences of block_size tokens over model.vocab_size
    # ids instead (associative recall, a copy task), trained and scored on their answer tokens only.
    synthetic: str = ""
    path: str = ""
    format: str = "auto"  # "auto" (".bin" suffix -> "bin", else "text"), "bin" or "text"
    tokenizer: str = "byte"  # for text: "byte", a tokenizer.json, a sentencepiece .model, or a tokenizer dir
    token_dtype: str = "uint16"  # element type of a .bin file
    block_size: int = 2048  # tokens per training sequence (the paper's context length)
    num_workers: int = 0  # DataLoader workers (windows are cut from an in-memory or memory-mapped array)
    # With train.val_every > 0: the share of the tokens, at the end of the data, held out for the validation loss
    # (whole blocks of block_size); of a synthetic source, round(val_fraction x num_sequences) held-out sequences
    # from their own generators.
    val_fraction: float = 0.01
    # Synthetic sources: training sequences (each made from its index when read), and MQAR's key-value pairs.
    num_sequences: int = 100_000
    num_kv_pairs: int = 8


@dataclass(frozen=True)
class LMTrainConfig(TrainConfig):
    """`TrainConfig` with the paper's LM recipe (Sec. 4.1; App. C uses lr 3.2e-4, warm-up 4800 for 600M/1B):
    AdamW betas (0.9, 0.95), weight decay 0.1 on weight matrices and embeddings (not on norm gains: the LM task's
    parameter groups), clip 1.0, linear warm-up then cosine decay to 4% of the peak; no EMA (the exported model
    is the trained one)."""

    run_dir: str = "runs/lm"
    max_steps: int = 762_940  # 100B tokens / (64 x 2048 tokens per step)
    batch_size: int = 64  # sequences of block_size tokens per optimizer step
    lr: float = 2e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 2000
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = 0.04
    grad_clip: float = 1.0
    ema_decay: float = 0.0
    val_examples: int = 1024  # held-out blocks: 2M tokens at block_size 2048
    val_batch_size: int = 8  # blocks; their logits are (8, block_size, vocab_size) floats


@dataclass(frozen=True)
class LMRunConfig(BaseRunConfig):
    """A Cogformer language-model run (`task: lm`)."""

    task: str = "lm"
    model: LMModelConfig = field(default_factory=LMModelConfig)
    data: LMDataConfig = field(default_factory=LMDataConfig)
    train: LMTrainConfig = field(default_factory=LMTrainConfig)


RunConfig = Config | Text2ImageRunConfig | LMRunConfig | ClassCondRunConfig


# ---------------------------------------------------------------------------------------------------------
# The task table
# ---------------------------------------------------------------------------------------------------------

# `task` in a config -> its run-config class: the task names and the config classes, which is all a config needs.
# The training task of each name (a `uvic.training.tasks.Task` class) is registered where the tasks live,
# `uvic.training.tasks.TASK_CLASSES`, so that this module names nothing above it; a new task adds its run-config
# class here (`uvic.training.tasks.register_task` does both). The config's `task` key, `train.py`, the loop, the
# validation and FID while training all read these two tables.
TASKS: dict[str, type] = {
    "diffusion": Config,
    "t2i": Text2ImageRunConfig,
    "class_cond": ClassCondRunConfig,
    "lm": LMRunConfig,
}


def check_task_name(task: Any) -> str:
    """`task` if `TASKS` holds it; else ConfigError naming the valid tasks."""
    if not isinstance(task, str) or task not in TASKS:
        raise ConfigError(f"config key task: {task!r} is not one of {list(TASKS)}")
    return task


def task_config_class(task: str) -> type:
    """The run-config class of `task`. Raises ConfigError for a name `TASKS` does not hold."""
    return TASKS[check_task_name(task)]


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML deltas at `path`, then dotted `key=value` overrides (values parsed as YAML).

    `path` may also be a training run dir: its `config.yaml` (the run's resolved config) is read, with
    `train.run_dir` set to that dir (wherever the run was started from or moved to) and `train.resume` to "" (pass
    `train.resume=latest`, `train.py --resume`, to continue it).

    Raises:
        FileNotFoundError: `path` does not exist.
        ConfigError (a ValueError): `path` is a directory without `config.yaml` or not UTF-8 text, a YAML syntax
            error, an unknown key, a value of the wrong type or out of range, or a malformed override.
    """
    data: dict[str, Any] = {}
    run_dir = None
    if path is not None and Path(path).is_dir():
        run_dir, path = Path(path), Path(path) / "config.yaml"
        if not path.is_file():
            raise ConfigError(f"config file {run_dir} is a directory, not a YAML file or a run dir (no config.yaml "
                              f"in it)")
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory, not a YAML file")
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {type(e).__name__}: {e}") from None
        loaded = _parse_yaml(text, f"config file {path}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a config file must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    if run_dir is not None and isinstance(data.get("train", {}), dict):
        data["train"] = {**data.get("train", {}), "run_dir": str(run_dir), "resume": ""}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = data
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[leaf] = _parse_yaml(raw, f"override {item!r}")
    return config_from_dict(data)


def _parse_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)`, with a syntax error reported as one line naming `where`, the line and the column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build the run config of `data["task"]` from a (possibly partial) nested dict, checking every key and type.

    Each section starts from the run config's default for it, or from the preset its `preset` key names (model
    and diffusion sections, `PresetSection`), and the keys given replace those values.
    """
    task = data.get("task", "diffusion") if isinstance(data, dict) else "diffusion"
    cls = task_config_class(task)
    return validate_ranges(_build(cls, data, prefix="", base=cls()).with_derived(data))


def _build(cls: type, data: Any, prefix: str, base: Any) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}: {data!r}")
    if hasattr(cls, "renamed"):  # a section that still reads keys of an old name
        data = cls.renamed(data, where)
    names = {f.name for f in dataclasses.fields(cls)}
    if issubclass(cls, PresetSection):
        names.add("preset")
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys in {where}: {sorted(names)}")
    data = dict(data)
    if "preset" in data:
        preset = data.pop("preset")
        try:
            base = cls.from_preset(coerce(preset, str, prefix + "preset"))
        except ValueError as e:
            raise ConfigError(f"config key {prefix}preset: {e}") from None
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix + name + ".", getattr(base, name))
        else:
            kwargs[name] = coerce(value, hint, prefix + name)
    return dataclasses.replace(base, **kwargs)


def numeric_fields(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every int / float field (tuples included) of a config, recursively; bools excluded."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(numeric_fields(value, f"{prefix}{f.name}."))
        elif _is_number(value) or (isinstance(value, tuple) and value and all(_is_number(v) for v in value)):
            out[prefix + f.name] = value
        elif value is None and _numeric_hint(typing.get_type_hints(type(cfg))[f.name]):
            out[prefix + f.name] = value
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numeric_hint(hint: Any) -> bool:
    return hint in (int, float) or any(_numeric_hint(a) for a in typing.get_args(hint))


# The allowed values of fields with a fixed set of values (names, the FID network's feature layers), by dotted key.
# Each is read from its table when a config is checked, so a new entry (a sampler in SAMPLER_TABLE, an attention
# kind) is a valid value at once.
CHOICES: dict[str, Callable[[], tuple[Any, ...]]] = {
    "task": lambda: tuple(TASKS),
    "model.attention": lambda: ATTENTIONS,
    "model.attention_backend": lambda: BACKENDS,
    "data.name": lambda: tuple(DATASETS),
    "data.token_dtype": lambda: TOKEN_DTYPES,
    "data.synthetic": lambda: ("", *SYNTHETIC_TASKS),
    "sample.sampler": sampler_names,
    "train.eval_sampler": lambda: ("", *sampler_names()),
    "train.eval_fid_dims": lambda: importlib.import_module("uvic.fid.inception").DIMS,
    "train.eval_fid_mode": lambda: importlib.import_module("uvic.fid.inception").MODES,
}


def _check_choices(cfg: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_choices(value, key + ".")
        elif key in CHOICES and value not in (choices := CHOICES[key]()):
            raise ConfigError(f"config key {key}: {value!r} is not one of {list(choices)}")


def validate_ranges(cfg: Any) -> Any:
    """Check every numeric field of `cfg` against `RANGES` (None = unset passes; floats must be finite) and every
    named choice against `CHOICES`; returns `cfg`.

    Raises:
        ConfigError: the first field out of range, e.g. "config key train.max_steps: must be >= 1, got 0".
    """
    _check_choices(cfg)
    t = getattr(cfg, "train", None)
    if t is not None and not t.run_dir.strip():
        raise ConfigError("config key train.run_dir: must not be empty (the run would write into the current "
                          "directory)")
    for key, value in numeric_fields(cfg).items():
        if value is None:
            continue
        ok, text = RANGES.get(key, (lambda v: True, ""))
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config key {key}: must be a finite number, got {value!r}")
            if not ok(v):
                raise ConfigError(f"config key {key}: must be {text}, got {value!r}")
    d = getattr(cfg, "diffusion", None)
    if d is not None and d.beta_max < d.beta_min:
        raise ConfigError(f"config keys diffusion.beta_min / beta_max: beta_max ({d.beta_max}) must be >= beta_min "
                          f"({d.beta_min})")
    return cfg
