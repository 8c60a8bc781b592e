"""Weight-decay parameter groups: every trainable parameter in exactly one group."""

import torch

from uvic.training.optim import decay_all, decay_matrices


def _model():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[1].bias.requires_grad_(False)  # frozen parameters are left out
    return model


def test_decay_all_is_one_group_of_every_trainable_parameter():
    model = _model()
    (group,) = decay_all(model, 0.03)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert group["weight_decay"] == 0.03 and [id(p) for p in group["params"]] == [id(p) for p in trainable]


def test_decay_matrices_exempts_vectors():
    model = _model()
    decay, no_decay = decay_matrices(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[1].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[2].weight), id(model[2].bias)}
