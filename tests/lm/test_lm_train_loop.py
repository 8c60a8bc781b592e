"""train.py's LM task: configs/lm_*.yaml through the shared loop (checkpoints, exact resume, HF export)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from uvic.config import LMRunConfig, load_config
from uvic.lm.data import unigram_entropy
from uvic.lm.task import LMTask
from uvic.training import train
from uvic.training.checkpoint import list_checkpoints


ROOT = Path(__file__).resolve().parents[2]


def _overrides(run, text, **extra):
    base = {"data.path": str(text), "data.block_size": 32, "train.run_dir": str(run), "train.batch_size": 8,
            "train.max_steps": 6, "train.warmup_steps": 2, "train.save_every": 3, "train.log_every": 1,
            "train.sample_every": 0, "train.log_with": "none", "train.cpu_threads": 1}  # fmt: skip
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return path


def test_lm_config_has_the_paper_defaults():
    cfg = load_config(ROOT / "configs" / "lm_cogformer_141m.yaml")
    assert isinstance(cfg, LMRunConfig) and cfg.task == "lm"
    assert cfg.model.num_hidden_layers == 12 and cfg.model.hidden_size == 768 and cfg.model.vocab_size == 32000
    t = cfg.train
    assert (t.betas, t.weight_decay, t.grad_clip, t.lr_schedule, t.min_lr_ratio) == ((0.9, 0.95), 0.1, 1.0, "cosine",
                                                                                      0.04)
    assert load_config(None, ["task=lm"]).train.betas == (0.9, 0.95)  # defaults, not the CIFAR-10 ones


def test_lm_resume_is_exact_and_export_loads(tmp_path, monkeypatch):
    text = _text(tmp_path)
    tiny = ROOT / "configs" / "lm_tiny.yaml"
    full, part = tmp_path / "full", tmp_path / "part"
    train(load_config(tiny, _overrides(full, text)))
    # Interrupt the second run during step 5 (after the step-3 checkpoint), with the same cosine schedule.
    calls = {"n": 0}
    real_loss = LMTask.loss

    def interrupted(self, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_loss(self, *args, **kw)

    monkeypatch.setattr(LMTask, "loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(tiny, _overrides(part, text)))
    monkeypatch.setattr(LMTask, "loss", real_loss)
    assert [s for s, _ in list_checkpoints(part)] == [3]
    train(load_config(tiny, _overrides(part, text, **{"train.resume": "latest"})))
    a = load_file(str(list_checkpoints(full)[-1][1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(part)[-1][1] / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    model = AutoModelForCausalLM.from_pretrained(full / "pipeline")
    assert type(model).__name__ == "CogformerForCausalLM"
    for k, v in model.state_dict().items():  # the export is the trained model (no EMA for LMs)
        torch.testing.assert_close(v, a[k], rtol=0, atol=0)


def test_lm_learns_through_train_py_loop(tmp_path):
    text = _text(tmp_path)
    run = tmp_path / "learn"
    train(load_config(ROOT / "configs" / "lm_tiny.yaml", _overrides(run, text, **{"train.max_steps": 80,
                                                                                  "train.save_every": 80})))
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    h = unigram_entropy(np.frombuffer(text.read_bytes(), dtype=np.uint8))  # nats per token of the unigram model
    assert math.isfinite(losses[-1]) and losses[-1] < 0.5 * h, (losses[0], losses[-1], h)
