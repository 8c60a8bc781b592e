"""The language-model "task": the pieces a training loop needs to train a Cogformer, plus a minimal CPU trainer.

Pieces for the shared loop (`uvic.training`): `build_model`, `build_dataset` / `build_dataloader`, `loss`,
`build_optimizer` / `build_lr_scheduler` (the paper's AdamW (0.9, 0.95), weight decay 0.1, clip 1.0, linear
warm-up then cosine decay to 4% of the peak; `LMOptimConfig`).

`train_tiny` is a self-contained loop over the same pieces for tests and the CPU demo (CLI: `uvic.lm.train`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from uvic.lm.config import LMDataConfig, LMModelConfig, LMOptimConfig
from uvic.lm.data import TokenDataset, byte_tokenizer, load_tokenizer, load_tokens, read_text_tokens, unigram_entropy
from uvic.models.cogformer import COGFORMER_PRESETS, CogformerConfig, CogformerForCausalLM


logger = logging.getLogger(__name__)


def build_model(cfg: LMModelConfig) -> CogformerForCausalLM:
    """A randomly initialised Cogformer with the architecture in `cfg`."""
    return CogformerForCausalLM(CogformerConfig(**dataclasses.asdict(cfg)))


def model_config_from_preset(preset: str, **overrides) -> LMModelConfig:
    """`LMModelConfig` of a Cogformer preset ("tiny", "141M", "600M", "1B") with field overrides."""
    if preset not in COGFORMER_PRESETS:
        raise ValueError(f"unknown Cogformer preset {preset!r}; expected one of {sorted(COGFORMER_PRESETS)}")
    return LMModelConfig(**{**COGFORMER_PRESETS[preset], **overrides})


def build_dataset(cfg: LMDataConfig, split: str = "train") -> TokenDataset:
    """Windows of `cfg.block_size` tokens from `cfg.path` (split="train") or `cfg.val_path` (split="val")."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    path = cfg.path if split == "train" else cfg.val_path
    if not path:
        raise ValueError(f"no data path configured for split {split!r} (set data.{'path' if split == 'train' else 'val_path'})")
    tokens = load_tokens(path, cfg.format, cfg.tokenizer, cfg.token_dtype)
    return TokenDataset(tokens, cfg.block_size)


def build_dataloader(
    dataset: TokenDataset, batch_size: int, shuffle: bool = True, seed: int = 0, num_workers: int = 0
) -> DataLoader:
    """Batches `{"input_ids": (B, L)}`; `drop_last` when shuffling so every step sees `batch_size` sequences."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=shuffle and len(dataset) >= batch_size,
        generator=generator,
        num_workers=num_workers,
    )


def loss(model: CogformerForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of a batch `{"input_ids": (B, L), "attention_mask"?: (B, L)}`.

    Padding neither is predicted nor predicts: label t + 1 counts only when tokens t and t + 1 are both real.
    """
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = input_ids
    if mask is not None:
        real = mask.bool()
        keep = real.clone()
        keep[:, 1:] &= real[:, :-1]  # the model predicts labels[t + 1] from position t
        labels = input_ids.masked_fill(~keep, -100)
    return model(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False).loss


def build_optimizer(model: torch.nn.Module, cfg: LMOptimConfig) -> torch.optim.AdamW:
    """AdamW with the paper's betas and weight decay; 1-D parameters (norm gains) are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LMOptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The paper's schedule: linear warm-up over `warmup_steps`, then cosine decay to `min_lr_ratio` of the peak
    at `max_steps` (transformers' `get_cosine_with_min_lr_schedule_with_warmup`); `.step()` once per update."""
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, cfg.warmup_steps, cfg.max_steps, min_lr_rate=cfg.min_lr_ratio
    )


@torch.no_grad()
def evaluate_loss(model: CogformerForCausalLM, dataset: TokenDataset, batch_size: int = 32) -> float:
    """Mean next-token loss (nats) over every window of `dataset` (predictions weighted equally)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in build_dataloader(dataset, batch_size, shuffle=False):
        n = batch["input_ids"].numel() - batch["input_ids"].shape[0]  # predictions in this batch
        total += loss(model, batch).item() * n
        count += n
    model.train(was_training)
    return total / count


class LMTask:
    """The LM task for the shared training loop (`uvic.training.tasks.Task` protocol).

    Batches are `{"input_ids": (B, L)}` windows of `data.block_size` tokens. `on_sample` logs and writes a greedy
    continuation of `sample_prompt`; `export` writes a `save_pretrained` directory (model, plus the tokenizer when
    the data was tokenized with one), loadable by `AutoModelForCausalLM` and lm-eval's `hf` model.
    """

    def __init__(
        self, model: LMModelConfig, data: LMDataConfig, sample_prompt: str = "The", sample_tokens: int = 64
    ) -> None:
        self.model_cfg, self.data_cfg = model, data
        self.sample_prompt, self.sample_tokens = sample_prompt, sample_tokens
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The tokenizer named by `data.tokenizer` (for `.bin` data: the one the ids were made with)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.data_cfg.tokenizer)
        return self._tokenizer

    def build_model(self) -> CogformerForCausalLM:
        return build_model(self.model_cfg)

    def build_dataset(self) -> TokenDataset:
        dataset = build_dataset(self.data_cfg)
        top = int(dataset.tokens.max())
        if top >= self.model_cfg.vocab_size:
            raise ValueError(f"the data holds token id {top} but model.vocab_size is {self.model_cfg.vocab_size}")
        return dataset

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], rng=None) -> torch.Tensor:
        """Next-token loss; `rng` is unused (the LM loss has no randomness)."""
        return loss(model, batch)

    @torch.no_grad()
    def on_sample(self, ema_model: torch.nn.Module, step: int, run_dir: Path) -> None:
        tok = self.tokenizer
        device = next(ema_model.parameters()).device
        ids = torch.tensor([tok.encode(self.sample_prompt, add_special_tokens=False)], device=device)
        was_training = ema_model.training
        ema_model.eval()
        out = ema_model.generate(ids, max_new_tokens=self.sample_tokens, do_sample=False)
        ema_model.train(was_training)
        text = tok.decode(out[0].tolist())
        path = Path(run_dir) / "samples" / f"step_{step:07d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        logger.info("sample at step %d: %r", step, text)

    def export(self, ema_model: torch.nn.Module, out_dir: Path) -> None:
        model = copy.deepcopy(ema_model).float().cpu()
        model.save_pretrained(out_dir)
        if hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(out_dir)
        logger.info("exported the model (save_pretrained) to %s", out_dir)


@dataclass
class TinyTrainResult:
    """What `train_tiny` returns: the model, its tokenizer, per-step losses and the reference entropies."""

    model: CogformerForCausalLM
    tokenizer: object
    train_losses: list[float]
    initial_loss: float  # full-data loss before training
    final_loss: float  # full-data loss after training
    unigram_entropy: float  # nats; the loss of the best context-free predictor of the same data


def train_tiny(
    text_path: str | Path,
    out_dir: str | Path | None = None,
    *,
    preset: str = "tiny",
    attention: str = "cog",
    steps: int = 300,
    batch_size: int = 16,
    block_size: int = 64,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    seed: int = 0,
    log_every: int = 50,
) -> TinyTrainResult:
    """Train a small Cogformer on a UTF-8 text file with the byte tokenizer (CPU-sized; no accelerate).

    Uses the same model, data, loss, optimizer and schedule as the full recipe (`LMOptimConfig` defaults with the
    given lr / warm-up / steps). With `out_dir`, saves the model and tokenizer with `save_pretrained` there, so
    `AutoModelForCausalLM.from_pretrained(out_dir)` (after `import uvic.models.cogformer`) and lm-eval load it.
    """
    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    tokens = read_text_tokens(text_path, tokenizer)
    dataset = TokenDataset(tokens, block_size, stride=max(1, block_size // 2))
    model = build_model(model_config_from_preset(preset, attention=attention, max_position_embeddings=block_size))
    model.config.eos_token_id = model.config.bos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    optim_cfg = LMOptimConfig(lr=lr, warmup_steps=warmup_steps, max_steps=steps, batch_size=batch_size)
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_lr_scheduler(optimizer, optim_cfg)
    initial = evaluate_loss(model, dataset)

    model.train()
    losses: list[float] = []
    step, epoch, t0 = 0, 0, time.perf_counter()
    while step < steps:
        for batch in build_dataloader(dataset, batch_size, shuffle=True, seed=seed + epoch):
            value = loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            losses.append(value.item())
            step += 1
            if step % log_every == 0 or step == steps:
                rate = step / (time.perf_counter() - t0)
                logger.info(
                    "step=%07d loss=%.4f lr=%.2e steps/s=%.2f", step, losses[-1], scheduler.get_last_lr()[0], rate
                )
            if step == steps:
                break
        epoch += 1
    model.eval()
    result = TinyTrainResult(model, tokenizer, losses, initial, evaluate_loss(model, dataset), unigram_entropy(tokens))
    if out_dir is not None:
        out_dir = Path(out_dir)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        logger.info("saved model and tokenizer to %s", out_dir)
    return result
