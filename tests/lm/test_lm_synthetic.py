"""The synthetic LM tasks (`data.synthetic`): each answer is right by construction, sequences depend on their
index alone, and the held-out ones come from other generators than the training ones."""

import numpy as np
import pytest

from uvic.config import load_config
from uvic.errors import ConfigError
from uvic.lm.synthetic import SyntheticDataset, synthetic_problem


def _mqar(split="train", n=500, length=32, vocab=64, pairs=6):
    return SyntheticDataset("mqar", split, n, length, vocab, pairs)


def test_mqar_answers_are_the_values_of_the_queried_keys():
    data = _mqar()
    for i in range(len(data)):
        tokens, labels = data.sequence(i)
        keys, values = tokens[0:12:2], tokens[1:12:2]
        assert len(set(keys)) == 6 and all(1 <= k < 32 for k in keys)  # distinct keys from [1, V/2)
        assert len(set(values)) == 6 and all(32 <= v < 64 for v in values)  # distinct values from [V/2, V)
        asked = np.flatnonzero(labels != -100) - 1  # a query's label sits at the position after it
        assert len(asked) == 6 and all(p >= 12 and (p - 12) % 2 == 0 for p in asked)
        assert sorted(tokens[asked]) == sorted(keys)  # every key asked once
        recall = dict(zip(keys.tolist(), values.tolist()))
        assert [recall[k] for k in tokens[asked]] == labels[asked + 1].tolist()
        rest = np.ones(32, bool)
        rest[:12] = False
        rest[asked] = False
        assert (tokens[rest] == 0).all()  # the rest of the query part is 0: no value appears twice


def test_mqar_queries_follow_zoologys_power_law_gaps():
    data = _mqar(n=3000, length=64, pairs=4)  # 28 query slots for 4 queries
    slots = np.concatenate([(np.flatnonzero(data.sequence(i)[1] != -100) - 1 - 8) // 2 for i in range(len(data))])
    counts = np.bincount(slots, minlength=28)
    # p(slot s) is proportional to (s + 1) ** -0.99 for a draw without replacement: the first slots are the most
    # asked for, the last ones still asked.
    assert counts[0] > counts[1] > counts[5] > counts[27] > 0


def test_induction_answers_copy_an_earlier_segment():
    data = SyntheticDataset("induction", "train", 500, 40, 16, 0)
    for i in range(len(data)):
        tokens, labels = data.sequence(i)
        answered = np.flatnonzero(labels != -100)
        assert len(answered) == 9 and np.array_equal(answered, np.arange(answered[0], answered[0] + 9))
        assert np.array_equal(labels[answered], tokens[answered])
        b = answered[0] - 1  # the copy's first token, not scored
        copy = tokens[b : b + 10]
        assert any(np.array_equal(tokens[a : a + 10], copy) for a in range(0, b - 9))  # an earlier, whole segment
        assert tokens.min() >= 0 and tokens.max() < 16


def test_sequences_depend_on_their_index_only_and_held_out_ones_are_new():
    train, longer = _mqar(n=2000), _mqar(n=10)
    for i in (0, 7, 9):
        a, b = train[i], longer[i]
        assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "labels"))
        assert np.array_equal(train[i]["input_ids"], train[i]["input_ids"])
    held = _mqar("val", n=200)
    seen = {tuple(train[i]["input_ids"].tolist()) for i in range(len(train))}
    assert not any(tuple(held[i]["input_ids"].tolist()) in seen for i in range(len(held)))
    assert not np.array_equal(train[0]["input_ids"], held[0]["input_ids"])
    with pytest.raises(IndexError):
        held[200]


def test_sizes_that_do_not_fit_are_refused():
    assert synthetic_problem("mqar", 16, 64, 4) is None and synthetic_problem("induction", 8, 2, 0) is None
    assert "too short" in synthetic_problem("mqar", 15, 64, 4)
    assert "fewer than data.num_kv_pairs=4" in synthetic_problem("mqar", 16, 8, 4)  # 3 key ids
    assert "block_size >= 8" in synthetic_problem("induction", 7, 64, 0)
    with pytest.raises(ValueError, match="too short"):
        SyntheticDataset("mqar", "train", 10, 15, 64, 4)
    with pytest.raises(ConfigError, match=r"config key data.synthetic: 'copy' is not one of \['', 'mqar', "
                                          r"'induction'\]"):
        load_config(None, ["task=lm", "data.synthetic=copy"])
