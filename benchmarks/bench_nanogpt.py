"""uvic's Cogformer against nanoGPT's GPT: one training step of each, timed side by side in one process.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT
    python benchmarks/bench_nanogpt.py ../nanoGPT                                  # configs/lm_shakespeare_char.yaml
    python benchmarks/bench_nanogpt.py ../nanoGPT --set model.attention=cog        # the Cogformer instead
    python benchmarks/bench_nanogpt.py ../nanoGPT --threads 1 --rounds 20 --repeat 10
    python benchmarks/bench_nanogpt.py ../nanoGPT --score out-seed1337/ckpt.pt --data data/shakespeare_char --draws 30

Both models are built from one uvic LM config (`--config`, with `--set KEY=VALUE` overrides; the Transformer arm,
`model.attention=softmax`, unless set): uvic's `CogformerForCausalLM` as `train.py` builds it, and nanoGPT's
`GPT` from `model.py` in the checkout given, with the same layers, heads, width, context (`data.block_size`),
vocabulary, no biases and no dropout. A step is what each training loop does per batch: forward and loss on
`train.batch_size` random sequences, backward, gradient clipping at `train.grad_clip`, AdamW (uvic: the LM task's
parameter groups; nanoGPT: its `configure_optimizers`, both with the config's lr, betas and weight decay) and
zeroing the gradients. Neither loop's data loading, logging or validation is timed. The two run in interleaved
rounds whose order alternates (`bench_uvit_step.interleaved`), so that load from other processes hits both alike;
the report prints each one's median ms per step and the median of the per-round ratios uvic / nanoGPT.

`--score CKPT` instead scores a nanoGPT checkpoint (its `ckpt.pt`, read with `torch.load(weights_only=True)`) on
the `val.bin` of a prepared folder (`--data`) two ways: uvic's validation loss (the LM task's windows of the
checkpoint's block size, starting block_size - 1 apart: every token after the first predicted once) and `--draws`
draws of nanoGPT's own estimate (`estimate_loss` with `eval_iters=20`: 20 batches of 12 windows at random
offsets), whose mean and standard deviation show how far one logged nanoGPT "val loss" strays.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uvic, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling bench_uvit_step

from bench_uvit_step import interleaved  # noqa: E402

from uvic.errors import ConfigError, DataError, cli_errors  # noqa: E402


DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lm_shakespeare_char.yaml"


def load_nanogpt(checkout: str | Path) -> Any:
    """nanoGPT's `model` module (its GPT and GPTConfig) from the checkout at `checkout`."""
    path = Path(checkout) / "model.py"
    if not path.is_file():
        raise DataError(f"{checkout} is not a nanoGPT checkout: it has no model.py (git clone "
                        "https://github.com/karpathy/nanoGPT)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("GPT", "GPTConfig"):
        if not hasattr(module, name):
            raise DataError(f"{path} defines no {name}: not nanoGPT's model.py")
    return module


def nanogpt_model(module: Any, cfg: Any) -> torch.nn.Module:
    """nanoGPT's GPT with the layers, heads, width, context and vocabulary of the uvic LM config `cfg`."""
    m = cfg.model
    return module.GPT(module.GPTConfig(block_size=cfg.data.block_size, vocab_size=m.vocab_size,
                                       n_layer=m.num_hidden_layers, n_head=m.num_attention_heads, n_embd=m.hidden_size,
                                       dropout=0.0, bias=False))


def step_functions(cfg: Any, module: Any, seed: int = 0) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    """One training step of each model on a fixed random batch (`cfg.train.batch_size` x `cfg.data.block_size`
    tokens, plus the next token for nanoGPT's targets), and each model's parameter count."""
    from uvic.training.tasks.lm import LMTask, lm_loss

    tc = cfg.train
    torch.manual_seed(seed)
    tokens = torch.randint(cfg.model.vocab_size, (tc.batch_size, cfg.data.block_size + 1))
    task = LMTask(cfg)
    ours = task.build_model().train()
    ours_opt = torch.optim.AdamW(task.param_groups(ours, tc.weight_decay), lr=tc.lr, betas=tc.betas, eps=tc.adam_eps)
    theirs = nanogpt_model(module, cfg).train()
    theirs_opt = theirs.configure_optimizers(tc.weight_decay, tc.lr, tuple(tc.betas), "cpu")
    batch = {"input_ids": tokens[:, :-1].contiguous()}
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as nanoGPT's get_batch stacks them

    def uvic_step() -> None:
        lm_loss(ours, batch).backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), tc.grad_clip)
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)

    def nanogpt_step() -> None:
        _, loss = theirs(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), tc.grad_clip)
        theirs_opt.step()
        theirs_opt.zero_grad(set_to_none=True)

    counts = {"nanoGPT": sum(p.numel() for p in theirs.parameters()), "uvic": sum(p.numel() for p in ours.parameters())}
    return {"nanoGPT": nanogpt_step, "uvic": uvic_step}, counts


def score_checkpoint(module: Any, ckpt: str | Path, data: str | Path, draws: int = 0, batch: int = 12,
                     eval_iters: int = 20, seed: int = 0) -> tuple[float, int, list[float]]:
    """A nanoGPT checkpoint's mean next-token cross-entropy over the prepared folder `data`'s val.bin (every token
    after the first once, as uvic's LM validation: windows of block_size starting block_size - 1 apart), the
    number of tokens scored, and `draws` values of nanoGPT's estimate (`eval_iters` batches of `batch` windows)."""
    import numpy as np
    import torch.nn.functional as F

    from uvic.lm.data import TokenDataset, load_split_tokens

    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = module.GPT(module.GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    model.eval()
    size = saved["model_args"]["block_size"]
    val = torch.from_numpy(np.asarray(load_split_tokens(data)[1], dtype=np.int64))
    windows = TokenDataset(val.numpy(), size, stride=size - 1)  # the LM task's validation windows (validation_set)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), 128):
            w = torch.stack([windows[i]["input_ids"] for i in range(start, min(len(windows), start + 128))])
            logits, _ = model(w[:, :-1].contiguous(), w[:, 1:].contiguous())
            total += float(F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="sum"))
            count += w[:, 1:].numel()
        g, estimates = torch.Generator().manual_seed(seed), []
        for _ in range(draws):
            losses = []
            for _ in range(eval_iters):
                ix = torch.randint(len(val) - size, (batch,), generator=g)
                x = torch.stack([val[i : i + size] for i in ix])
                y = torch.stack([val[i + 1 : i + 1 + size] for i in ix])
                losses.append(float(model(x, y)[1]))
            estimates.append(sum(losses) / len(losses))
    return total / count, count, estimates


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("nanogpt", help="a nanoGPT checkout (the folder holding its model.py)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="a uvic LM config (task: lm)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the config's cpu_threads: 1)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeat", type=int, default=10, help="training steps per model per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each model first")
    p.add_argument("--score", metavar="CKPT", help="score this nanoGPT ckpt.pt on --data's val.bin instead of timing")
    p.add_argument("--data", help="with --score: a prepared folder (python -m uvic.lm.prepare --split)")
    p.add_argument("--draws", type=int, default=30, help="with --score: draws of nanoGPT's 20-batch estimate")
    args = p.parse_args(argv)
    if args.score:
        torch.set_num_threads(args.threads)
        with cli_errors(2):
            if not args.data:
                raise ConfigError("--score needs --data, the prepared folder whose val.bin to score")
            module = load_nanogpt(args.nanogpt)
            loss, count, estimates = score_checkpoint(module, args.score, args.data, args.draws)
        print(f"{args.score}: val.bin loss {loss:.4f} nats/token over {count:,} tokens (uvic's validation)")
        if estimates:
            import statistics

            sd = statistics.stdev(estimates) if len(estimates) > 1 else 0.0
            print(f"nanoGPT's 20-batch estimate, {len(estimates)} draws: mean {statistics.mean(estimates):.4f} "
                  f"sd {sd:.4f}")
        return
    with cli_errors(2):
        from uvic.config import load_config

        overrides = ["model.attention=softmax", *args.set]
        cfg = load_config(args.config, overrides)
        if cfg.task != "lm":
            raise ConfigError(f"{args.config} is a {cfg.task!r} config; the benchmark needs an LM config (task: lm)")
        module = load_nanogpt(args.nanogpt)
    torch.set_num_threads(args.threads)
    fns, counts = step_functions(cfg, module)
    m = cfg.model
    print(f"device=cpu threads={torch.get_num_threads()} torch={torch.__version__} rounds={args.rounds} "
          f"repeat={args.repeat} batch={cfg.train.batch_size} block={cfg.data.block_size} layers={m.num_hidden_layers} "
          f"heads={m.num_attention_heads} width={m.hidden_size} uvic attention={m.attention}")
    print(f"parameters: nanoGPT {counts['nanoGPT']:,}  uvic {counts['uvic']:,}")
    times, ratio = interleaved(fns, torch.device("cpu"), args.rounds, args.repeat, args.warmup)
    print(f"ms/step: nanoGPT {times['nanoGPT'] * 1e3:.2f}  uvic {times['uvic'] * 1e3:.2f}  "
          f"time uvic/nanoGPT {ratio:.3f}")


if __name__ == "__main__":
    main()
