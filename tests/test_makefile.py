"""The Makefile's demo targets take overrides (ARGS) and hand them to the training as overrides, not as an option's
value: `make demo ARGS="train.cpu_threads=1"`, as the README recommends on a shared machine."""

import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _commands(target: str, *make_args: str) -> list[list[str]]:
    """The command lines `make -n` prints for `target` (nothing runs), split as the shell would."""
    out = subprocess.run(["make", "-n", target, *make_args], cwd=ROOT, capture_output=True, text=True, check=True)
    return [shlex.split(line) for line in out.stdout.replace("\\\n", " ").splitlines() if line.strip()]


def _script_command(commands: list[list[str]], script: str) -> list[str]:
    (cmd,) = [c for c in commands if len(c) > 1 and c[1] == script]
    return cmd[2:]


def test_make_demo_passes_args_to_train_as_overrides():
    assert _script_command(_commands("demo"), "train.py") == ["configs/demo_digits.yaml", "--resume"]
    argv = _script_command(_commands("demo", "ARGS=train.cpu_threads=1 train.log_every=50"), "train.py")
    assert argv == ["configs/demo_digits.yaml", "train.cpu_threads=1", "train.log_every=50", "--resume"]
    # What train.py makes of it: the resolved config (demo_digits.yaml says cpu_threads: 0), nothing trained.
    shown = subprocess.run([sys.executable, "train.py", *argv, "--dry-run"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    assert "  cpu_threads: 1\n" in shown and "  log_every: 50\n" in shown


def test_make_compare_demo_passes_args_as_shared_overrides():
    plain = _script_command(_commands("compare-demo"), "compare.py")
    argv = _script_command(_commands("compare-demo", "ARGS=train.cpu_threads=1"), "compare.py")
    # Right after the config, before the first --arm: overrides that apply to every arm.
    assert argv[:3] == ["run", "configs/compare_digits.yaml", "train.cpu_threads=1"]
    assert argv[3:] == plain[2:] and plain[2] == "--arm"
