"""The LM task pieces: a tiny model learns a text file, the paper's optimizer/schedule, loss and data wiring."""

import math
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from uvic.lm.config import LMDataConfig, LMModelConfig, LMOptimConfig
from uvic.lm.data import write_token_bin
from uvic.lm.task import (
    LMTask,
    build_dataloader,
    build_dataset,
    build_lr_scheduler,
    build_model,
    build_optimizer,
    loss,
    model_config_from_preset,
    train_tiny,
)
from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM


def small_text(path):
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps near the warm fire".split()
    path.write_text("\n".join(" ".join(rng.sample(words, 6)) + "." for _ in range(50)), encoding="utf-8")
    return path


def test_tiny_cogformer_learns_a_text_file(tmp_path):
    """Training loss on a small file falls well below the unigram entropy (the best context-free model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: threading only adds overhead here
    try:
        result = train_tiny(small_text(tmp_path / "data.txt"), tmp_path / "run", steps=100, batch_size=8, block_size=64)
    finally:
        torch.set_num_threads(threads)
    assert result.initial_loss > result.unigram_entropy  # random init starts above the unigram model
    assert result.final_loss < 0.5 * result.unigram_entropy
    # The saved directory loads through the transformers Auto classes and continues the text sensibly.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    tok = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert isinstance(model, CogformerForCausalLM) and model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("the quick brown fox jumps over the", add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :].tolist())
    vocab = set("the quick brown fox jumps over the lazy dog while a cat sleeps near the warm fire .\n")
    assert set(text) <= vocab  # only characters of the training text


def test_lm_model_config_fields_are_cogformer_kwargs():
    import dataclasses
    import inspect

    fields = {f.name for f in dataclasses.fields(LMModelConfig)}
    params = set(inspect.signature(CogformerConfig.__init__).parameters)
    assert fields <= params
    # Architecture kwargs not in the dataclass are only token ids / cache / tying flags.
    assert params - fields - {"self", "kwargs"} == {
        "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    }  # fmt: skip
    with torch.device("meta"):
        model = build_model(LMModelConfig())
    assert model.config.hidden_size == 768 and model.config.attention_types()[:2] == ["softmax", "cog"]


def test_paper_optimizer_defaults_and_groups():
    cfg = LMOptimConfig()
    assert (cfg.lr, tuple(cfg.betas), cfg.weight_decay, cfg.grad_clip, cfg.min_lr_ratio) == (
        2e-4, (0.9, 0.95), 0.1, 1.0, 0.04,
    )  # fmt: skip
    model = build_model(model_config_from_preset("tiny"))
    opt = build_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0 and decay["betas"] == (0.9, 0.95)
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())


def test_schedule_is_warmup_then_cosine_to_4_percent():
    """Paper Sec. 4.1: linear warm-up, then cosine decay to 4% of the peak, checked against the closed form."""
    cfg = LMOptimConfig(lr=1.0, warmup_steps=10, max_steps=100)
    p = torch.nn.Parameter(torch.zeros(1))
    sched = build_lr_scheduler(torch.optim.SGD([p], lr=1.0), cfg)
    got = []
    for _ in range(101):
        got.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    expected = [s / 10 for s in range(10)] + [
        0.04 + 0.96 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90)) for s in range(10, 101)
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    assert got[10] == pytest.approx(1.0) and got[100] == pytest.approx(0.04)


def test_loss_ignores_padding_and_dataset_from_bin(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 257, size=600)
    write_token_bin(tokens, tmp_path / "train.bin")
    ds = build_dataset(LMDataConfig(path=str(tmp_path / "train.bin"), block_size=32))
    assert len(ds) == 18 and ds[1]["input_ids"].tolist() == tokens[32:64].tolist()
    batch = next(iter(build_dataloader(ds, batch_size=4, seed=0)))
    assert batch["input_ids"].shape == (4, 32)
    torch.manual_seed(0)
    model = build_model(model_config_from_preset("tiny")).eval()
    ids = batch["input_ids"][:1, :20]
    padded = torch.cat([torch.full((1, 5), 256), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], 1)
    with torch.no_grad():
        a = loss(model, {"input_ids": ids})
        b = loss(model, {"input_ids": padded, "attention_mask": mask})
        right = torch.cat([ids, torch.full((1, 5), 256)], 1)
        c = loss(model, {"input_ids": right, "attention_mask": mask.flip(1)})
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no data path"):
        build_dataset(LMDataConfig(path=str(tmp_path / "train.bin")), split="val")


def test_lm_task_for_the_shared_loop(tmp_path):
    """The Task-protocol object: dataset, loss, a text sample and a save_pretrained export."""
    small_text(tmp_path / "data.txt")
    task = LMTask(
        model_config_from_preset("tiny"), LMDataConfig(path=str(tmp_path / "data.txt"), block_size=32),
        sample_prompt="the", sample_tokens=5,
    )  # fmt: skip
    model = task.build_model()
    ds = task.build_dataset()
    batch = next(iter(build_dataloader(ds, 4)))
    value = task.loss(model, batch, rng=None)
    assert value.ndim == 0 and torch.isfinite(value)
    task.on_sample(model, 7, tmp_path)
    text = (tmp_path / "samples" / "step_0000007.txt").read_text(encoding="utf-8")
    assert text.startswith("the") and len(text) > 3  # 5 random bytes follow (not always valid UTF-8)
    task.export(model, tmp_path / "export")
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "export"), CogformerForCausalLM)
    assert AutoTokenizer.from_pretrained(tmp_path / "export").encode("ab", add_special_tokens=False) == [97, 98]
    small_vocab = LMTask(model_config_from_preset("tiny", vocab_size=50), task.data_cfg)
    with pytest.raises(ValueError, match="vocab_size"):
        small_vocab.build_dataset()


def test_train_cli_writes_a_loadable_directory(tmp_path):
    from uvic.lm.train import main

    small_text(tmp_path / "data.txt")
    threads = torch.get_num_threads()
    try:
        main(["--text", str(tmp_path / "data.txt"), "--out", str(tmp_path / "run"), "--steps", "3", "--batch-size", "2"])
    finally:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    assert model.config.attention_types() == ["softmax", "cog", "cog", "softmax"]
