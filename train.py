"""Train a U-ViT / U-ViC (or another registered task) from a YAML config of deltas.

    accelerate launch train.py configs/cifar10_uvic_s2.yaml train.batch_size=64
    accelerate launch train.py configs/cifar10_uvic_s2.yaml --resume      # continue the run in train.run_dir
    python train.py configs/demo_digits.yaml                              # the CPU demo
    python train.py configs/cifar10_uvic_s2.yaml --dry-run                # print the resolved config
    python train.py configs/cifar10_uvic_s2.yaml --export [CHECKPOINT]    # EMA -> run_dir/pipeline, no training
    python train.py configs/cifar10_uvic_s2.yaml --export best            # the lowest-FID checkpoint (best.json)
    python train.py runs/cifar10_uvic_s2 --export best                    # a run dir stands for its config.yaml
"""

import argparse
import dataclasses
import os

from uvic.config import load_config
from uvic.errors import ConfigError, cli_errors, configure_logging, one_line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML file of deltas from the defaults in uvic/config.py, or a run dir (its "
                                  "config.yaml, with train.run_dir set to it)")
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.lr=2e-4 model.depth=13")
    p.add_argument("-n", "--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest checkpoint of train.run_dir, or from the given checkpoint dir")
    p.add_argument("--export", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="export the EMA weights of a checkpoint (default: the latest; 'best': the lowest FID of "
                        "train.eval_every, run_dir/best.json) to run_dir/pipeline and exit")
    args = p.parse_intermixed_args()  # overrides may follow the options
    for option in ("resume", "export"):
        value = getattr(args, option)
        if value and "=" in value and not os.path.exists(value):
            # `--resume train.max_steps=150`: argparse gave the override to the option; it is an override, not a path.
            args.overrides = [*args.overrides, value]
            setattr(args, option, "latest")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    if args.resume:  # set as is: as a YAML override, a path such as "123" or "a: b" would change type
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=args.resume))
    if args.dry_run:
        print(cfg.to_yaml(), end="")
        return
    configure_logging()
    with cli_errors():  # bad input, a locked run dir, a failed write or a diverged run: one line, exit 1
        if args.export:
            from uvic.training.runs import export, export_source

            source, why = export_source(cfg.train.run_dir, args.export)
            print(export(source, f"{cfg.train.run_dir}/pipeline", why))
            return
        from uvic.training import train

        try:
            train(cfg)
        except ConfigError as e:  # checked before the run dir is touched: a config error, exit status 2
            p.error(one_line(str(e)))


if __name__ == "__main__":
    main()
