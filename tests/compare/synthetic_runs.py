"""Synthetic comparison directories: plan.json from a real plan, run dirs written as train.py leaves them.

A plain module rather than `conftest` (see tests/tiny_models.py); conftest.py holds the fixture.

A synthetic run dir holds what the report reads (config.yaml, metrics.jsonl, eval.jsonl, samples/step_*.png, the
last checkpoint's meta.json and pipeline/), with values the test chooses, so the report is checked against numbers
known in advance, in milliseconds."""

import json
from pathlib import Path

import numpy as np
import yaml
from PIL import Image


ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "demo_digits.yaml")
MAX_STEPS = 100


def write_run(plan, arm, seed, *, losses=None, val=None, fids=None, finished=True, grid=True, extra_lines="",
              shares=None, fid_record=None, validation=None):
    """Write the run dir of (arm, seed) of `plan`: training lines {step: loss}, validation lines {step: val_loss}
    (with the attention probe's {step: {block: share}}) and FID lines {step: fid} (with the fields `fid_record`,
    e.g. the FID network's); `validation` is validation.json's record; finished runs get the checkpoint at
    train.max_steps and pipeline/, unfinished ones a checkpoint at half their last logged step."""
    run = plan.run(arm, seed)
    d = run.run_dir
    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(plan.configs[arm]))
    cfg["train"].update(seed=seed, run_dir=str(d), resume="latest")
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    lines = [{"step": s, "loss": v, "lr": 1e-3} for s, v in (losses or {}).items()]
    lines += [{"step": s, "val_loss": v, **({"attn_neg_share": shares[s]} if s in (shares or {}) else {})}
              for s, v in (val or {}).items()]
    lines.sort(key=lambda r: r["step"])  # at a step with both, the validation line comes after the training line
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + extra_lines)
    if fids:
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "fid": v, "checkpoint": f"checkpoints/step_{s:09d}",
                                                          **(fid_record or {})}) + "\n" for s, v in fids.items()))
    if validation is not None:
        (d / "validation.json").write_text(json.dumps(validation))
    max_steps = plan.configs[arm]["train"]["max_steps"]
    last = max([*(losses or {}), 0])
    ckpt = d / "checkpoints" / f"step_{(max_steps if finished else last // 2):09d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))  # as train.py saves it with the weights
    (ckpt / "meta.json").write_text("{}")
    if finished:
        (d / "pipeline").mkdir(exist_ok=True)
        (d / "pipeline" / "model_index.json").write_text("{}")
    if grid:
        (d / "samples").mkdir(exist_ok=True)
        pixels = np.random.default_rng(seed).integers(0, 256, (18, 18, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(d / "samples" / f"step_{max_steps:07d}.png")
    return d
