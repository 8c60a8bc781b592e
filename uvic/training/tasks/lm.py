"""Cogformer language modelling (task "lm"), trained by the same loop as the diffusion tasks.

The recipe is the paper's (Sec. 4.1; the `LMTrainConfig` defaults in `uvic.config`): AdamW betas (0.9, 0.95),
weight decay 0.1 on weight matrices and embeddings only (norm gains and biases are not decayed: `param_groups`),
gradient clipping at 1.0, linear warm-up then cosine decay to 4% of the peak, no EMA (the export is the trained
model). The loss is the mean next-token cross-entropy.

The data is a token file (`data.path`), a prepared folder (`data.path` a folder holding train.bin and val.bin, as
`python -m uvic.lm.prepare --split` and nanoGPT's prepare.py write them: trained on train.bin, validated on all of
val.bin; the tokenizer is the folder's vocab.json when it has one) or a synthetic task made on the fly (`data.synthetic: mqar | induction`,
`uvic.lm.synthetic`), whose batches also hold `labels`: the answer tokens, -100 elsewhere. Then the loss, the
validation loss and the held-out accuracy `val_accuracy` count the answer tokens only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F

from uvic.config import LMDataConfig, LMModelConfig
from uvic.lm.data import (
    TokenDataset,
    folder_tokenizer,
    is_prepared_folder,
    load_split_tokens,
    load_tokenizer,
    load_tokens,
)
from uvic.lm.synthetic import IGNORE_INDEX, SyntheticDataset
from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM
from uvic.training.optim import decay_matrices
from uvic.training.rng import ShardedRNG
from uvic.training.tasks.protocol import sample_path


logger = logging.getLogger(__name__)

__all__ = ["LMTask", "build_dataset", "build_model", "lm_loss"]

_NO_IMAGES = ("an 'lm' run has no image pipeline to sample from; load its exported pipeline/ with transformers' "
              "AutoModelForCausalLM and call generate()")


def build_model(cfg: LMModelConfig) -> CogformerForCausalLM:
    """A randomly initialised Cogformer with the architecture in `cfg`."""
    return CogformerForCausalLM(CogformerConfig(**dataclasses.asdict(cfg)))


def build_dataset(cfg: LMDataConfig) -> TokenDataset:
    """Windows of `cfg.block_size` tokens from `cfg.path` (of a prepared folder: from its train.bin)."""
    if not cfg.path:
        raise ValueError("no training data configured: set data.path")
    if is_prepared_folder(cfg.path):
        return TokenDataset(load_split_tokens(cfg.path, cfg.token_dtype)[0], cfg.block_size)
    tokens = load_tokens(cfg.path, cfg.format, cfg.tokenizer, cfg.token_dtype)
    return TokenDataset(tokens, cfg.block_size)


def lm_loss(model: CogformerForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of a batch `{"input_ids": (B, L), "attention_mask"?: (B, L),
    "labels"?: (B, L)}`.

    With `labels` (a synthetic task's answers, -100 elsewhere) only the labelled tokens count. Otherwise every
    token does, but padding neither is predicted nor predicts: label t + 1 counts only when tokens t and t + 1 are
    both real.
    """
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = batch.get("labels", input_ids)
    if mask is not None and "labels" not in batch:
        real = mask.bool()
        keep = real.clone()
        keep[:, 1:] &= real[:, :-1]  # the model predicts labels[t + 1] from position t
        labels = input_ids.masked_fill(~keep, -100)
    return model(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False).loss


class LMTask:
    """The LM task (`uvic.training.tasks.Task`): `cfg.model` is an `LMModelConfig`, `cfg.data` an `LMDataConfig`.

    Batches are `{"input_ids": (B, L)}` windows of `data.block_size` tokens (a synthetic task's also hold
    `"labels": (B, L)`). `on_sample` logs and writes a greedy continuation of `sample_prompt`; `export` writes a `save_pretrained` directory (model, plus the tokenizer when
    the data was tokenized with one), loadable by `AutoModelForCausalLM` and lm-eval's `hf` model.
    """

    makes_images = False
    sample_prompt = "The"
    sample_tokens = 64

    def __init__(self, cfg: Any) -> None:
        self.model_cfg: LMModelConfig = cfg.model
        self.data_cfg: LMDataConfig = cfg.data
        self.validating = cfg.train.val_every > 0
        self._tokenizer = None
        self._dataset: TokenDataset | None = None
        self._val: TokenDataset | None = None
        self._folder = not self.data_cfg.synthetic and bool(self.data_cfg.path) and is_prepared_folder(
            self.data_cfg.path)

    @property
    def tokenizer(self):
        """The tokenizer named by `data.tokenizer` (for `.bin` data: the one the ids were made with); None for a
        synthetic task, whose ids are no text."""
        if self._tokenizer is None and not self.data_cfg.synthetic:
            spec = folder_tokenizer(self.data_cfg.path) if self._folder else None
            self._tokenizer = load_tokenizer(spec or self.data_cfg.tokenizer)
        return self._tokenizer

    def build_model(self) -> CogformerForCausalLM:
        return build_model(self.model_cfg)

    def build_dataset(self) -> TokenDataset | SyntheticDataset:
        """Windows of the data's tokens; when validating (`train.val_every` > 0), of those before the held-out
        tail. A synthetic task: its `data.num_sequences` training sequences, validating or not."""
        if self.data_cfg.synthetic:
            return self._synthetic("train", self.data_cfg.num_sequences)
        data = self._data()
        if self._folder or not self.validating:
            return data
        return TokenDataset(data.tokens[: self._held_out_start()], data.block_size)

    def validation_set(self) -> TokenDataset | SyntheticDataset:
        """The last round(`data.val_fraction` x blocks) whole blocks of the data, in order (a held-out tail, as
        nanoGPT's val split: training text never continues into it). A synthetic task: round(`data.val_fraction`
        x `data.num_sequences`) sequences (at least 1) from the held-out generators. A prepared folder: its val.bin,
        in windows of `data.block_size` that start `block_size - 1` tokens apart, so that each token after the
        first is predicted exactly once (but the last partial window's): with `train.val_examples` 0 the validation
        loss is the mean cross-entropy per token of the whole split."""
        if self.data_cfg.synthetic:
            return self._synthetic("val", max(1, round(self.data_cfg.val_fraction * self.data_cfg.num_sequences)))
        if self._folder:
            self._data()  # reads and checks both files
            return self._val
        data = self._data()
        return TokenDataset(data.tokens[self._held_out_start() :], data.block_size)

    def validation_split(self) -> str:
        """The held-out tail of the tokens, or the held-out synthetic sequences."""
        if self.data_cfg.synthetic:
            return f"held-out {self.data_cfg.synthetic} sequences (data.val_fraction={self.data_cfg.val_fraction})"
        return f"the last data.val_fraction={self.data_cfg.val_fraction} of the tokens, held out"

    def _synthetic(self, split: str, num_sequences: int) -> SyntheticDataset:
        d = self.data_cfg
        return SyntheticDataset(d.synthetic, split, num_sequences, d.block_size, self.model_cfg.vocab_size,
                                d.num_kv_pairs)

    def _data(self) -> TokenDataset:
        """All the data's windows (read once), checked against the vocabulary."""
        if self._dataset is None:
            d = self.data_cfg
            if self._folder:
                train, val = load_split_tokens(d.path, d.token_dtype)
                dataset = TokenDataset(train, d.block_size)
                self._val = TokenDataset(val, d.block_size, stride=d.block_size - 1)
                top = max(int(train.max()), int(val.max()))
            else:
                dataset = build_dataset(d)
                top = int(dataset.tokens.max())
            if top >= self.model_cfg.vocab_size:
                raise ValueError(f"the data holds token id {top} but model.vocab_size is {self.model_cfg.vocab_size}")
            self._dataset = dataset
        return self._dataset

    def _held_out_start(self) -> int:
        """The first token of the held-out tail."""
        tokens, size, fraction = self._data().tokens, self.data_cfg.block_size, self.data_cfg.val_fraction
        blocks = len(tokens) // size
        k = round(fraction * blocks)
        if not 1 <= k < blocks:
            raise ValueError(f"data.val_fraction={fraction} of {blocks} blocks of {size} tokens holds out {k}: the "
                             "validation loss needs at least one held-out block and one to train on")
        return len(tokens) - k * size

    def param_groups(self, model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
        """Decay on weight matrices and embeddings; none on RMSNorm gains (and biases, were there any)."""
        return decay_matrices(model, weight_decay)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        """Next-token loss; `rng` is unused (the LM loss has no randomness)."""
        return lm_loss(model, batch)

    def validation_losses(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                          index: torch.Tensor) -> dict[str, torch.Tensor]:
        """`val_loss`: each held-out block's mean next-token cross-entropy (nats); the LM loss draws nothing.

        With `labels` (a synthetic task) the mean is over the answer tokens only, and `val_accuracy` is each
        sequence's fraction of answer tokens predicted correctly by the argmax of the logits."""
        ids = batch["input_ids"]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, L - 1, V): predicts ids[:, 1:]
        targets = batch.get("labels", ids)[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, L - 1), 0 where ignored
        if "labels" not in batch:
            return {"val_loss": nll.mean(1)}
        scored = targets != IGNORE_INDEX
        count = scored.sum(1).clamp_min(1)
        correct = (logits.argmax(-1) == targets) & scored
        return {"val_loss": nll.sum(1) / count, "val_accuracy": correct.sum(1) / count}

    def validation_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """The mean cross-entropy per token (every block has L - 1 targets; every synthetic sequence as many
        answers) and its perplexity, `val_ppl`; a synthetic task's `val_accuracy` as it is."""
        return {**means, "val_ppl": math.exp(means["val_loss"])}

    def load_vae(self) -> NoReturn:
        """Always raises: a language model makes no images."""
        raise ValueError(_NO_IMAGES)

    def pipeline(self, model: torch.nn.Module, *, sampler: str | None = None, vae: None = None) -> NoReturn:
        """Always raises: a language model has no image pipeline (its export is a transformers model)."""
        raise ValueError(_NO_IMAGES)

    def image_conditions(self, purpose: str, num_images: int) -> NoReturn:
        """Always raises: a language model makes no images."""
        raise ValueError(_NO_IMAGES)

    @torch.no_grad()
    def on_sample(self, model: torch.nn.Module, step: int, run_dir: Path) -> Path:
        """A greedy continuation of `sample_prompt`; for a synthetic task, the first held-out sequence with the
        model's argmax prediction of each answer."""
        if self.data_cfg.synthetic:
            return self._sample_synthetic(model, step, run_dir)
        tok = self.tokenizer
        device = next(model.parameters()).device
        ids = torch.tensor([tok.encode(self.sample_prompt, add_special_tokens=False)], device=device)
        was_training = model.training
        model.eval()
        out = model.generate(ids, max_new_tokens=self.sample_tokens, do_sample=False)
        model.train(was_training)
        text = tok.decode(out[0].tolist())
        path = sample_path(run_dir, step, ".txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        logger.info("sample at step %d: %r", step, text)
        return path

    def _sample_synthetic(self, model: torch.nn.Module, step: int, run_dir: Path) -> Path:
        item = self.validation_set()[0]
        ids, labels = item["input_ids"], item["labels"]
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        predicted = model(input_ids=ids[None].to(device), use_cache=False).logits[0, :-1].argmax(-1).cpu()
        model.train(was_training)
        answers = (labels[1:] != IGNORE_INDEX).nonzero().flatten().tolist()
        right = sum(int(predicted[t] == labels[t + 1]) for t in answers)
        text = (f"{self.data_cfg.synthetic} held-out sequence 0: {ids.tolist()}\n"
                f"answers:   {[int(labels[t + 1]) for t in answers]}\n"
                f"predicted: {[int(predicted[t]) for t in answers]} ({right} of {len(answers)} right)\n")
        path = sample_path(run_dir, step, ".txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        logger.info("sample at step %d: %d of %d answers right", step, right, len(answers))
        return path

    def export(self, model: torch.nn.Module, out_dir: Path) -> None:
        model = copy.deepcopy(model).float().cpu()
        tok = self.tokenizer
        # generate() and lm-eval read these ids from the config.
        if getattr(tok, "eos_token_id", None) is not None:
            model.config.eos_token_id = model.config.bos_token_id = model.config.pad_token_id = tok.eos_token_id
        model.save_pretrained(out_dir)
        if hasattr(tok, "save_pretrained"):
            tok.save_pretrained(out_dir)
