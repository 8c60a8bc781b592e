"""benchmarks/bench_nanogpt.py without nanoGPT: a fake checkout whose model.py has nanoGPT's interface (GPTConfig,
GPT(config), forward(idx, targets) -> (logits, loss), configure_optimizers) records what it was built with."""

import re

import bench_nanogpt as bn  # benchmarks/, on the path from conftest.py
import pytest


FAKE_MODEL = '''
import json
from dataclasses import dataclass, asdict

import torch
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        open(__file__ + ".built.json", "w").write(json.dumps(asdict(config)))
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits = self.head(self.wte(idx))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        open(__file__ + ".optim.json", "w").write(json.dumps([weight_decay, learning_rate, list(betas), device_type]))
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas, weight_decay=weight_decay)
'''
SMALL = ["--set", "model.hidden_size=16", "model.intermediate_size=32", "model.num_attention_heads=2",
         "data.block_size=8", "model.max_position_embeddings=8", "train.batch_size=2",
         "--rounds", "2", "--repeat", "1", "--warmup", "1"]


def test_both_steps_are_timed_from_one_config(tmp_path, capsys):
    import json

    (tmp_path / "model.py").write_text(FAKE_MODEL)
    bn.main([str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    built = json.loads((tmp_path / "model.py.built.json").read_text())
    assert built == {"block_size": 8, "vocab_size": 65, "n_layer": 4, "n_head": 2, "n_embd": 16, "dropout": 0.0,
                     "bias": False}
    assert json.loads((tmp_path / "model.py.optim.json").read_text()) == [0.1, 0.001, [0.9, 0.99], "cpu"]
    assert "uvic attention=softmax" in out and f"parameters: nanoGPT {65 * 16 * 2:,}  uvic " in out
    assert re.search(r"^ms/step: nanoGPT \d+\.\d\d  uvic \d+\.\d\d  time uvic/nanoGPT \d+\.\d{3}$", out, re.M), out


def test_a_folder_without_model_py_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bn.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path} is not a nanoGPT checkout: it has no model.py "
                                               "(git clone https://github.com/karpathy/nanoGPT)")


def test_score_is_the_lm_validation_loss_of_a_checkpoint(tmp_path, capsys):
    """--score on a fake checkpoint of a bigram model (the fake GPT's logits at t depend on token t only): the loss
    is the mean bigram cross-entropy of val.bin's tokens 1..T, T the last token of a whole window of 8 starting 7
    apart, computed here directly; the draws of the 20-batch estimate are printed with their spread."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    (tmp_path / "model.py").write_text(FAKE_MODEL)
    module = bn.load_nanogpt(tmp_path)
    args = {"block_size": 8, "vocab_size": 5, "n_layer": 1, "n_head": 1, "n_embd": 4, "dropout": 0.0, "bias": False}
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(**args))
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}, "model_args": args,
                "iter_num": 3}, tmp_path / "ckpt.pt")
    data = tmp_path / "data"
    data.mkdir()
    val = np.random.default_rng(0).integers(0, 5, size=40).astype(np.uint16)
    val.tofile(data / "val.bin")
    val[:20].tofile(data / "train.bin")
    last = 1 + ((40 - 8) // 7 + 1) * 7  # tokens 1..last - 1 are predicted: 5 windows of 7 targets
    ids = torch.from_numpy(val.astype(np.int64))
    with torch.no_grad():
        expected = float(F.cross_entropy(model.head(model.wte(ids[: last - 1])), ids[1:last]))
    loss, count, estimates = bn.score_checkpoint(module, tmp_path / "ckpt.pt", data, draws=3)
    assert count == last - 1 == 35 and loss == pytest.approx(expected, rel=1e-5) and len(estimates) == 3
    bn.main([str(tmp_path), "--score", str(tmp_path / "ckpt.pt"), "--data", str(data), "--draws", "3"])
    out = capsys.readouterr().out
    assert f"val.bin loss {expected:.4f} nats/token over 35 tokens" in out
    assert re.search(r"20-batch estimate, 3 draws: mean \d\.\d{4} sd \d\.\d{4}", out), out
