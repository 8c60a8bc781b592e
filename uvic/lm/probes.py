"""Representational-collapse probes of paper Sec. 3.2: "finding a zero" and "counting ones".

For each n, two inputs that differ in one detail are run through the model and `y1`, `y2` are the final-position
outputs of the last layer (after the final RMSNorm, as the official `draw_rep_dif.py`):

  * find_a_zero:  x1 = prompt + "1" * (n + 1),   x2 = prompt + "0" + "1" * n
  * count_ones:   x1 = prompt + "1" * (n + 1),   x2 = prompt + "1" * n

The reported number is the relative L-infinity difference  ||y2^n - y1^n||_inf / ||y2^ref - y1^ref||_inf
with ref = 200 (paper Sec. 3.2; the official script probes n = 200, 400, 600, 800, 1000, 2000 and divides by its
value at n = 200). The CSV also carries the official script's variant: the L-infinity norm per head slice of the
vector (D split into nh pieces), averaged over heads, normalised the same way.

    python -m uvic.lm.probes --model runs/tiny_lm --out runs/tiny_lm/probes
    python -m uvic.lm.probes --model cog_ckpt_100.00_Bi.pt --tokenizer llama2_tokenizer_dir --out probes/cog
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from uvic.errors import DataError, check_writable, cli_errors, storage_errors
from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM


logger = logging.getLogger(__name__)

PROBE_TASKS = ("find_a_zero", "count_ones")
# The prompts of the official script (trestad/CogAttn draw_rep_dif.py).
DEFAULT_PROMPTS = {
    "find_a_zero": "Is there a zero in the following sequences?",
    "count_ones": "How many ones are in the following sequences?",
}
# The official script's sequence lengths, and its normalisation point (the paper's n = 200).
DEFAULT_NS = (200, 400, 600, 800, 1000, 2000)
REF_N = 200


def probe_pair(task: str, n: int, prompt: str = "") -> tuple[str, str]:
    """The two texts (x1, x2) of `task` for sequence length n (see the module docstring)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if task == "find_a_zero":
        return prompt + "1" * (n + 1), prompt + "0" + "1" * n
    if task == "count_ones":
        return prompt + "1" * (n + 1), prompt + "1" * n
    raise ValueError(f"unknown probe task {task!r}; expected one of {PROBE_TASKS}")


def _check_ref_n(ns: tuple[int, ...], ref_n: int) -> None:
    if ref_n not in ns:
        raise ValueError(
            f"the probed lengths ns={sorted(ns)} do not include the normalisation point ref_n={ref_n}; "
            "add it to ns or pass another ref_n"
        )


@torch.no_grad()
def final_output(model: CogformerForCausalLM, input_ids: list[int]) -> torch.Tensor:
    """(D,) float32: the last layer's output (after the final norm) at the last position of one sequence."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    return model.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1].float()


def representation_differences(
    model: CogformerForCausalLM,
    tokenizer: Any,
    task: str,
    ns: tuple[int, ...] = DEFAULT_NS,
    prompt: str | None = None,
    ref_n: int = REF_N,
) -> list[dict]:
    """Rows {task, n, linf, rel_linf, head_linf, rel_head_linf} for each n in increasing order.

    `rel_*` divide by the row at n = `ref_n` (200, as the paper and the official script), which `ns` must
    contain. `prompt` defaults to the official prompt of `task`; pass "" for none.
    """
    if not ns:
        raise ValueError("ns must contain at least one sequence length")
    _check_ref_n(ns, ref_n)
    prompt = DEFAULT_PROMPTS[task] if prompt is None else prompt
    nh = model.config.num_attention_heads
    was_training = model.training
    model.eval()
    rows = []
    for n in sorted(ns):
        x1, x2 = probe_pair(task, n, prompt)
        d = final_output(model, tokenizer.encode(x2)) - final_output(model, tokenizer.encode(x1))
        head_linf = d.view(nh, -1).abs().amax(-1).mean() if d.numel() % nh == 0 else torch.tensor(float("nan"))
        rows.append({"task": task, "n": n, "linf": d.abs().max().item(), "head_linf": head_linf.item()})
    model.train(was_training)
    ref = next(row for row in rows if row["n"] == ref_n)
    for row in rows:
        for key in ("linf", "head_linf"):
            row[f"rel_{key}"] = row[key] / ref[key] if ref[key] > 0 else math.nan
    return rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    """Write probe rows to a CSV file with a header."""
    fields = ["task", "n", "linf", "rel_linf", "head_linf", "rel_head_linf"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: row[k] for k in fields} for row in rows)


def plot(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Plot relative L-infinity difference against n, one line per task, to an image file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for task in dict.fromkeys(row["task"] for row in rows):
        sel = [row for row in rows if row["task"] == task]
        ax.plot([r["n"] for r in sel], [r["rel_linf"] for r in sel], marker="o", ms=3, label=task)
    ax.set_xlabel("n")
    ax.set_ylabel(r"relative $L_\infty$ difference")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_probes(
    model: CogformerForCausalLM,
    tokenizer: Any,
    out_dir: str | Path,
    tasks: tuple[str, ...] = PROBE_TASKS,
    ns: tuple[int, ...] = DEFAULT_NS,
    prompt: str | None = None,
    title: str = "",
    ref_n: int = REF_N,
) -> list[dict]:
    """Run the probes and write `probes.csv` and `probes.png` into `out_dir`; returns the rows (normalised at
    n = `ref_n`, see `representation_differences`)."""
    _check_ref_n(ns, ref_n)  # before any output is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [row for task in tasks for row in representation_differences(model, tokenizer, task, ns, prompt, ref_n)]
    write_csv(rows, out_dir / "probes.csv")
    plot(rows, out_dir / "probes.png", title)
    return rows


def load_model_and_tokenizer(model_path: str, tokenizer: str | None) -> tuple[CogformerForCausalLM, Any]:
    """A Cogformer from a save_pretrained directory or an official `.pt` checkpoint, and its tokenizer.

    The tokenizer defaults to the one saved in the model directory; official checkpoints need `tokenizer`
    (the Llama-2 tokenizer they were trained with). Only data is loaded: a directory's weights from
    `model.safetensors`, an official checkpoint with `torch.load(weights_only=True)`.

    Raises:
        FileNotFoundError: `model_path` does not exist.
        DataError: it is not a Cogformer (another model's directory, no weights, a refused or foreign `.pt`).
    """
    from uvic.lm.data import load_tokenizer

    path = Path(model_path)
    if path.is_dir():
        _check_cogformer_dir(path)
        model = CogformerForCausalLM.from_pretrained(str(path), use_safetensors=True)
        tok_spec = tokenizer or str(path)
    elif path.is_file():
        from uvic.lm.official import cogformer_from_official

        model = cogformer_from_official(path)
        if tokenizer is None:
            raise ValueError(
                f"{path} is an official checkpoint without a tokenizer: pass --tokenizer (the Llama-2 tokenizer "
                "directory, tokenizer.json or tokenizer.model it was trained with)"
            )
        tok_spec = tokenizer
    else:
        raise FileNotFoundError(f"model {model_path!r} not found: pass a save_pretrained directory or an official .pt")
    return model, load_tokenizer(tok_spec)


def _check_cogformer_dir(path: Path) -> None:
    """Refuse a directory that is not a saved Cogformer with safetensors weights, naming what it holds instead."""
    config = path / "config.json"
    if not config.is_file():
        raise DataError(f"{path} is not a saved Cogformer: it has no config.json (pass a save_pretrained directory "
                        "or an official .pt checkpoint)")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as err:
        raise DataError(f"{config} is not a JSON model config ({err})") from None
    if model_type != CogformerConfig.model_type:
        raise DataError(f"{path} holds a {model_type!r} model, not a Cogformer ({CogformerConfig.model_type!r})")
    if not (path / "model.safetensors").is_file():
        raise DataError(f"{path} has no model.safetensors: only safetensors weights are loaded (other formats can "
                        "run code); save the model with save_pretrained")


def main(argv: list[str] | None = None) -> None:
    """CLI: run the two probes on a checkpoint and write probes.csv + probes.png."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="save_pretrained directory or official Cogformer .pt checkpoint")
    p.add_argument("--tokenizer", default=None, help="tokenizer ('byte', dir, tokenizer.json, .model); default: model dir")
    p.add_argument("--out", required=True, help="output directory for probes.csv and probes.png")
    p.add_argument("--tasks", default=",".join(PROBE_TASKS), help="comma-separated subset of " + ",".join(PROBE_TASKS))
    p.add_argument("--ns", default=",".join(map(str, DEFAULT_NS)), help="comma-separated n values")
    p.add_argument("--ref-n", type=int, default=REF_N, help="the n the relative differences divide by (in --ns)")
    p.add_argument("--prompt", default=None, help="text before the digits (default: the official prompt per task)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tasks = tuple(t for t in args.tasks.split(",") if t)
    for t in tasks:
        if t not in PROBE_TASKS:
            p.error(f"unknown task {t!r}; expected some of {PROBE_TASKS}")
    try:
        ns = tuple(int(n) for n in args.ns.split(",") if n)
    except ValueError:
        p.error(f"--ns must be comma-separated integers, got {args.ns!r}")
    if args.ref_n not in ns:
        p.error(f"--ns {args.ns} does not include the normalisation point --ref-n {args.ref_n}")
    with cli_errors(), storage_errors(f"could not write the probes to {args.out}"):
        check_writable(args.out, f"--out {args.out}")  # before loading a model that may be large
        model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer)
        model.to(args.device)
        title = Path(args.model).name
        rows = run_probes(model, tokenizer, args.out, tasks, ns, args.prompt, title=title, ref_n=args.ref_n)
    for row in rows:
        logger.info("%-12s n=%4d  rel_linf=%.4f  rel_head_linf=%.4f", row["task"], row["n"], row["rel_linf"],
                    row["rel_head_linf"])
    logger.info("wrote %s and %s", Path(args.out) / "probes.csv", Path(args.out) / "probes.png")


if __name__ == "__main__":
    main()
