"""The held-out validation loss (`train.val_every`): the hold-out split, the value's independence from the batch,
the process count (here as shards; a real 2-process launch in tests/test_scripts.py), the run's seed and the time
it is computed, its lines in metrics.jsonl, and an exact resume."""

import json
import pickle
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from uvic.config import load_config
from uvic.training import train
from uvic.training.checkpoint import checkpoint_dir, list_checkpoints, remove_dir
from uvic.training.logs import read_metrics
from uvic.training.tasks import build_task
from uvic.training.validation import VALIDATION_SEED, Validator, hold_out, tracker_values


ROOT = Path(__file__).resolve().parents[2]


def _state(rank=0, world=1):
    return SimpleNamespace(device=torch.device("cpu"), process_index=rank, num_processes=world, autocast=nullcontext)


def _digits(run_dir, **extra):
    """A seconds-long run of a tiny U-ViC on the 8x8 digits, validating every 2 steps on 5% of them (90 digits)."""
    base = {"model.img_size": 8, "model.patch_size": 4, "model.in_chans": 1, "model.embed_dim": 16, "model.depth": 2,
            "model.num_heads": 2, "model.attention_backend": "torch", "data.name": "digits", "data.image_size": 8,
            "data.random_flip": False, "data.num_workers": 0, "data.val_fraction": 0.05, "train.run_dir": str(run_dir),
            "train.batch_size": 8, "train.max_steps": 4, "train.warmup_steps": 1, "train.lr": 1e-3,
            "train.ema_decay": 0.9, "train.log_every": 1, "train.sample_every": 0, "train.save_every": 2,
            "train.log_with": "none", "train.cpu_threads": 1, "train.val_every": 2, "train.val_batch_size": 16,
            "train.val_timesteps": 3}
    base.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


# 1. What is held out.


def test_hold_out_is_fixed_disjoint_and_keeps_groups_together():
    train_idx, held = hold_out(100, 0.1)
    assert len(held) == 10 and len(train_idx) == 90 and sorted([*train_idx, *held]) == list(range(100))
    assert list(train_idx) == sorted(train_idx) and sorted(held) != list(held)  # a random subset, in random order
    again_train, again_held = hold_out(100, 0.1)
    assert np.array_equal(held, again_held) and np.array_equal(train_idx, again_train)  # no seed, no state
    # Groups (the captions of one image, the flips of one image): 20 groups of 3, 2 of them held out whole.
    groups = np.repeat(np.arange(20), 3)
    train_idx, held = hold_out(60, 0.1, groups)
    assert len(held) == 6 and set(groups[held]).isdisjoint(groups[train_idx])
    assert list(groups[held][::3]) == list(groups[held][1::3]) == list(groups[held][2::3])
    for fraction, n in ((0.01, 20), (0.99, 20)):  # 0 groups or all of them
        with pytest.raises(ValueError, match="data.val_fraction=.* holds out"):
            hold_out(n, fraction)


def test_the_digits_demo_holds_out_10_percent_and_cifar10_its_test_batch(tmp_path):
    cfg = load_config(ROOT / "configs" / "demo_digits.yaml")
    assert cfg.train.val_every > 0 and cfg.data.val_fraction == 0.1
    task = build_task(cfg)
    trained, held = task.build_dataset(), task.validation_set()
    assert (len(trained), len(held)) == (1617, 180)
    assert set(trained.indices).isdisjoint(held.indices)
    # Recorded for the report: what is held out, how many of them are scored (the first train.val_examples).
    assert task.validation_split() == "data.val_fraction=0.1 of the data, held out"
    cfg16 = load_config(ROOT / "configs" / "demo_digits.yaml", ["train.val_examples=16"])
    Validator(cfg16, build_task(cfg16), _state()).record(tmp_path)
    assert json.loads((tmp_path / "validation.json").read_text()) == {
        "split": "data.val_fraction=0.1 of the data, held out", "examples": 16, "held_out": 180}
    # CIFAR-10: the test batch is the held-out set, and all 50,000 (here 10) training images are trained on.
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rows = np.random.default_rng(5).integers(0, 256, (14, 3072), dtype=np.uint8)
    parts = {**{f"data_batch_{b}": rows[2 * b - 2 : 2 * b] for b in range(1, 6)}, "test_batch": rows[10:]}
    for name, part in parts.items():
        with open(folder / name, "wb") as f:
            pickle.dump({"data": part, "labels": [0] * len(part)}, f)
    task = build_task(load_config(None, [f"data.root={tmp_path}", "data.download=false", "train.val_every=5"]))
    assert len(task.build_dataset()) == 10 and len(task.validation_set()) == 4
    assert task.validation_split() == "the data's test split"
    expected = torch.from_numpy(rows[13].reshape(3, 32, 32)).float() / 127.5 - 1  # the last test image
    torch.testing.assert_close(task.validation_set()[3]["x"], expected)


# 2. The value depends on the weights alone.


def test_the_loss_of_each_example_is_the_stratified_epsilon_loss_of_its_own_draws():
    """Recomputed here example by example from the definition: times (k + u_k) / K, u and eps drawn from the
    example's generator, x_t = sqrt(abar) x0 + sqrt(1 - abar) eps, the network at 999 t."""
    cfg = _digits("unused", **{"train.val_timesteps": 4})
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model().eval()
    held = task.validation_set()
    index = torch.tensor([5, 0, 17])
    batch = {"x": torch.stack([held[int(i)]["x"] for i in index])}
    with torch.no_grad():
        got = task.validation_losses(model, batch, index)["val_loss"]
        for b, i in enumerate(index.tolist()):
            g = torch.Generator().manual_seed(VALIDATION_SEED + i)
            u, eps = torch.rand(4, generator=g), torch.randn(4, 1, 8, 8, generator=g)
            losses = []
            for k in range(4):
                t = (k + u[k]) / 4
                log_mean = -0.25 * t**2 * (20.0 - 0.1) - 0.5 * t * 0.1  # VP-SDE, beta in [0.1, 20]
                ab = torch.exp(2 * log_mean)
                x_t = ab.sqrt() * batch["x"][b] + (1 - ab).sqrt() * eps[k]
                pred = model(x_t[None], (999 * t)[None]).sample[0]
                losses.append((eps[k] - pred).pow(2).mean())
            torch.testing.assert_close(got[b], torch.stack(losses).mean(), rtol=1e-5, atol=1e-6)
    assert all(k <= 4 * t < k + 1 for k, t in enumerate((torch.arange(4) + u) / 4))  # one time per quarter


def test_one_process_and_two_shards_give_the_same_value_bit_for_bit():
    cfg = _digits("unused", **{"train.val_batch_size": 7})
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model().eval()
    one = Validator(cfg, task, _state())
    shards = [Validator(cfg, task, _state(r, 2)) for r in range(2)]
    assert sorted(i for v in shards for b in v.batches for i in b) == list(range(one.num_examples)) == list(range(90))
    value = one.validate(model)
    assert value == one.validate(model)  # every evaluation of the same weights
    assert shards[0].combine(shards[0].local_values(model) + shards[1].local_values(model)) == {
        "val_loss": value["val_loss"]}  # the attention probe, `attn_neg_share`, is the same on every process
    # Another run seed and another training batch size draw the same examples, noise and times.
    other = _digits("unused", **{"train.val_batch_size": 7, "train.seed": 99, "train.batch_size": 16})
    assert Validator(other, build_task(other), _state()).validate(model) == value
    # Another validation batch size: the same draws, only the float sums of the network may round differently.
    other = _digits("unused", **{"train.val_batch_size": 90})
    assert Validator(other, build_task(other), _state()).validate(model)["val_loss"] == pytest.approx(
        value["val_loss"], rel=1e-6)


# 3. In the training loop.


def test_validation_lines_in_metrics_jsonl_and_the_trackers(tmp_path):
    run = train(_digits(tmp_path / "run", **{"train.max_steps": 5}))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4, 5]  # every 2 steps and the last
    assert all(set(r) == {"step", "val_loss", "attn_neg_share"} and np.isfinite(r["val_loss"]) for r in val)
    # The tiny U-ViC's three blocks in execution order: softmax, Cog, softmax.
    assert all(list(r["attn_neg_share"]) == ["in_blocks.0", "mid_block", "out_blocks.0"] for r in val)
    assert all(r["attn_neg_share"]["in_blocks.0"] == r["attn_neg_share"]["out_blocks.0"] == 0.0 for r in val)
    assert all(0 < r["attn_neg_share"]["mid_block"] < 1 for r in val)
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5]
    assert [(r["step"], "val_loss" in r) for r in read_metrics(run / "metrics.jsonl")] == [
        (1, False), (2, False), (2, True), (3, False), (4, False), (4, True), (5, False), (5, True)]
    # The last value is the exported weights' own (the EMA of the last checkpoint), scored again afterwards.
    cfg = _digits(tmp_path / "run")
    task = build_task(cfg)
    model = task.build_model()
    model.load_state_dict(load_file(str(checkpoint_dir(run, 5) / "ema.safetensors")))
    assert Validator(cfg, task, _state()).validate(model.eval()) == {k: v for k, v in val[-1].items() if k != "step"}
    # What the values are over: round(5% of the 1,797 digits) = 90 held out, all scored (train.val_examples 10,000).
    assert json.loads((run / "validation.json").read_text()) == {
        "split": "data.val_fraction=0.05 of the data, held out", "examples": 90, "held_out": 90}
    assert (run / "loss_curve.png").is_file()


def test_the_attention_probe_scores_the_first_held_out_examples_the_same_in_every_run():
    """`attn_neg_share` is the probe (uvic.attention_probe) of the first `train.val_probe_examples` held-out examples
    run through the task's own validation (its noise and times): the same for any validation batch size, run seed
    or process, and absent with 0 probe examples."""
    from uvic.attention_probe import probe_attention

    cfg = _digits("unused", **{"train.val_batch_size": 7, "train.val_probe_examples": 3})
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model().eval()
    validator = Validator(cfg, task, _state())
    shares = validator.attention_shares(model)
    held = task.validation_set()
    batch = {k: torch.stack([held[i][k] for i in range(3)]) for k in held[0]}
    with torch.inference_mode(), probe_attention(model) as probe:
        task.validation_losses(model, batch, torch.arange(3))
    assert shares == probe.negative_shares() and list(shares) == ["in_blocks.0", "mid_block", "out_blocks.0"]
    assert validator.validate(model)["attn_neg_share"] == shares
    for extra in ({"train.val_batch_size": 90, "train.seed": 99}, {"train.val_examples": 3}):
        other = _digits("unused", **{"train.val_probe_examples": 3, **extra})
        assert Validator(other, build_task(other), _state()).attention_shares(model) == shares
    assert [Validator(cfg, task, _state(r, 2)).attention_shares(model) for r in range(2)] == [shares, shares]
    # Another probe batch gives another value; none, no key.
    other = _digits("unused", **{"train.val_probe_examples": 5})
    assert Validator(other, build_task(other), _state()).attention_shares(model)["mid_block"] != shares["mid_block"]
    off = _digits("unused", **{"train.val_probe_examples": 0})
    assert set(Validator(off, build_task(off), _state()).validate(model)) == {"val_loss"}
    # The trackers get scalars: the shares as attn_neg_share/<block>.
    assert tracker_values({"val_loss": 0.5, "attn_neg_share": shares}) == {
        "val_loss": 0.5, **{f"attn_neg_share/{b}": v for b, v in shares.items()}}


def test_a_killed_and_resumed_run_writes_the_lines_of_an_uninterrupted_one(tmp_path):
    extra = {"train.max_steps": 6, "train.save_every": 3}
    full = train(_digits(tmp_path / "full", **extra))
    # Killed after validating step 4 and before saving it: the last complete checkpoint is step 3.
    part = train(_digits(tmp_path / "part", **{**extra, "train.max_steps": 4}))
    remove_dir(checkpoint_dir(part, 4))
    assert [s for s, _ in list_checkpoints(part)] == [3]
    assert '"step": 4, "val_loss"' in (part / "metrics.jsonl").read_text()
    train(_digits(tmp_path / "part", **{**extra, "train.resume": "latest"}))
    assert (part / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


def test_validation_refuses_a_fraction_that_holds_out_nothing_before_training(tmp_path):
    with pytest.raises(ValueError, match="data.val_fraction=0.0001 of 1797 items holds out 0"):
        train(_digits(tmp_path / "run", **{"data.val_fraction": 0.0001}))
    assert not list_checkpoints(tmp_path / "run")
