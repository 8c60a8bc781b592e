"""Compare training configs the paper's way, with error bars: arms x seeds on common random numbers, one report.

    python compare.py run configs/compare_digits.yaml --arm uvit model.attention=softmax --arm uvic \\
        --seeds 0 1 2 --out runs/cmp_digits --jobs 2                 # make compare-demo: minutes on a CPU
    python compare.py plan configs/cifar10_uvic_s2.yaml --arm uvit model.attention=softmax --arm uvic \\
        --seeds 0 1 2 --out runs/cmp_cifar10 --launcher "accelerate launch --multi_gpu --num_processes 4" > jobs.txt
    python compare.py report runs/cmp_cifar10        # whatever has finished; `run` ends with it too
    accelerate launch --num_processes 8 compare.py report runs/cmp_cifar10 --gen-seeds 3 \\
        --fid train.eval_reference=assets/fid_stats/fid_stats_cifar10_train_pytorch.npz  # each FID 3 times

Overrides right after CONFIG apply to every arm; each `--arm NAME` takes its own; the first arm is the baseline.
Run (arm, seed) is the ordinary run dir OUT/<arm>/seed_<seed>/, trained by `train.py CONFIG ... train.seed=<seed>
train.run_dir=OUT/<arm>/seed_<seed> --resume`. `run` trains them here and is resumable (the same command after a
kill finishes the job); `plan` prints the commands, one per line, for a scheduler, and writes OUT/plan.json.
`--gen-seeds K` (run, report) computes each finished run's protocol FID K times with disjoint sampling seeds
(`uvic.compare.protocol_fid`).
"""

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from uvic.errors import cli_errors, configure_logging, int_at_least, one_line


ROOT = Path(__file__).resolve().parent


def _script(name: str) -> str:
    """The script `name` beside this one, relative to the working directory when it is below it."""
    script = ROOT / name
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, text in [("run", "train every run here (resumable), then write the report"),
                       ("plan", "print one train.py command per run and write OUT/plan.json; trains nothing")]:
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument("config", help="YAML file of deltas from the defaults in uvic/config.py")
        q.add_argument("overrides", nargs="*", help="dotted key=value applied to every arm")
        q.add_argument("--arm", nargs="+", action="append", required=True, metavar=("NAME", "KEY=VALUE"),
                       help="an arm and its own overrides (repeat; the first is the baseline)")
        q.add_argument("--seeds", nargs="+", type=int, required=True, metavar="S", help="training seeds")
        q.add_argument("--out", required=True, help="the comparison directory")
        q.add_argument("--launcher", default=None,
                       help='what starts train.py, e.g. "accelerate launch --num_processes 8" (default: this '
                            'Python, sys.executable)')
        parsers[name] = q
    parsers["run"].add_argument("--jobs", type=int_at_least(1), default=1, help="runs trained at once (default 1)")
    parsers["run"].add_argument("--quiet", action="store_true",
                                help="no progress bar (runs finished / running / waiting, their steps, the time "
                                     "left); the log lines stay")
    q = sub.add_parser("report", help="write the report of whatever has finished",
                       description="write OUT/report.{json,md,html} and OUT/figures/ from the finished runs")
    q.add_argument("out", help="the comparison directory")
    q.add_argument("--baseline", default=None, metavar="ARM",
                   help="compare every other arm with ARM (default: the first arm of the plan), from the same runs")
    q.add_argument("--all-pairs", action="store_true",
                   help="also compare every two arms (each metric's `pairs` in report.json, a table in report.md)")
    parsers["report"] = q
    for name in ("run", "report"):
        parsers[name].add_argument(
            "--gen-seeds", type=int_at_least(1), default=0, metavar="K",
            help="compute each finished run's protocol FID K times, with disjoint sampling seeds (resumable)")
        parsers[name].add_argument(
            "--fid", nargs="+", default=[], metavar="KEY=VALUE",
            help="the protocol FID's settings in place of the run config's: its train.eval_* keys (not eval_every), "
                 "e.g. train.eval_reference=ref.npz train.eval_num_images=10000 train.eval_fid_dims=2048")
    args = p.parse_args()
    q = parsers[args.command]
    configure_logging()
    gen_seeds, fid = getattr(args, "gen_seeds", 0), getattr(args, "fid", [])  # run and report only
    if fid and not gen_seeds:
        q.error("--fid sets the protocol FID of --gen-seeds K: give --gen-seeds too")

    from uvic.compare.plan import Arm, check_out_dir, load_plan, make_plan, shell_command, write_plan
    from uvic.compare.protocol_fid import Protocol, check_fid_keys, check_protocol, compute_protocol_fids
    from uvic.compare.report import write_report
    from uvic.compare.run import lock_comparison, pending_runs, run_plan
    from uvic.errors import USER_ERRORS, ConfigError, StorageError

    protocol = Protocol(gen_seeds, tuple(fid)) if gen_seeds else None
    failed = []

    if args.command != "report":
        try:  # everything is checked before anything is written or trained
            launcher = shlex.split(args.launcher) if args.launcher else None
            arms = [Arm(name, tuple(overrides)) for name, *overrides in args.arm]
            plan = make_plan(args.config, args.overrides, arms, args.seeds, args.out)
            check_out_dir(plan)
            if args.command == "run":
                pending_runs(plan)  # refuses run dirs of another config before anything is written
                if protocol:
                    check_protocol(plan, protocol)
                lock = lock_comparison(plan.out)  # a second `run` on this --out is refused here, having written nothing
        except (ConfigError, FileNotFoundError, ValueError, StorageError) as e:
            q.error(one_line(str(e)))
        with cli_errors():
            write_plan(plan)
            if args.command == "plan":
                logging.info(f"wrote {plan.out / 'plan.json'}; run the commands from {Path.cwd()}, then "
                             f"`python {_script('compare.py')} report {plan.out}`")
                for run in plan.runs:
                    print(shell_command(plan.command(run, launcher, _script("train.py"))))
                return
            # A `kill` (SIGTERM) stops the runs in training too, as Ctrl-C does.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
            try:
                failed = run_plan(plan, jobs=args.jobs, train_script=_script("train.py"), launcher=launcher,
                                  progress=not args.quiet)
            except KeyboardInterrupt:  # Ctrl-C: the runs were stopped (run_plan says so); no traceback
                sys.exit(130)
    elif protocol:
        try:
            plan = load_plan(args.out)
            check_fid_keys(protocol)
        except (FileNotFoundError, ConfigError) as e:  # not a comparison directory, a bad --fid: usage errors
            q.error(str(e))
    fid_error = None
    if protocol:
        try:
            compute_protocol_fids(plan, protocol)
        except USER_ERRORS as e:  # the report of what there is is still written
            fid_error = e
        except KeyboardInterrupt:  # the FIDs computed so far are kept; the same command continues
            sys.exit(130)
        from accelerate import PartialState

        if not PartialState().is_main_process:  # `accelerate launch compare.py report`: the main process writes
            sys.exit(1 if fid_error else 0)
    with cli_errors():
        try:
            data = write_report(args.out, getattr(args, "baseline", None), getattr(args, "all_pairs", False))
        except (FileNotFoundError, ConfigError) as e:  # not a comparison directory, an unknown --baseline: usage errors
            q.error(str(e))
    _print_summary(args.out, data)
    if args.command == "run":
        lock.release()
    if fid_error is not None:
        sys.exit(f"error: the protocol FID: {one_line(str(fid_error))}")
    if args.command == "run" and failed:
        sys.exit(f"error: {len(failed)} run(s) failed: {', '.join(r.label for r in failed)}; see "
                 f"{os.path.join(args.out, 'report.md')}")


def _print_summary(out: str, data: dict) -> None:
    """The verdicts, one line per (metric, arm), and where the report is."""
    for name, entry in data["metrics"].items():
        for arm, vs in entry["vs_baseline"].items():
            ci = f"[{vs['ci95'][0]:.4g}, {vs['ci95'][1]:.4g}]" if vs["ci95"] else "n/a"
            diff = f"{vs['mean_diff']:.4g}" if vs["mean_diff"] is not None else "n/a"
            print(f"{name}: {arm} - {data['baseline']} = {diff} (95% interval {ci}, {vs['n']} seeds): {vs['verdict']}")
    for name, entry in data["metrics"].items():
        for pair, vs in entry.get("pairs", {}).items():
            if pair.partition(" - ")[2] != data["baseline"]:  # the baseline's contrasts are above
                ci = f"[{vs['ci95'][0]:.4g}, {vs['ci95'][1]:.4g}]" if vs["ci95"] else "n/a"
                diff = f"{vs['mean_diff']:.4g}" if vs["mean_diff"] is not None else "n/a"
                print(f"{name}: {pair} = {diff} (95% interval {ci}, {vs['n']} seeds): {vs['verdict']}")
        if left_out := [f"{arm} seed {seed} ({why})" for arm, by_seed in entry.get("excluded", {}).items()
                        for seed, why in by_seed.items()]:
            print(f"{name}: finished runs left out: {'; '.join(left_out)}")
        if entry.get("comparable") is False:
            print(f"{name}: a smoke test, not comparable with published numbers: {entry['reason']}")
    states = [s["state"] for seeds in data["runs"].values() for s in seeds.values()]
    print(f"{states.count('finished')} of {len(states)} runs finished; report: {os.path.join(out, 'report.html')}")


if __name__ == "__main__":
    main()
