"""Run lm-evaluation-harness on a saved Cogformer with the stock `hf` model type.

lm-eval's `hf` model loads `pretrained=DIR` through `AutoConfig` / `AutoModelForCausalLM`, which only know the
"cogformer" model type after `uvic.models.cogformer` is imported. This module imports it and then hands the
command line to lm-eval's own CLI unchanged, so no `trust_remote_code` is involved:

    python -m uvic.lm.eval --model hf --model_args pretrained=runs/tiny_lm,backend=causal \\
        --tasks arc_easy,piqa --device cpu --batch_size 8

Needs `pip install lm-eval` (not a uvic dependency) and network access for the task datasets.
"""

from __future__ import annotations

import sys


def main() -> None:
    import uvic.models.cogformer  # noqa: F401  (registers "cogformer" with the transformers Auto classes)

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        raise SystemExit(f"error: lm-evaluation-harness is not installed ({err}); install it with `pip install lm-eval`")
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
