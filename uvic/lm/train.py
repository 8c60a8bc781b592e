"""Train a tiny byte-level Cogformer on a UTF-8 text file on the CPU (a thin CLI over `uvic.lm.task.train_tiny`).

    python -m uvic.lm.train --text my.txt --out runs/tiny_lm --steps 300

The output directory is a `save_pretrained` model + tokenizer: load it with `AutoModelForCausalLM.from_pretrained`
after `import uvic.models.cogformer`, evaluate it with `python -m uvic.lm.eval`, probe it with `python -m uvic.lm.probes`.
"""

from __future__ import annotations

import argparse
import logging

import torch

from uvic.lm.task import train_tiny


logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, help="UTF-8 text file to learn")
    p.add_argument("--out", required=True, help="output directory (save_pretrained format)")
    p.add_argument("--attention", default="cog", choices=["cog", "softmax"], help="softmax = Transformer baseline")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=1, help="torch CPU threads (tiny matrices: 1 is fastest)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    r = train_tiny(
        args.text, args.out, attention=args.attention, steps=args.steps, batch_size=args.batch_size,
        block_size=args.block_size, lr=args.lr, seed=args.seed,
    )  # fmt: skip
    logger.info(
        "loss %.4f -> %.4f nats/token (unigram entropy of the data: %.4f); saved to %s",
        r.initial_loss, r.final_loss, r.unigram_entropy, args.out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
