"""Representational-collapse probes (paper Sec. 3.2) on a tiny random model: values, CSV, PNG and the CLI."""

import csv
import json
import os

import pytest
import torch

from uvic.lm.data import byte_tokenizer
from uvic.lm.probes import main, probe_pair, representation_differences, run_probes
from uvic.models.cogformer import CogformerForCausalLM, cogformer_config


def test_probe_pairs():
    assert probe_pair("find_a_zero", 3, "Q?") == ("Q?1111", "Q?0111")
    assert probe_pair("count_ones", 3) == ("1111", "111")
    with pytest.raises(ValueError, match="unknown probe task"):
        probe_pair("count_zeros", 3)


def test_probe_values_against_hidden_states():
    """L-inf of the difference of final-position outputs, from the causal LM's own hidden_states output."""
    torch.manual_seed(0)
    model = CogformerForCausalLM(cogformer_config("tiny")).eval()
    tok = byte_tokenizer()
    rows = representation_differences(model, tok, "count_ones", ns=(12, 3, 6), prompt="n:", ref_n=6)
    assert [r["n"] for r in rows] == [3, 6, 12]
    for r in rows:
        x1, x2 = probe_pair("count_ones", r["n"], "n:")
        with torch.no_grad():
            y = [model(torch.tensor([tok.encode(x)]), output_hidden_states=True).hidden_states[-1][0, -1] for x in (x1, x2)]
        d = y[1] - y[0]
        assert r["linf"] == pytest.approx(d.abs().max().item(), rel=1e-5)
        assert r["head_linf"] == pytest.approx(d.view(4, 16).abs().amax(-1).mean().item(), rel=1e-5)
        assert r["rel_linf"] == pytest.approx(r["linf"] / rows[1]["linf"])  # normalised at ref_n = 6
    assert rows[1]["rel_linf"] == 1.0


def _hand_linf(model, tok, task, n, prompt):
    """||y2 - y1||_inf and its per-head mean for one n, from the causal LM's last hidden state."""
    x1, x2 = probe_pair(task, n, prompt)
    with torch.no_grad():
        out = [model(torch.tensor([tok.encode(x)]), output_hidden_states=True) for x in (x1, x2)]
    d = (out[1].hidden_states[-1][0, -1] - out[0].hidden_states[-1][0, -1]).double()
    return d.abs().max().item(), d.view(4, 16).abs().amax(-1).mean().item()


def test_relative_difference_is_normalised_at_n_200():
    """Paper Sec. 3.2: Delta L_inf(n) = ||y2^n - y1^n||_inf / ||y2^200 - y1^200||_inf, whatever else is probed."""
    torch.manual_seed(0)
    model = CogformerForCausalLM(cogformer_config("tiny")).eval()
    tok = byte_tokenizer()
    ns = (100, 200, 300)
    rows = representation_differences(model, tok, "find_a_zero", ns=ns, prompt="z:")
    hand = {n: _hand_linf(model, tok, "find_a_zero", n, "z:") for n in ns}
    for r in rows:
        assert r["rel_linf"] == pytest.approx(hand[r["n"]][0] / hand[200][0], rel=1e-4)
        assert r["rel_head_linf"] == pytest.approx(hand[r["n"]][1] / hand[200][1], rel=1e-4)
    # Not the largest n: normalising there would give other numbers.
    assert abs(rows[0]["rel_linf"] - hand[100][0] / hand[300][0]) > 1e-3


def test_probed_range_must_include_the_normalisation_point(tmp_path):
    model = CogformerForCausalLM(cogformer_config("tiny")).eval()
    with pytest.raises(ValueError, match="ref_n=200"):
        representation_differences(model, byte_tokenizer(), "count_ones", ns=(10, 100))
    with pytest.raises(ValueError, match="ref_n=5"):
        run_probes(model, byte_tokenizer(), tmp_path / "out", ns=(2, 10), ref_n=5)
    assert not (tmp_path / "out").exists()


def test_run_probes_writes_csv_and_png(tmp_path):
    torch.manual_seed(0)
    model = CogformerForCausalLM(cogformer_config("tiny")).eval()
    rows = run_probes(model, byte_tokenizer(), tmp_path, ns=(2, 5, 10), ref_n=5)
    with open(tmp_path / "probes.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["task"], int(r["n"])) for r in table] == [(t, n) for t in ("find_a_zero", "count_ones") for n in (2, 5, 10)]
    assert [float(r["rel_linf"]) for r in table] == pytest.approx([r["rel_linf"] for r in rows])
    assert (tmp_path / "probes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_on_saved_model(tmp_path):
    torch.manual_seed(0)
    CogformerForCausalLM(cogformer_config("tiny")).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    main(["--model", str(tmp_path / "model"), "--out", str(tmp_path / "p"), "--ns", "4,8", "--ref-n", "4",
          "--tasks", "find_a_zero"])
    with open(tmp_path / "p" / "probes.csv") as f:
        assert [int(r["n"]) for r in csv.DictReader(f)] == [4, 8]
    assert (tmp_path / "p" / "probes.png").is_file()
    with pytest.raises(SystemExit):  # the default --ref-n 200 is not among --ns
        main(["--model", str(tmp_path / "model"), "--out", str(tmp_path / "r"), "--ns", "4,8"])


def test_cli_refuses_a_missing_model_or_a_directory_that_is_not_a_cogformer(tmp_path, cli_error):
    out = ["--out", str(tmp_path / "p")]
    assert "not found" in cli_error(main, ["--model", str(tmp_path / "nope"), *out])
    (tmp_path / "empty").mkdir()
    assert "no config.json" in cli_error(main, ["--model", str(tmp_path / "empty"), *out])
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert "'bert' model, not a Cogformer" in cli_error(main, ["--model", str(tmp_path / "bert"), *out])
    # A Cogformer saved with pickled weights only: refused, since loading them could run code.
    model = CogformerForCausalLM(cogformer_config("tiny"))
    model.save_pretrained(tmp_path / "pickled")
    (tmp_path / "pickled" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    assert "no model.safetensors" in cli_error(main, ["--model", str(tmp_path / "pickled"), *out])


class _Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cli_refuses_a_foreign_or_malicious_checkpoint(tmp_path, cli_error):
    out = ["--tokenizer", "byte", "--out", str(tmp_path / "p")]
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    line = cli_error(main, ["--model", str(tmp_path / "other.pt"), *out])
    assert "other.pt" in line and "not an official Cogformer checkpoint" in line
    marker = tmp_path / "pwned"
    torch.save({"model_cfg": {}, "model": _Payload(marker)}, tmp_path / "evil.pt")
    line = cli_error(main, ["--model", str(tmp_path / "evil.pt"), *out])
    assert "evil.pt" in line and not marker.exists()
