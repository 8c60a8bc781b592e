"""What a comparison trains: arms x seeds, each run an ordinary `train.py` command, checked before anything runs.

    plan = make_plan("configs/demo_digits.yaml", ["train.max_steps=600"],
                     [Arm("uvit", ("model.attention=softmax",)), Arm("uvic", ())], seeds=[0, 1, 2], out="runs/cmp")
    check_out_dir(plan)          # refuses an --out that holds another comparison
    write_plan(plan)             # DIR/plan.json
    plan.command(plan.runs[0])   # [sys.executable, "train.py", CONFIG, ..., "train.seed=0", "train.run_dir=...",
                                 #  "--resume"]

Run (arm, seed) lives in `DIR/<arm>/seed_<seed>/` and is trained by `train.py CONFIG <shared overrides> <arm's
overrides> train.seed=<seed> train.run_dir=DIR/<arm>/seed_<seed> --resume`: its seed is the training seed and
nothing else, the same for every arm, so the arms of one seed start from the same weights and see the same data and
noise (common random numbers). `--resume` makes every command restartable: a fresh run starts, an interrupted one
continues from its last checkpoint, a finished one only exports again.

`DIR/plan.json` records what was planned; a second plan for the same DIR must be the same comparison (arm names in
order, seeds, and each arm's resolved config up to `NEUTRAL_KEYS`), so the results of two plans are never mixed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from uvic.config import load_config
from uvic.errors import ConfigError, storage_errors
from uvic.io import atomic_write
from uvic.training.lock import LOCK_NAME


logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
PLAN_VERSION = 1
# Set by the comparison for each run; an override of them would break the pairing or the layout.
RESERVED_KEYS = ("train.seed", "train.run_dir", "train.resume")
# Keys that change how fast a run goes or where it is watched, never what it computes: plans that differ only in
# them are the same comparison (and a run dir whose config differs only in them belongs to it).
NEUTRAL_KEYS = ("train.cpu_threads", "train.log_with", "data.num_workers")
# Arm names become directory names inside the comparison directory, beside its own files and folders.
_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_ARM_NAME = 100  # portable: well under any file system's 255 bytes, with room for the seed folders
_RESERVED_NAMES = ("plan.json", "attempts.json", "report.json", "report.md", "report.html", "figures")


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: a name and the overrides that make it differ from the shared config."""

    name: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """One (arm, seed) training run."""

    arm: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]  # everything after CONFIG on its train.py command line

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"

    @property
    def key(self) -> str:
        """"<arm>/seed_<seed>": the run dir relative to the comparison directory."""
        return f"{self.arm}/{self.run_dir.name}"

    @property
    def log_path(self) -> Path:
        """Where `compare.py run` writes the run's output: beside its run dir, `<arm>/seed_<seed>.log`."""
        return self.run_dir.with_name(f"{self.run_dir.name}.log")


@dataclass(frozen=True)
class Plan:
    """A checked comparison. `configs[arm]` is the arm's resolved config (`Config.to_dict()`) less `RESERVED_KEYS`."""

    config: str
    overrides: tuple[str, ...]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    out: Path
    configs: dict[str, dict[str, Any]]

    @property
    def baseline(self) -> str:
        return self.arms[0].name

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    @property
    def runs(self) -> list[Run]:
        """Every run, seed by seed (all arms of a seed before the next seed, so whatever finished first pairs up)."""
        return [self.run(arm.name, seed) for seed in self.seeds for arm in self.arms]

    def run(self, arm: str, seed: int) -> Run:
        run_dir = self.out / arm / f"seed_{seed}"
        overrides = next(a.overrides for a in self.arms if a.name == arm)
        return Run(arm, seed, run_dir, (*self.overrides, *overrides, f"train.seed={seed}",
                                        path_override("train.run_dir", run_dir)))

    def command(self, run: Run, launcher: Sequence[str] | None = None, train_script: str = "train.py",
                extra: Sequence[str] = ()) -> list[str]:
        """The argv that trains `run`: `launcher` (e.g. ["accelerate", "launch", "--num_processes", "8"]; None:
        this Python, `sys.executable`, so that a job runs with the packages that checked the plan, whatever
        `python` its PATH finds), the script, CONFIG, the run's overrides, `extra` overrides, `--resume`."""
        launcher = list(launcher) if launcher else [sys.executable]
        return [*launcher, train_script, self.config, *run.overrides, *extra, "--resume"]

    def to_json(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "config": self.config, "overrides": list(self.overrides),
                "arms": [{"name": a.name, "overrides": list(a.overrides), "config": self.configs[a.name]}
                         for a in self.arms],
                "seeds": list(self.seeds)}

    @classmethod
    def from_json(cls, data: dict[str, Any], out: Path) -> Plan:
        arms = tuple(Arm(a["name"], tuple(a["overrides"])) for a in data["arms"])
        return cls(config=data["config"], overrides=tuple(data["overrides"]), arms=arms,
                   seeds=_integer_seeds(data["seeds"]), out=Path(out),
                   configs={a["name"]: a["config"] for a in data["arms"]})


def _integer_seeds(seeds: Any) -> tuple[int, ...]:
    """The seeds of a plan read back, each an integer as `make_plan` writes it: a 0.7 or a `true` read as 0 or 1
    would report another seed's run dir as this one.

    Raises:
        ValueError: naming the first seed that is not an integer.
    """
    if not isinstance(seeds, list):
        raise ValueError(f"seeds {seeds!r} is not a list")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seeds: {seed!r} is not an integer")
    return tuple(seeds)


def make_plan(config: str, overrides: Sequence[str], arms: Sequence[Arm], seeds: Sequence[int],
              out: str | Path) -> Plan:
    """Check a comparison and resolve every arm's config (nothing is written).

    Raises:
        FileNotFoundError: `config` does not exist.
        ConfigError: fewer than 2 arms, a bad or duplicate arm name, a duplicate seed, an override of a key the
            comparison sets per run (`RESERVED_KEYS`), or any arm whose config does not load (unknown key, bad
            value, a seed out of range): the message names the arm.
    """
    if len(arms) < 2:
        raise ConfigError(f"a comparison needs at least two arms (--arm NAME [KEY=VALUE ...]), got {len(arms)}")
    names = [a.name for a in arms]
    for name in names:
        check_arm_name(name)
    _no_duplicates(names, "arm name")
    _no_duplicates([n.lower() for n in names], "arm name (letter case aside: one folder on some file systems)")
    if not seeds:
        raise ConfigError("a comparison needs at least one seed (--seeds S [S ...])")
    _no_duplicates(list(seeds), "seed")
    for where, items in [("the shared overrides", overrides), *((f"arm {a.name!r}", a.overrides) for a in arms)]:
        for item in items:
            key = item.partition("=")[0].strip()
            if key in RESERVED_KEYS:
                raise ConfigError(f"{where}: {key} is set by the comparison for each run (--seeds, --out); "
                                  f"remove {item!r}")
    try:
        load_config(config, overrides)
    except ConfigError as e:
        raise ConfigError(f"{config} with the shared overrides: {e}") from None
    plan = Plan(config=str(config), overrides=tuple(overrides), arms=tuple(arms), seeds=tuple(int(s) for s in seeds),
                out=Path(out), configs={})
    for arm in arms:
        for seed in plan.seeds:  # each run's config exactly as its command loads it
            run = plan.run(arm.name, seed)
            try:
                resolved = load_config(config, run.overrides).to_dict()
            except ConfigError as e:
                raise ConfigError(f"arm {arm.name!r} (seed {seed}): {e}") from None
        plan.configs[arm.name] = _without(resolved, RESERVED_KEYS)
    base = plan.configs[plan.baseline]
    for arm in arms[1:]:
        if config_difference(base, plan.configs[arm.name]) is None:
            logger.warning(f"arm {arm.name!r} has the same config as the baseline {plan.baseline!r}: this is an "
                           f"A/A comparison (expect a difference of exactly 0)")
    return plan


def check_arm_name(name: Any, where: str = "") -> None:
    """Refuse an arm name that is not a portable file name or that is one of the comparison's own files or folders
    (`_RESERVED_NAMES`, letter case aside): it names the arm's folder inside the comparison directory.

    Raises:
        ConfigError: naming the arm (and `where` it was read, e.g. plan.json).
    """
    ok = (isinstance(name, str) and bool(_ARM_NAME.fullmatch(name)) and len(name) <= MAX_ARM_NAME
          and name.lower() not in _RESERVED_NAMES)
    if not ok:
        hint = " (it looks like an override: write --arm NAME KEY=VALUE ...)" if "=" in str(name) else ""
        raise ConfigError(f"{where}arm name {name!r} must be letters, digits, '.', '_' or '-' (not starting with '.' "
                          f"or '-'), at most {MAX_ARM_NAME} characters, and not one of the comparison's own files "
                          f"or folders ({', '.join(_RESERVED_NAMES)}): it names a directory{hint}")


def path_override(key: str, path: str | Path) -> str:
    """The override `key=<path>` that gives `path` to train.py literally: an override's value is YAML, so a path
    that YAML would read otherwise (`/tmp/x #y` is `/tmp/x`, ` /tmp/x` is `/tmp/x`, `123` is a number) is written
    as a double-quoted YAML string.

    Raises:
        ConfigError: a path that no YAML string gives back exactly (e.g. one with a NUL or a non-printable
            character).
    """
    text = str(path)
    for value in (text, json.dumps(text, ensure_ascii=False)):
        try:
            if "\0" not in text and yaml.safe_load(value) == text:
                return f"{key}={value}"
        except yaml.YAMLError:
            continue
    raise ConfigError(f"the path {text!r} ({key}) cannot be passed to train.py literally: choose another --out")


def load_plan(out: str | Path) -> Plan:
    """The plan recorded in `out/plan.json`.

    Raises:
        FileNotFoundError: no plan.json there (not a comparison directory). ConfigError: it does not parse.
    """
    path = Path(out) / PLAN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{out} holds no {PLAN_FILE}: not a comparison directory (compare.py plan/run "
                                f"--out {out} makes one)")
    try:
        data = json.loads(path.read_text())
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {PLAN_VERSION}")
        plan = Plan.from_json(data, Path(out))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path} is not a comparison plan ({type(e).__name__}: {e})") from None
    _check_loaded_plan(plan, path)
    return plan


def _check_loaded_plan(plan: Plan, path: Path) -> None:
    """What a plan read back must hold before any run dir is looked at: arm names as `make_plan` accepts them,
    and each arm's config with a `train` section whose `max_steps` is a positive integer.

    Raises:
        ConfigError: naming `path`, the arm and what is wrong.
    """
    for name in plan.arm_names:
        check_arm_name(name, f"{path}: ")
    try:
        _no_duplicates(plan.arm_names, "arm name")
        _no_duplicates([n.lower() for n in plan.arm_names], "arm name (letter case aside)")
        _no_duplicates(list(plan.seeds), "seed")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if len(plan.arms) < 2 or not plan.seeds:
        raise ConfigError(f"{path} is not a comparison plan: it needs at least two arms and a seed")
    for name in plan.arm_names:
        config = plan.configs.get(name)
        train = config.get("train") if isinstance(config, dict) else None
        steps = train.get("max_steps") if isinstance(train, dict) else None
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            what = "no 'train' section" if not isinstance(train, dict) else f"train.max_steps {steps!r}"
            raise ConfigError(f"{path} is not a comparison plan: arm {name!r}'s config has {what}")


def check_out_dir(plan: Plan) -> None:
    """Refuse an output directory that holds anything but this comparison (nothing is written).

    Raises:
        ConfigError: `plan.out` is a file, holds files but no plan.json, or holds the plan of other arms, seeds
            or configs (the message names the first difference).
    """
    out = plan.out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if not out.is_dir() or not any(p.name != LOCK_NAME for p in out.iterdir()):  # a lock a kill -9 left is nothing
        return
    if not (out / PLAN_FILE).is_file():
        raise ConfigError(f"--out {out} is not empty and holds no {PLAN_FILE}: it is not a comparison, and nothing "
                          f"in it is overwritten; choose another --out")
    old = load_plan(out)
    why = plan_growth(old, plan)
    if why is not None:
        raise ConfigError(f"--out {out} holds another comparison ({why}); the results of two plans are never "
                          f"mixed: choose another --out")
    arms, seeds = plan.arm_names[len(old.arms):], sorted(set(plan.seeds) - set(old.seeds))
    if arms or seeds:
        logger.info(f"--out {out}: the comparison grows by {f'arms {arms}' if arms else ''}"
                    f"{' and ' if arms and seeds else ''}{f'seeds {seeds}' if seeds else ''}; its runs so far are "
                    f"kept as they are")


def plan_growth(old: Plan, new: Plan) -> str | None:
    """How `new` differs from `old` other than by growing (None if it is `old`, or `old` with arms added after its
    arms or seeds added): a grown comparison trains only its new runs and keeps the others as they are, so every arm
    of `old` must keep its place (the first is the baseline) and its config, and no seed may be dropped."""
    if new.arm_names[:len(old.arms)] != old.arm_names:
        return (f"arms {old.arm_names} there, {new.arm_names} here (the first is the baseline; a comparison grows by "
                f"arms added after its own)")
    if dropped := sorted(set(old.seeds) - set(new.seeds)):
        return f"seeds {sorted(old.seeds)} there, {sorted(new.seeds)} here (a comparison grows by seeds, {dropped} dropped)"
    for name in old.arm_names:
        why = config_difference(old.configs[name], new.configs[name])
        if why is not None:
            return f"arm {name!r}: {why}"
    return None


def rebase(plan: Plan, baseline: str) -> Plan:
    """`plan` with `baseline` as its first arm (the others in their order): the contrasts of the report against it.

    Raises:
        ConfigError: `baseline` is not an arm of the plan.
    """
    if baseline not in plan.arm_names:
        raise ConfigError(f"--baseline {baseline!r} is not an arm of this comparison ({', '.join(plan.arm_names)})")
    arms = tuple(sorted(plan.arms, key=lambda a: a.name != baseline))  # stable: the others keep their order
    return dataclasses.replace(plan, arms=arms)


def write_plan(plan: Plan) -> Path:
    """Write `plan.out/plan.json` (atomically); returns its path.

    Raises:
        StorageError: it cannot be written (no permission, a file in the way).
    """
    path = plan.out / PLAN_FILE
    with storage_errors(f"cannot write {path}"):
        plan.out.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            json.dump(plan.to_json(), f, indent=1)
    return path


def shell_command(argv: Sequence[str]) -> str:
    """`argv` as one line a POSIX shell runs as is."""
    return shlex.join(argv)


def config_difference(there: dict[str, Any], here: dict[str, Any],
                      ignore: Sequence[str] = NEUTRAL_KEYS) -> str | None:
    """The first key (dotted, sorted) whose value differs between two config dicts, as "KEY is A there, B here",
    or None; keys in `ignore` do not count."""
    a, b = flatten(there), flatten(here)
    for key in sorted(set(a) | set(b)):
        if key not in ignore and a.get(key, "(unset)") != b.get(key, "(unset)"):
            return f"{key} is {a.get(key, '(unset)')!r} there, {b.get(key, '(unset)')!r} here"
    return None


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested dict."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _without(d: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """A copy of nested `d` less the dotted `keys`."""
    out = json.loads(json.dumps(d))
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return out


def _no_duplicates(items: list[Any], what: str) -> None:
    seen = set()
    for item in items:
        if item in seen:
            raise ConfigError(f"duplicate {what} {item!r}: each must be given once")
        seen.add(item)
