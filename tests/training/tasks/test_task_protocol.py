"""Every task of the table implements the `Task` protocol with the protocol's own signatures, the config's task names
are the task table's, and a new task is one `register_task` call: a dummy task registered so loads its config,
builds and trains."""

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

import uvic.config
import uvic.training.tasks
from uvic.config import TASKS, BaseRunConfig, TrainConfig, load_config
from uvic.errors import ConfigError
from uvic.schedulers import build_scheduler
from uvic.training.checkpoint import list_checkpoints
from uvic.training.tasks import TASK_CLASSES, Task, build_task, register_task, task_class


PROTOCOL_METHODS = ["build_model", "build_dataset", "validation_set", "validation_split", "param_groups", "loss",
                    "validation_losses", "validation_metrics", "load_vae", "pipeline", "image_conditions", "on_sample",
                    "export"]


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_the_config_and_the_task_table_name_the_same_tasks():
    assert list(TASKS) == list(TASK_CLASSES) == ["diffusion", "t2i", "class_cond", "lm"]


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_has_the_protocol_methods_and_signatures(name):
    cls = task_class(name)
    assert PROTOCOL_METHODS == [m for m in vars(Task) if not m.startswith("_")]
    assert isinstance(cls.makes_images, bool)
    for method in PROTOCOL_METHODS:
        assert _params(getattr(cls, method)) == _params(getattr(Task, method)), (name, method)


def test_diffusion_pipeline_takes_the_sampler_by_keyword_and_refuses_a_vae():
    task = task_class("diffusion")(load_config(None, ["model.depth=2", "model.embed_dim=16", "model.num_heads=2",
                                                      "model.img_size=8"]))
    model = task.build_model()
    configured = type(build_scheduler(task.cfg.sample.sampler, task.cfg.diffusion))
    assert type(task.pipeline(model).scheduler) is configured
    pipe = task.pipeline(model, sampler="euler_maruyama")
    euler = type(build_scheduler("euler_maruyama", task.cfg.diffusion))
    assert pipe.transformer is model and type(pipe.scheduler) is euler is not configured
    with pytest.raises(ValueError, match="pixel space: its pipeline takes no vae"):
        task.pipeline(model, vae=torch.nn.Identity())


def test_the_language_model_task_has_no_image_pipeline():
    task = task_class("lm")(load_config(None, ["task=lm"]))
    assert not task.makes_images
    for call in (lambda: task.pipeline(torch.nn.Identity(), sampler="ddim"), task.load_vae,
                 lambda: task.image_conditions("grid", 4)):
        with pytest.raises(ValueError, match="an 'lm' run has no image pipeline.*AutoModelForCausalLM"):
            call()


def test_an_unknown_task_is_a_config_error_naming_the_tasks():
    for load in (lambda: load_config(None, ["task=nope"]), lambda: load_config(None, ["task=[lm]"]),
                 lambda: task_class("nope")):
        with pytest.raises(ConfigError, match=r"config key task: .* is not one of \['diffusion', 't2i', 'class_cond', "
                                              r"'lm'\]"):
            load()


# A task outside the package: a linear regression y = x w* on random data, written as a new task would be.


@dataclass(frozen=True)
class DummyData:
    num_items: int = 16
    num_workers: int = 0


@dataclass(frozen=True)
class DummyRunConfig(BaseRunConfig):
    task: str = "dummy"
    data: DummyData = field(default_factory=DummyData)
    train: TrainConfig = field(default_factory=TrainConfig)


class DummyTask:
    makes_images = False

    def __init__(self, cfg):
        self.cfg = cfg

    def build_model(self):
        return torch.nn.Linear(3, 1, bias=False)

    def build_dataset(self):
        return self._items(0)

    def validation_set(self):
        return self._items(1)

    def validation_split(self):
        return "a second random draw"

    def _items(self, seed):
        x = torch.randn(self.cfg.data.num_items, 3, generator=torch.Generator().manual_seed(seed))
        return _Items(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]])))

    def param_groups(self, model, weight_decay):
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]

    def loss(self, model, batch, rng):
        return (model(batch["x"]) - batch["y"]).pow(2).mean()

    def validation_losses(self, model, batch, index):
        err = (model(batch["x"]) - batch["y"])[:, 0]
        return {"val_loss": err.pow(2), "val_abs": err.abs()}

    def validation_metrics(self, means):
        return {**means, "val_rmse": means["val_loss"] ** 0.5}

    def load_vae(self):
        raise ValueError("no images")

    def pipeline(self, model, *, sampler=None, vae=None):
        raise ValueError("no images")

    def image_conditions(self, purpose, num_images):
        raise ValueError("no images")

    def on_sample(self, model, step, run_dir):
        return None

    def export(self, model, out_dir):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "w.json").write_text(json.dumps(model.weight.detach().flatten().tolist()))


class _Items(torch.utils.data.Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        x, y = self.pairs[i]
        return {"x": x, "y": y}


def test_a_new_task_is_one_register_call(tmp_path, monkeypatch):
    """`register_task` puts the task class in the task table and its run config in the config's: the config loads
    with the dummy's sections, `build_task` builds it, and `train` runs it end to end (checkpoint, validation,
    export)."""
    monkeypatch.setattr(uvic.config, "TASKS", dict(TASKS))  # both tables are restored after the test
    monkeypatch.setattr(uvic.training.tasks, "TASK_CLASSES", dict(TASK_CLASSES))
    register_task("dummy", DummyTask, DummyRunConfig)
    assert uvic.config.TASKS["dummy"] is DummyRunConfig and task_class("dummy") is DummyTask
    cfg = load_config(None, ["task=dummy", "data.num_items=4", f"train.run_dir={tmp_path / 'run'}",
                             "train.max_steps=2", "train.batch_size=4", "train.warmup_steps=0", "train.lr=0.1",
                             "train.save_every=2", "train.log_every=1", "train.log_with=none", "train.ema_decay=0",
                             "train.val_every=2", "train.val_batch_size=3"])
    assert type(cfg) is DummyRunConfig and cfg.data.num_items == 4
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['model'\]; valid keys in config: \['data', "
                                          r"'task', 'train'\]"):
        load_config(None, ["task=dummy", "model.depth=2"])
    assert isinstance(build_task(cfg), DummyTask)
    from uvic.training import train

    run = train(cfg)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert len(losses) == 2 and losses[1] < losses[0]  # full-batch Adam steps on a linear regression
    trained = load_file(str(list_checkpoints(run)[-1][1] / "model.safetensors"))["weight"]
    # The validation of step 2, from the task's own methods: the mean squared and absolute errors on its 4 held-out
    # items, and their root.
    x, y = DummyTask(cfg)._items(1).pairs.tensors
    err = (x @ trained.T - y)[:, 0].double()
    val = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in val] == [2] and set(val[0]) == {"step", "val_loss", "val_abs", "val_rmse"}
    assert val[0]["val_loss"] == pytest.approx(float(err.pow(2).mean()), rel=1e-6)
    assert val[0]["val_abs"] == pytest.approx(float(err.abs().mean()), rel=1e-6)
    assert val[0]["val_rmse"] == pytest.approx(float(err.pow(2).mean().sqrt()), rel=1e-6)
    assert json.loads((run / "pipeline" / "w.json").read_text()) == trained.flatten().tolist()
    assert load_config(run / "config.yaml") == cfg  # the resolved config reloads through the table
