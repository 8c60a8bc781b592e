"""Synthetic sequence tasks that need attention, generated on the fly: `data.synthetic: mqar | induction`.

Both are next-token tasks over the model's own vocabulary (`model.vocab_size` = V) in which some positions, the
answers, can only be predicted by looking back at an earlier token; the other tokens are context. A sequence is
`data.block_size` = L tokens with L labels (`labels[t]` is what position t - 1 must predict, -100 where nothing
is scored: the model shifts them, as it shifts `input_ids` in plain language modelling):

    mqar        multi-query associative recall (Arora et al., "Zoology", 2023), as Zoology's `multiquery_ar`:
                D = `data.num_kv_pairs` key-value pairs `k1 v1 k2 v2 ... kD vD`, then every key once more, in a
                random order, as a query: its label is its value. Keys are distinct, drawn from [1, V/2); values
                are distinct, from [V/2, V). The queries sit at even offsets of the L - 2D tokens after the pairs,
                placed with Zoology's power-law gaps (exponent a = 0.01: most queries close to the pairs, some
                far); every other token there is 0, the token after a query included, so no value is repeated
                in the sequence (a model that saw the answers could rule out the values already used).
                Needs L >= 4D and D <= V/2 - 1.
    induction   the copy task of induction heads (Olsson et al., 2022): L random tokens from [0, V) (with
                repeats) in which a segment of n = L // 4 tokens at a random start a reappears at a random later
                start b >= a + n. The labels are the copy's tokens after its first, which the model can predict by
                finding where the token before them occurred earlier and copying what followed it; as the copy's
                offset varies, no fixed position gives them away. Needs L >= 8.

As in Zoology, only the answers are trained on and scored (`labels` is -100 elsewhere): the context tokens are
random, so predicting them teaches nothing, and their loss would swamp the answers'. Guessing gets 1 / (V - V // 2)
of MQAR's answers and 1 / V of the copies right; a model that does not recall can still pick one of the D values in
the context, 1 / D.

Sequence i of a split comes from its own generator, `np.random.default_rng((SYNTHETIC_SEED, split, i))` (split 0
trains, 1 is held out), so the data is the same in every run, process count and data order, and no held-out
sequence comes from a training sequence's generator.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset


__all__ = ["SPLITS", "SYNTHETIC_SEED", "SYNTHETIC_TASKS", "SyntheticDataset", "induction", "mqar",
           "synthetic_problem"]

SYNTHETIC_SEED = 20_231_208
SPLITS = {"train": 0, "val": 1}
# Zoology's power-law exponent for the gaps between the pairs and the queries (`multiquery_ar(power_a=0.01)`).
MQAR_POWER_A = 0.01
IGNORE_INDEX = -100  # a label that is not scored (torch's cross_entropy default)


def mqar(rng: np.random.Generator, length: int, vocab_size: int, num_kv_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """One MQAR sequence (see the module docstring).

    Returns:
        tokens (L,) and labels (L,), int64: the value of each query at the position after it, -100 elsewhere.
    """
    d, half = num_kv_pairs, vocab_size // 2
    keys = rng.choice(np.arange(1, half), size=d, replace=False)
    values = rng.choice(np.arange(half, vocab_size), size=d, replace=False)
    tokens = np.zeros(length, dtype=np.int64)
    tokens[0 : 2 * d : 2], tokens[1 : 2 * d : 2] = keys, values
    space = (length - 2 * d) // 2  # query slots of two tokens after the pairs
    p = MQAR_POWER_A * np.arange(1, space + 1) ** (MQAR_POWER_A - 1)
    queries = 2 * d + 2 * rng.choice(space, size=d, replace=False, p=p / p.sum())  # where key i is asked for
    tokens[queries] = keys
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    labels[queries + 1] = values
    return tokens, labels


def induction(rng: np.random.Generator, length: int, vocab_size: int, num_kv_pairs: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """One copy sequence (see the module docstring); `num_kv_pairs` is unused.

    Returns:
        tokens (L,) and labels (L,), int64: the copied tokens after the copy's first, -100 elsewhere.
    """
    n = length // 4
    tokens = rng.integers(0, vocab_size, size=length)
    a = int(rng.integers(0, length - 2 * n + 1))  # the segment's first start
    b = int(rng.integers(a + n, length - n + 1))  # its copy's
    tokens[b : b + n] = tokens[a : a + n]
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    labels[b + 1 : b + n] = tokens[b + 1 : b + n]
    return tokens.astype(np.int64), labels


# The synthetic tasks by name, the values of `data.synthetic` in an LM config ("" reads `data.path` instead).
SYNTHETIC_TASKS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {"mqar": mqar, "induction": induction}


def synthetic_problem(task: str, length: int, vocab_size: int, num_kv_pairs: int) -> str | None:
    """Why `task` cannot make sequences of `length` tokens over `vocab_size` ids, in words; None when it can."""
    if task not in SYNTHETIC_TASKS:
        return f"unknown synthetic task {task!r}; expected one of {list(SYNTHETIC_TASKS)}"
    if task == "mqar":
        if num_kv_pairs < 1:
            return f"data.num_kv_pairs must be >= 1, got {num_kv_pairs}"
        if length < 4 * num_kv_pairs:
            return (f"data.block_size={length} is too short for data.num_kv_pairs={num_kv_pairs}: MQAR needs "
                    f"4 x {num_kv_pairs} = {4 * num_kv_pairs} tokens (the pairs, then a query and its answer per key)")
        if num_kv_pairs > vocab_size // 2 - 1:
            return (f"model.vocab_size={vocab_size} has {max(vocab_size // 2 - 1, 0)} key ids ([1, V/2)), fewer "
                    f"than data.num_kv_pairs={num_kv_pairs} distinct keys")
    elif length < 8 or vocab_size < 2:
        return (f"the copy task needs data.block_size >= 8 (a copied segment of block_size // 4 >= 2 tokens) and "
                f"model.vocab_size >= 2, got {length} and {vocab_size}")
    return None


class SyntheticDataset(Dataset):
    """`num_sequences` sequences of a synthetic task, each made when it is read (nothing is stored).

    Items are `{"input_ids": (L,) int64, "labels": (L,) int64}`, `labels` the answer tokens and -100 elsewhere.

    Args:
        task: a key of `SYNTHETIC_TASKS`.
        split: "train" or "val" (disjoint generator streams).
        num_sequences: the dataset's length.
        block_size: L.
        vocab_size: V, the model's vocabulary.
        num_kv_pairs: MQAR's D.
    Raises:
        ValueError: the sizes do not fit the task (`synthetic_problem`).
    """

    def __init__(self, task: str, split: str, num_sequences: int, block_size: int, vocab_size: int,
                 num_kv_pairs: int) -> None:
        if (why := synthetic_problem(task, block_size, vocab_size, num_kv_pairs)) is not None:
            raise ValueError(why)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        self.task, self.split, self.num_sequences = task, split, num_sequences
        self.block_size, self.vocab_size, self.num_kv_pairs = block_size, vocab_size, num_kv_pairs
        self._make = SYNTHETIC_TASKS[task]

    def __len__(self) -> int:
        return self.num_sequences

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens (L,), labels (L,)) of sequence `i`, int64."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range for {self.num_sequences} sequences")
        rng = np.random.default_rng((SYNTHETIC_SEED, SPLITS[self.split], int(i)))
        return self._make(rng, self.block_size, self.vocab_size, self.num_kv_pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens, labels = self.sequence(i)
        return {"input_ids": torch.from_numpy(tokens), "labels": torch.from_numpy(labels)}
