"""The LM task through the one training loop: the paper's recipe (weight-decay groups, warm-up + cosine), the loss,
the data wiring, exact resume, and a tiny Cogformer that learns a text file through `train(cfg)`."""

import dataclasses
import inspect
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from uvic.config import LMDataConfig, LMModelConfig, LMRunConfig, load_config
from uvic.lm.data import unigram_entropy, write_token_bin
from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM
from uvic.training import train
from uvic.training.checkpoint import list_checkpoints
from uvic.training.loop import lr_lambda
from uvic.training.tasks.lm import LMTask, build_dataset, build_model, lm_loss


ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "lm_tiny.yaml"


def small_text(path):
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps near the warm fire".split()
    path.write_text("\n".join(" ".join(rng.sample(words, 6)) + "." for _ in range(50)), encoding="utf-8")
    return path


def _overrides(run, text, **extra):
    base = {"data.path": str(text), "data.block_size": 32, "train.run_dir": str(run), "train.batch_size": 8,
            "train.max_steps": 6, "train.warmup_steps": 2, "train.save_every": 3, "train.log_every": 1,
            "train.sample_every": 0, "train.log_with": "none", "train.cpu_threads": 1}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _full_data_loss(model, dataset):
    with torch.no_grad():
        return float(np.mean([lm_loss(model.eval(), {"input_ids": dataset[i]["input_ids"][None]}).item()
                              for i in range(len(dataset))]))


def test_tiny_cogformer_learns_a_text_file(tmp_path):
    """Through `train(cfg)` (configs/lm_tiny.yaml): the loss on a small file falls from above the unigram entropy
    (the best context-free model) to well below it, and the export continues the text sensibly."""
    text = small_text(tmp_path / "data.txt")
    run = tmp_path / "run"
    cfg = load_config(TINY, _overrides(run, text, **{"data.block_size": 64, "train.max_steps": 100,
                                                      "train.save_every": 100, "train.log_every": 10}))
    train(cfg)
    h = unigram_entropy(np.frombuffer(text.read_bytes(), dtype=np.uint8))  # nats per token of the unigram model
    dataset = build_dataset(cfg.data)
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] > h  # random init starts above the unigram model
    model = AutoModelForCausalLM.from_pretrained(run / "pipeline")
    assert _full_data_loss(model, dataset) < 0.5 * h
    # The exported directory loads through the transformers Auto classes and continues the text sensibly.
    tok = AutoTokenizer.from_pretrained(run / "pipeline")
    assert isinstance(model, CogformerForCausalLM) and model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("the quick brown fox jumps over the", add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    generated = tok.decode(out[0, ids.shape[1] :].tolist())
    vocab = set("the quick brown fox jumps over the lazy dog while a cat sleeps near the warm fire .\n")
    assert set(generated) <= vocab  # only characters of the training text


def test_weight_decay_skips_norm_gains_but_not_weight_matrices(tmp_path):
    """Through `train(cfg)`: one AdamW step with weight decay w against the same step with w = 0. AdamW decays
    decoupled, p <- p (1 - lr w) - update, so the two runs differ by lr w p_init on decayed parameters and not at
    all on the others (norm gains)."""
    text = small_text(tmp_path / "data.txt")
    lr, w = 1e-3, 0.5
    weights = {}
    for wd in (0.0, w):
        run = tmp_path / f"wd{wd}"
        train(load_config(TINY, _overrides(run, text, **{"train.max_steps": 1, "train.save_every": 1,
                                                          "train.warmup_steps": 0, "train.lr": lr,
                                                          "train.weight_decay": wd})))
        weights[wd] = load_file(str(list_checkpoints(run)[-1][1] / "model.safetensors"))
    a, b = weights[0.0], weights[w]
    gains = [k for k in a if k.endswith("norm.weight")]
    matrices = [k for k in a if a[k].dim() == 2]
    assert "model.norm.weight" in gains and "model.layers.0.self_attn.q_proj.weight" in matrices
    for k in gains:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)  # not decayed
    for k in matrices:
        # (p_0 - p_w) / (lr w) = p_init = p_0 + update, and |update| is about lr for Adam's first step.
        assert (a[k] - b[k]).abs().max() > 0
        torch.testing.assert_close((a[k] - b[k]) / (lr * w), a[k], rtol=0, atol=2 * lr)


def test_lm_config_has_the_paper_defaults():
    cfg = load_config(ROOT / "configs" / "lm_cogformer_141m.yaml")
    assert isinstance(cfg, LMRunConfig) and cfg.task == "lm"
    assert {f.name for f in dataclasses.fields(cfg)} == {"task", "model", "data", "train"}  # no unused sections
    assert cfg.model.num_hidden_layers == 12 and cfg.model.hidden_size == 768 and cfg.model.vocab_size == 32000
    t = cfg.train
    assert (t.betas, t.weight_decay, t.grad_clip, t.lr_schedule, t.min_lr_ratio) == ((0.9, 0.95), 0.1, 1.0, "cosine",
                                                                                      0.04)
    d = load_config(None, ["task=lm"]).train  # the defaults, not the CIFAR-10 ones
    assert (d.lr, d.betas, d.weight_decay, d.grad_clip, d.min_lr_ratio, d.ema_decay) == (
        2e-4, (0.9, 0.95), 0.1, 1.0, 0.04, 0.0)


def test_lm_model_config_fields_are_cogformer_kwargs():
    fields = {f.name for f in dataclasses.fields(LMModelConfig)}
    params = set(inspect.signature(CogformerConfig.__init__).parameters)
    assert fields <= params
    # Architecture kwargs not in the dataclass are only token ids / cache / tying flags.
    assert params - fields - {"self", "kwargs"} == {
        "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    }
    with torch.device("meta"):
        model = build_model(LMModelConfig())
    assert model.config.hidden_size == 768 and model.config.attention_types()[:2] == ["softmax", "cog"]


def test_schedule_is_warmup_then_cosine_to_4_percent():
    """Paper Sec. 4.1: linear warm-up, then cosine decay to 4% of the peak, checked against the closed form."""
    t = load_config(None, ["task=lm", "train.warmup_steps=10", "train.max_steps=100"]).train
    f = lr_lambda(t.warmup_steps, t.lr_schedule, t.max_steps, t.min_lr_ratio)
    got = [f(s) for s in range(101)]
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
    batch = {"input_ids": torch.stack([ds[i]["input_ids"] for i in range(4)])}
    torch.manual_seed(0)
    model = build_model(LMModelConfig.from_preset("tiny")).eval()
    ids = batch["input_ids"][:1, :20]
    padded = torch.cat([torch.full((1, 5), 256), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], 1)
    with torch.no_grad():
        a = lm_loss(model, {"input_ids": ids})
        b = lm_loss(model, {"input_ids": padded, "attention_mask": mask})
        right = torch.cat([ids, torch.full((1, 5), 256)], 1)
        c = lm_loss(model, {"input_ids": right, "attention_mask": mask.flip(1)})
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="^no training data configured: set data.path$"):
        build_dataset(LMDataConfig())


def test_lm_task_for_the_shared_loop(tmp_path):
    """The Task-protocol object: dataset, loss, a text sample and a save_pretrained export."""
    small_text(tmp_path / "data.txt")
    task = LMTask(LMRunConfig(model=LMModelConfig.from_preset("tiny"),
                              data=LMDataConfig(path=str(tmp_path / "data.txt"), block_size=32)))
    task.sample_prompt, task.sample_tokens = "the", 5
    model = task.build_model()
    ds = task.build_dataset()
    batch = {"input_ids": torch.stack([ds[i]["input_ids"] for i in range(4)])}
    value = task.loss(model, batch, rng=None)
    assert value.ndim == 0 and torch.isfinite(value)
    task.on_sample(model, 7, tmp_path)
    text = (tmp_path / "samples" / "step_0000007.txt").read_text(encoding="utf-8")
    assert text.startswith("the") and len(text) > 3  # 5 random bytes follow (not always valid UTF-8)
    task.export(model, tmp_path / "export")
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "export"), CogformerForCausalLM)
    assert AutoTokenizer.from_pretrained(tmp_path / "export").encode("ab", add_special_tokens=False) == [97, 98]
    small_vocab = LMTask(LMRunConfig(model=LMModelConfig.from_preset("tiny", vocab_size=50), data=task.data_cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        small_vocab.build_dataset()


def test_lm_resume_is_exact_and_export_loads(tmp_path, monkeypatch):
    text = small_text(tmp_path / "data.txt")
    full, part = tmp_path / "full", tmp_path / "part"
    train(load_config(TINY, _overrides(full, text)))
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
        train(load_config(TINY, _overrides(part, text)))
    monkeypatch.setattr(LMTask, "loss", real_loss)
    assert [s for s, _ in list_checkpoints(part)] == [3]
    train(load_config(TINY, _overrides(part, text, **{"train.resume": "latest"})))
    a = load_file(str(list_checkpoints(full)[-1][1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(part)[-1][1] / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    model = AutoModelForCausalLM.from_pretrained(full / "pipeline")
    assert type(model).__name__ == "CogformerForCausalLM"
    for k, v in model.state_dict().items():  # the export is the trained model (no EMA for LMs)
        torch.testing.assert_close(v, a[k], rtol=0, atol=0)


def test_validation_scores_the_held_out_tail_with_transformers_own_loss(tmp_path):
    """With `train.val_every`, the last `data.val_fraction` of the blocks are held out (training stops before
    them); each held-out block's value is the model's own next-token loss (`labels=input_ids`), the logged
    perplexity its exponential, and a run logs both."""
    text = small_text(tmp_path / "data.txt")
    cfg = load_config(TINY, _overrides(tmp_path / "run", text, **{"train.val_every": 3, "data.val_fraction": 0.2,
                                                                  "train.val_batch_size": 5}))
    task = LMTask(cfg)
    tokens = build_dataset(cfg.data).tokens
    blocks = len(tokens) // 32
    trained, held = task.build_dataset(), task.validation_set()
    assert len(held) == round(0.2 * blocks) and len(trained) == blocks - len(held)
    assert task.validation_split() == "the last data.val_fraction=0.2 of the tokens, held out"
    assert np.array_equal(held.tokens, tokens[len(tokens) - 32 * len(held) :])  # the tail, whole blocks
    assert len(trained.tokens) + len(held.tokens) == len(tokens) and np.array_equal(
        trained.tokens, tokens[: len(trained.tokens)])
    torch.manual_seed(0)
    model = task.build_model().eval()
    batch = {"input_ids": torch.stack([held[i]["input_ids"] for i in range(3)])}
    with torch.no_grad():
        got = task.validation_losses(model, batch, torch.arange(3))["val_loss"]
        for i in range(3):
            ids = batch["input_ids"][i : i + 1]
            torch.testing.assert_close(got[i], model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
    assert task.validation_metrics({"val_loss": 2.0}) == {"val_loss": 2.0, "val_ppl": math.exp(2.0)}
    run = train(cfg)
    val = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6] and all(r["val_ppl"] == math.exp(r["val_loss"]) for r in val)


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose logits are given: (B, L, V)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": self.logits})()


def test_synthetic_validation_scores_the_answers_only_by_hand():
    """Loss and accuracy over the labelled positions only: position t's logits predict labels[t + 1]."""
    cfg = load_config(ROOT / "configs" / "lm_mqar.yaml", ["train.val_every=1"])
    task = LMTask(cfg)
    assert task.validation_split() == f"held-out mqar sequences (data.val_fraction={cfg.data.val_fraction})"
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4], [1 / 3, 1 / 3, 1 / 3]],
                                     [[0.2, 0.5, 0.3], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.5, 0.25, 0.25]]]))
    batch = {"input_ids": torch.tensor([[2, 0, 1, 2], [1, 1, 0, 2]]),
             "labels": torch.tensor([[-100, 0, -100, 2], [-100, 2, 0, -100]])}
    got = task.validation_losses(_FixedLogits(logits), batch, torch.arange(2))
    # Sequence 0: label 0 from position 0 (p 0.7, argmax 0: right), label 2 from position 2 (p 0.4, argmax 2: right).
    # Sequence 1: label 2 from position 0 (p 0.3, argmax 1: wrong), label 0 from position 1 (p 0.6, right).
    want_loss = [-(math.log(0.7) + math.log(0.4)) / 2, -(math.log(0.3) + math.log(0.6)) / 2]
    torch.testing.assert_close(got["val_loss"], torch.tensor(want_loss), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["val_accuracy"], torch.tensor([1.0, 0.5]))
    # Without labels (token files) every next token counts, and there is no accuracy.
    plain = task.validation_losses(_FixedLogits(logits), {"input_ids": batch["input_ids"]}, torch.arange(2))
    assert set(plain) == {"val_loss"}
    assert plain["val_loss"][0].item() == pytest.approx(-(math.log(0.7) + math.log(0.8) + math.log(0.4)) / 3)


def test_synthetic_training_loss_counts_the_answers_only():
    torch.manual_seed(0)
    model = CogformerForCausalLM(CogformerConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=2,
                                                 max_position_embeddings=16, attention="softmax"))
    cfg = load_config(ROOT / "configs" / "lm_mqar.yaml", ["data.num_kv_pairs=4", "data.block_size=16"])
    items = [LMTask(cfg).build_dataset()[i] for i in range(3)]
    batch = {k: torch.stack([item[k] for item in items]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        nll = [-torch.log_softmax(logits[b, t - 1], -1)[batch["labels"][b, t]] for b in range(3) for t in range(16)
               if batch["labels"][b, t] != -100]
        assert len(nll) == 3 * 4  # 4 queries per sequence
        torch.testing.assert_close(lm_loss(model, batch), torch.stack(nll).mean())


def test_a_synthetic_run_logs_held_out_accuracy_and_attention_shares(tmp_path):
    """configs/lm_mqar.yaml for a few steps: the held-out set is `data.val_fraction` of `data.num_sequences`
    sequences from the held-out generators, each validation line has `val_accuracy` and the per-layer shares of
    negative attention weight (the softmax layers' 0), and the export needs no tokenizer."""
    cfg = load_config(ROOT / "configs" / "lm_mqar.yaml", [
        f"train.run_dir={tmp_path / 'run'}", "train.max_steps=4", "train.batch_size=8", "train.val_every=2",
        "train.val_examples=16", "train.val_batch_size=8", "train.save_every=0", "train.log_every=2",
        "train.log_with=none", "train.sample_every=4", "data.num_sequences=400"])
    task = LMTask(cfg)
    assert len(task.build_dataset()) == 400 and len(task.validation_set()) == 4  # round(0.01 x 400)
    assert task.validation_set()[0]["input_ids"].tolist() != task.build_dataset()[0]["input_ids"].tolist()
    run = train(cfg)
    val = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    for r in val:
        assert 0 <= r["val_accuracy"] <= 1 and r["val_accuracy"] * 64 == round(r["val_accuracy"] * 64)  # 16 x 4 answers
        shares = r["attn_neg_share"]
        assert list(shares) == ["model.layers.0", "model.layers.1", "model.layers.2"]
        assert shares["model.layers.0"] == shares["model.layers.2"] == 0.0 and 0 < shares["model.layers.1"] < 1
    model = AutoModelForCausalLM.from_pretrained(run / "pipeline")
    assert model.config.vocab_size == 64 and not (run / "pipeline" / "tokenizer.json").exists()
    # The sample: the first held-out sequence, its answers (one per key-value pair) and the model's.
    sample = (run / "samples" / "step_0000004.txt").read_text().splitlines()
    labels = task.validation_set()[0]["labels"]
    assert sample[1] == f"answers:   {labels[labels != -100].tolist()}" and sample[2].endswith(f"of {cfg.data.num_kv_pairs} right)")


SHAKESPEARE = ROOT / "configs" / "lm_shakespeare_char.yaml"


def _char_folder(tmp_path):
    """A prepared character folder (`uvic.lm.prepare --tokenizer char --split 0.9`) of `small_text`."""
    from uvic.lm.prepare import main

    text = small_text(tmp_path / "input.txt")
    main(["--text", str(text), "--tokenizer", "char", "--split", "0.9", "--out", str(tmp_path / "chars")])
    return tmp_path / "chars", sorted(set(text.read_text(encoding="utf-8")))


def test_a_prepared_folder_trains_on_train_bin_and_validates_on_every_val_token(tmp_path):
    """configs/lm_shakespeare_char.yaml (shrunk) on a prepared folder: training windows come from train.bin only,
    the validation windows predict every token of val.bin after the first exactly once (but a last partial
    window's), the tokenizer is the folder's vocab.json, and a run logs val_loss and exports the vocabulary."""
    from uvic.lm.data import CharTokenizer

    folder, chars = _char_folder(tmp_path)
    train_ids = np.fromfile(folder / "train.bin", np.uint16)
    val_ids = np.fromfile(folder / "val.bin", np.uint16)
    size = 16
    cfg = load_config(SHAKESPEARE, _overrides(tmp_path / "run", folder, **{
        "data.block_size": size, "model.max_position_embeddings": size, "model.vocab_size": len(chars),
        "model.hidden_size": 16, "model.intermediate_size": 32, "model.num_attention_heads": 2,
        "train.batch_size": 4, "train.max_steps": 4, "train.val_every": 2, "train.save_every": 4}))
    task = LMTask(cfg)
    assert np.array_equal(task.build_dataset().tokens, train_ids)
    held = task.validation_set()
    targets = np.concatenate([held[i]["input_ids"].numpy()[1:] for i in range(len(held))])
    assert np.array_equal(targets, val_ids[1 : 1 + len(targets)])  # each once, in order
    assert len(val_ids) - 1 - len(targets) < size - 1  # no further whole window fits
    assert isinstance(task.tokenizer, CharTokenizer) and task.tokenizer.chars == chars
    run = train(cfg)
    val = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    assert json.loads((run / "pipeline" / "vocab.json").read_text(encoding="utf-8"))["chars"] == chars


def test_a_data_folder_without_val_bin_is_named(tmp_path):
    from uvic.errors import DataError

    folder, chars = _char_folder(tmp_path)
    (folder / "val.bin").unlink()
    cfg = load_config(SHAKESPEARE, [f"data.path={folder}", "train.val_every=0"])
    with pytest.raises(DataError, match=f"data folder {folder} has no val.bin: a data folder is what"):
        LMTask(cfg).build_dataset()


def test_the_shakespeare_config_is_nanogpts_cpu_run():
    """Layers softmax, cog, cog, softmax; 808,320 parameters by closed form (embedding and untied head V x D, per
    layer 4 D^2 attention + 3 D I SwiGLU + 2 D norm gains, a final norm); nanoGPT's schedule (get_lr in its
    train.py: warm-up to 1e-3 at 100, cosine to 1e-4 at 2000) from step 100 on."""
    cfg = load_config(SHAKESPEARE)
    m, tc = cfg.model, cfg.train
    assert CogformerConfig(**dataclasses.asdict(m)).attention_types() == ["softmax", "cog", "cog", "softmax"]
    v, d, i, n = m.vocab_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers
    expected = 2 * v * d + n * (4 * d * d + 3 * d * i + 2 * d) + d
    assert expected == 808_320 and sum(p.numel() for p in build_model(m).parameters()) == expected
    assert (cfg.data.block_size, tc.batch_size, tc.max_steps, tuple(tc.betas)) == (64, 12, 2000, (0.9, 0.99))

    def nanogpt_lr(it, lr=1e-3, min_lr=1e-4, warmup=100, decay=2000):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    f = lr_lambda(tc.warmup_steps, tc.lr_schedule, tc.max_steps, tc.min_lr_ratio)
    for step in (100, 101, 500, 1000, 1500, 1999, 2000):
        assert tc.lr * f(step) == pytest.approx(nanogpt_lr(step), rel=1e-12)
    assert abs(tc.lr * f(50) - nanogpt_lr(50)) < 1e-5  # warm-up: s / 100 against (s + 1) / 101
