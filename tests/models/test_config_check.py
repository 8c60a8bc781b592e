"""A saved model directory whose config.json is edited (a wrong type, a value out of range, a far larger model than
its weights, a JSON list) is one ValueError naming the file and the key or tensor, before anything is allocated:
`UViTModel.from_pretrained`, `CogformerForCausalLM.from_pretrained`, and sample.py on a pipeline."""

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from uvic.models.cogformer import CogformerForCausalLM, cogformer_config
from uvic.models.uvit import UViTModel


ROOT = Path(__file__).resolve().parents[2]


def _edited(saved, tmp_path, edit):
    """A copy of the model dir `saved` with its config.json updated by `edit` (a dict), or replaced (a list)."""
    out = tmp_path / "edited"
    shutil.copytree(saved, out)
    config = json.loads((saved / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **edit} if isinstance(edit, dict) else edit))
    return out


@pytest.fixture(scope="module")
def uvit_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("uvit") / "model"
    UViTModel(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cogformer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cogformer") / "model"
    CogformerForCausalLM(cogformer_config("tiny")).save_pretrained(path)
    return path


@pytest.mark.parametrize("edit, problem", [
    ({"depth": "x"}, "config.json: config key depth: expected int, got str 'x'"),
    ({"num_heads": -2}, "config.json: config key num_heads: must be >= 1, got -2"),
    ({"mlp_ratio": "wide"}, "config.json: config key mlp_ratio: expected float, got str 'wide'"),
    ({"embed_dim": 1000000}, "its config describes a model whose pos_embed has shape (1, 17, 1000000), but its "
                             "weights hold (1, 17, 16)"),
    ([1, 2], "config.json holds a JSON list, not an object of the model's settings"),
])
def test_uvit_from_pretrained_checks_its_config_first(uvit_dir, tmp_path, edit, problem):
    edited = _edited(uvit_dir, tmp_path, edit)
    with pytest.raises(ValueError) as e:
        UViTModel.from_pretrained(edited)
    assert str(e.value).startswith(f"UViTModel {edited}: ") and problem in str(e.value)
    assert "\n" not in str(e.value)


def test_uvit_from_pretrained_still_loads_a_good_dir(uvit_dir):
    model = UViTModel.from_pretrained(uvit_dir)
    assert model.config.embed_dim == 16 and model.pos_embed.shape == (1, 17, 16)


@pytest.mark.parametrize("edit, problem", [
    ({"num_hidden_layers": "x"}, "config.json: config key num_hidden_layers: expected int, got str 'x'"),
    ({"num_attention_heads": -2}, "config.json: config key num_attention_heads: must be >= 1, got -2"),
    ({"vocab_size": 1000000000}, "its config describes a model whose model.embed_tokens.weight has shape "
                                 "(1000000000, 64), but its weights hold (257, 64)"),
    ([1], "config.json holds a JSON list, not an object of the model's settings"),
])
def test_cogformer_from_pretrained_checks_its_config_first(cogformer_dir, tmp_path, edit, problem):
    edited = _edited(cogformer_dir, tmp_path, edit)
    with pytest.raises(ValueError) as e:
        CogformerForCausalLM.from_pretrained(edited)
    assert str(e.value).startswith(f"CogformerForCausalLM {edited}: ") and problem in str(e.value)
    loaded = CogformerForCausalLM.from_pretrained(cogformer_dir)
    assert loaded.config.vocab_size == 257


def test_sample_py_names_a_config_json_that_is_a_list(tmp_path, monkeypatch, capsys):
    """It said it could not connect to huggingface.co (diffusers took the list for a model id); no connection."""
    from uvic.config import DiffusionConfig
    from uvic.pipelines import UViCPipeline
    from uvic.schedulers import build_scheduler

    pipe = tmp_path / "pipe"
    model = UViTModel(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2)
    UViCPipeline(model.eval(), build_scheduler("dpm_solver", DiffusionConfig())).save_pretrained(pipe)
    (pipe / "transformer" / "config.json").write_text("[1, 2]")
    monkeypatch.setattr(sys, "argv", ["sample.py", str(pipe), "--grid", str(tmp_path / "g.png")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "huggingface.co" not in err
    assert err.strip().splitlines()[-1] == (
        f"sample.py: error: the transformer of {pipe}: {pipe / 'transformer' / 'config.json'} holds a JSON list, not "
        "an object of the model's settings")
