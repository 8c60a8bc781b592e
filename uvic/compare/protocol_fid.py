"""The protocol FID of a comparison's finished runs, K times with disjoint sampling seeds (`compare.py --gen-seeds K`).

    protocol = Protocol(gen_seeds=3, overrides=("train.eval_reference=ref.npz", "train.eval_num_images=10000"))
    check_protocol(plan, protocol)        # before anything trains: every arm's FID settings load and exist
    compute_protocol_fids(plan, protocol) # each finished run: DIR/<arm>/seed_<s>/fid_protocol.json

Why K: a FID has two sources of spread, the training seed (which network training gave) and the sampling seeds
(which images scored it). Computing each run's FID K times with disjoint sampling seeds lets the report separate
them (`uvic.compare.stats.fid_spreads`): the spread across training seeds of the per-run means, and the mean over
runs of the spread across the K resamplings. The paired comparison of the arms uses the per-run means (the
`fid_protocol` metric of `uvic.compare.metrics`).

The protocol is that of FID while training (`uvic.training.evaluation.Evaluator`): N = `train.eval_num_images`
images of the run's sampling (EMA) weights at `train.max_steps` (what its `pipeline/` export holds), image i with
the task's conditions of image i (`Task.image_conditions("fid", N)`), scored against `train.eval_reference` with
the FID network of `train.eval_fid_weights` / `train.eval_fid_dims`, sampled with `train.eval_sampler` /
`train.eval_steps` (default: the sample section's). Resampling j uses the seeds `sample.seed + j * N + i`, i < N:
j = 0 is exactly the images of FID while training, and the K sets are disjoint. Every run of every arm draws the
same seeds (common random numbers); where the runs hold different numbers of resamplings, every run is paired on
the first k, the fewest any holds (`paired_resamplings`), so that every mean is over the same seeds. The
settings are each run's own config, with `overrides` of those keys (`FID_KEYS`, compare.py's `--fid KEY=VALUE`)
on top.

One process (the GPU, when there is one) or several (`accelerate launch compare.py report ...`) compute them.
On disk, per run: `fid_protocol.json` = {"protocol": {settings}, "fids": [FID of resampling 0, 1, ...], "network":
{the FID network's weights file, SHA-256, whether standard and trained, mode: `Evaluator.features`}}, rewritten
atomically after each FID, so a kill loses at most the one in progress and the same command continues. A file of
other settings is refused, naming the difference: two protocols' FIDs are never mixed, and none is overwritten.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uvic.compare.plan import Plan, Run
from uvic.compare.rundirs import read_attempts, run_state
from uvic.errors import ConfigError
from uvic.io import atomic_write


logger = logging.getLogger(__name__)

FILE = "fid_protocol.json"
# The report's metric of the per-run means (`uvic.compare.metrics.METRICS`).
METRIC = "fid_protocol"
# The run-config keys of the FID protocol, the keys `--fid` may set (train.eval_every, when to evaluate while
# training, is not one).
FID_KEYS = ("train.eval_num_images", "train.eval_reference", "train.eval_sampler", "train.eval_steps",
            "train.eval_fid_weights", "train.eval_fid_weights_sha256", "train.eval_fid_dims")


@dataclass(frozen=True)
class Protocol:
    """K resamplings of each finished run's FID, with `overrides` ("train.eval_*=VALUE") of its settings."""

    gen_seeds: int
    overrides: tuple[str, ...] = ()


def check_protocol(plan: Plan, protocol: Protocol) -> None:
    """Check, for every arm, what can be checked before training: the FID keys, the task (it must make images), and
    that the reference and the weights file exist.

    Raises:
        ConfigError: `gen_seeds` < 1, a key other than `FID_KEYS`, a bad value, a task without images, no reference.
        FileNotFoundError: the reference or the weights file does not exist.
    """
    check_fid_keys(protocol)
    from uvic.config import load_config

    for arm in plan.arm_names:
        try:
            cfg = load_config(plan.config, [*plan.run(arm, plan.seeds[0]).overrides, *protocol.overrides])
        except ConfigError as e:
            raise ConfigError(f"--fid, arm {arm!r}: {e}") from None
        _check_settings(cfg, f"arm {arm!r}")


def check_fid_keys(protocol: Protocol) -> None:
    """Raises ConfigError for `gen_seeds` < 1 or an override of a key other than `FID_KEYS`."""
    if protocol.gen_seeds < 1:
        raise ConfigError(f"--gen-seeds must be >= 1, got {protocol.gen_seeds}")
    for item in protocol.overrides:
        key = item.partition("=")[0].strip()
        if key not in FID_KEYS:
            raise ConfigError(f"--fid {item!r}: only the FID protocol's keys can be set here: {', '.join(FID_KEYS)}")


def _check_settings(cfg: Any, where: str) -> None:
    from uvic.fid.stats import is_stats_file
    from uvic.training.tasks import task_class

    if not task_class(cfg.task).makes_images:
        raise ConfigError(f"--gen-seeds: {where} trains a {cfg.task!r} model, which makes no images to compute a FID of")
    from uvic.fid.inception import DIMS

    tc = cfg.train
    if tc.eval_fid_dims not in DIMS:
        raise ConfigError(f"config key train.eval_fid_dims: {tc.eval_fid_dims} is not one of {list(DIMS)} (the "
                          f"FID-Inception feature layers) ({where})")
    ref = tc.eval_reference
    if not ref:
        raise ConfigError(f"--gen-seeds needs a FID reference: train.eval_reference in the config, or --fid "
                          f"train.eval_reference=REF (statistics .npz, an image folder or a dataset spec) ({where})")
    if str(ref).endswith(".npz") and not Path(ref).is_file():
        raise FileNotFoundError(f"the FID reference train.eval_reference={ref} does not exist ({where})")
    if not is_stats_file(ref):
        from uvic.fid import open_source

        open_source(ref)  # raises FileNotFoundError / ValueError naming the source
    if tc.eval_fid_weights and not Path(tc.eval_fid_weights).is_file():
        raise FileNotFoundError(f"the FID network's weights train.eval_fid_weights={tc.eval_fid_weights} do not "
                                f"exist ({where})")


def settings(cfg: Any) -> dict[str, Any]:
    """The protocol's settings of a run config, as `fid_protocol.json` records them."""
    tc, s = cfg.train, cfg.sample
    out = {"num_images": tc.eval_num_images, "reference": tc.eval_reference, "dims": tc.eval_fid_dims,
           "weights": tc.eval_fid_weights, "sampler": tc.eval_sampler or s.sampler,
           "steps": tc.eval_steps or s.num_inference_steps, "first_seed": s.seed, "step": tc.max_steps}
    return {**out, **_classifier_space(tc.eval_fid_weights)}


def _classifier_space(weights: str) -> dict[str, Any]:
    """A feature classifier's (`uvic.fid.classifier`) name and SHA-256, which its distances ("FD (Fashion-MNIST
    classifier)", not FIDs) are recorded with; {} for the Inception network (keeps older records valid)."""
    from uvic.fid.classifier import TITLES, is_classifier_file, read_classifier_meta
    from uvic.io import sha256_file

    if not is_classifier_file(weights or None) or not Path(weights).is_file():
        return {}
    return {"title": TITLES[read_classifier_meta(weights)["uvic_features"]], "weights_sha256": sha256_file(weights)}


def read_fids(run_dir: str | Path) -> list[float]:
    """The FIDs of a run's `fid_protocol.json` (resampling j at index j), [] without one or when it is not a
    record as `compute_protocol_fids` writes it (`read_record`)."""
    try:
        record = read_record(run_dir)
    except ValueError:
        return []
    return record[1] if record is not None else []


def read_record(run_dir: str | Path) -> tuple[dict[str, Any], list[float]] | None:
    """(settings, FIDs) of a run's `fid_protocol.json`, None without one.

    Raises:
        ValueError: it is not a record as `compute_protocol_fids` writes it: not JSON, no "protocol" mapping or
            "fids" list, or a FID that is not a finite number (e.g. the strings "nan" or "inf"); the message names
            the file and what is wrong.
    """
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{FILE} does not parse ({type(e).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("protocol"), dict) or not isinstance(data.get("fids"), list):
        raise ValueError(f"{FILE} is not a protocol-FID record (a 'protocol' mapping and a 'fids' list)")
    for j, value in enumerate(data["fids"]):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{FILE}: fids[{j}] is {value!r}, not a finite number")
    return data["protocol"], [float(v) for v in data["fids"]]


def record_exclusions(records: dict[Any, tuple[dict[str, Any], list[float]] | None | str],
                      max_steps: dict[Any, int]) -> dict[Any, str]:
    """{run: why} of the runs whose protocol FIDs cannot be paired with the others: no record or an unusable one
    (`records[run]`: `read_record`'s result, or its error message), one of another step than the run's last
    (`max_steps[run]`), or one of other settings than the record most runs hold (the first such in `records`'
    order on a tie): the FIDs of two protocols are never in one pairing."""
    out: dict[Any, str] = {}
    usable: dict[Any, dict[str, Any]] = {}
    for run, record in records.items():
        if isinstance(record, str):
            out[run] = record
        elif record is None:
            out[run] = f"{FILE} is missing"
        elif not record[1]:
            out[run] = f"{FILE} holds no FID"
        elif record[0].get("step") != max_steps[run]:
            out[run] = f"{FILE} is of step {record[0].get('step')!r}, not the run's last step {max_steps[run]}"
        else:
            usable[run] = {k: v for k, v in record[0].items() if k != "step"}
    keys = [json.dumps(v, sort_keys=True) for v in usable.values()]
    if keys:
        common = json.loads(max(keys, key=keys.count))
        count = keys.count(json.dumps(common, sort_keys=True))
        for run, settings_ in usable.items():
            differ = [k for k in sorted(set(common) | set(settings_)) if common.get(k) != settings_.get(k)]
            if differ:
                k = differ[0]
                out[run] = (f"{FILE} is of another protocol than the other {count} run(s)' ({k} is "
                            f"{settings_.get(k)!r} here, {common.get(k)!r} there)")
    return out


def paired_resamplings(records: dict[Any, tuple[dict[str, Any], list[float]] | None | str],
                       excluded: dict[Any, str]) -> dict[Any, list[float]]:
    """{run: its first k FIDs} of the runs of `records` (as `record_exclusions` takes them) that `excluded`
    (`record_exclusions`' result) does not name, k the fewest FIDs any of them holds.

    Resampling j of every run of one protocol scores the images of the same sampling seeds (`sample.seed + j * N +
    i`), so every run's mean is then over the same seeds: a run computed K = 3 times is never paired by its mean of
    3 with another's mean of 2 (a report killed during the third FIDs, `--gen-seeds` raised for some runs only).
    The later FIDs are left out, not the run; a run left out (`excluded`) does not lower k."""
    usable = {run: record[1] for run, record in records.items()
              if run not in excluded and isinstance(record, tuple)}
    k = min((len(fids) for fids in usable.values()), default=0)
    return {run: fids[:k] for run, fids in usable.items()}


def _recorded(path: Path, expected: dict[str, Any]) -> list[float]:
    """The FIDs recorded at `path` for the settings `expected`; [] without a file.

    Raises:
        ConfigError: the file holds FIDs of other settings, or does not parse.
    """
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        recorded, fids = data["protocol"], [float(v) for v in data["fids"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a protocol-FID record ({type(e).__name__}: {e}); move it away") from None
    for key in sorted(set(expected) | set(recorded)):
        if recorded.get(key) != expected.get(key):
            raise ConfigError(f"{path} holds FIDs of another protocol ({key} is {recorded.get(key)!r} there, "
                              f"{expected.get(key)!r} here); it is not overwritten: move it away, or compute with "
                              f"the same settings")
    return fids


def compute_protocol_fids(plan: Plan, protocol: Protocol) -> list[Run]:
    """Compute the missing resamplings of every finished run (up to `protocol.gen_seeds` each, in plan order);
    returns the runs that got new FIDs. Unfinished runs are left alone (the report names them).

    Under `accelerate launch`, every process calls this: each FID's images are split across the processes (the
    numbers do not depend on their count) and the main process writes the files.

    Raises:
        ConfigError: a run's settings fail to load, or its `fid_protocol.json` is of other settings.
        FileNotFoundError / ValueError: the reference or the FID network cannot be used (see `Evaluator`).
    """
    from accelerate import PartialState

    from uvic.config import load_config
    from uvic.training.checkpoint import checkpoint_dir
    from uvic.training.evaluation import Evaluator
    from uvic.training.runs import task_from_checkpoint

    attempts = read_attempts(plan.out)
    state = PartialState()
    evaluators: dict[str, Evaluator] = {}  # one per arm: the reference statistics and the network, loaded once
    computed = []
    for run in plan.runs:
        if run_state(plan, run, attempts).state != "finished":
            continue
        try:
            cfg = load_config(run.run_dir / "config.yaml", protocol.overrides)
        except ConfigError as e:
            raise ConfigError(f"--fid, {run.label}: {e}") from None
        expected = settings(cfg)
        path = run.run_dir / FILE
        fids = _recorded(path, expected)
        if len(fids) >= protocol.gen_seeds:
            continue
        _check_settings(cfg, run.label)
        task, model, _ = task_from_checkpoint(checkpoint_dir(run.run_dir, cfg.train.max_steps))
        if run.arm not in evaluators:
            evaluators[run.arm] = Evaluator(cfg, task, state)
        evaluator, n = evaluators[run.arm], cfg.train.eval_num_images
        # the features' own width: the protocol's "dims" is train.eval_fid_dims, which a classifier ignores
        network = {**evaluator.features(), "dims": evaluator.dims}
        for j in range(len(fids), protocol.gen_seeds):
            fids.append(evaluator.fid(model, first_seed=cfg.sample.seed + j * n))
            if state.is_main_process:  # every process has read the file: the FID above was a collective
                with atomic_write(path, "w") as f:
                    json.dump({"protocol": expected, "fids": fids, "network": network}, f, indent=1)
                name = f"fid{n}" if evaluator.title == "FID" else f"{evaluator.title} fd{n}"
                logger.info(f"{run.label}: {name} of resampling {j + 1}/{protocol.gen_seeds} = {fids[-1]:.4f}")
        computed.append(run)
    return computed
