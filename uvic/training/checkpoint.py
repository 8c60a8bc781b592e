"""Checkpoints: atomic, verified save; rotation; discovery; resume. Task-agnostic (diffusion and LM runs share it).

Layout of one checkpoint, `run_dir/checkpoints/step_000001000/`:
    model.safetensors       the trained model (safetensors)
    optimizer.bin           the optimizer's state dict (tensors and plain data)
    training_state.pt       the accelerator's step counter, the fp16 loss scaler, and the registered objects (LR
                            schedule, the run's sharded generator), as tensors and plain data
    random_states_{rank}.pt each process's Python, NumPy, torch and CUDA generator states
    {name}.safetensors      extra models such as the EMA weights
    config.yaml             the resolved config of the run
    meta.json               {"step": ..., "sha256": {file: hex digest}}; written last

Nothing in a checkpoint is unpickled in full: the `.pt` / `.bin` files are read with `torch.load(weights_only=True)`
(`uvic.io.load_torch_data`), which builds tensors and plain containers only, so a checkpoint someone else wrote
cannot run code when it is resumed, exported or sampled (docs/security.md). accelerate's `save_state` /
`load_state` are not used: they pickle the registered objects and the RNG states.

A checkpoint is written into `.tmp-step_...-{pid}/` (the launch's main-process PID, so that two writers never share
a temporary dir), fsync'd, and renamed into place when complete, so a crash during a save leaves the previous
checkpoints untouched and the partial directory is never picked up. Re-saving a step renames the old copy aside
(`.old-step_...`), renames the new one in, and only then deletes the old one. A directory is deleted by renaming it
to `.deleting-...` first, so a kill during the deletion never leaves a half-deleted `step_*`; `sweep_leftovers`
(called at the start of a run, under the run-dir lock) removes what such interruptions leave behind. A symlink in
`checkpoints/` is removed as a link, never followed.

`meta.json` records the SHA-256 of every other file. `verify_checkpoint` checks them, and that the recorded step is
the one in the directory name, before a checkpoint is resumed or exported: a mismatch (or a `meta.json` without
hashes) is a `CheckpointError` naming the file and the newest checkpoint of the run that verifies.

A write that fails (disk full, read-only file system, a file where a directory should be) removes the partial
checkpoint and raises `StorageError`, which says what failed and names the last complete checkpoint.

Resuming from a checkpoint older than the run's newest (`abandon_newer_checkpoints`) moves the newer ones to
`checkpoints/abandoned/after_step_.../`: the resumed run is a new branch, and rotation and `--resume latest` must
only ever see that branch, while the abandoned one stays on disk.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from uvic.errors import CheckpointError, StorageError, describe_os_error
from uvic.io import fsync_dir, fsync_tree, load_torch_data, sha256_file


logger = logging.getLogger(__name__)
T = TypeVar("T")

_NAME = re.compile(r"^step_(\d+)$")
META = "meta.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.bin"
TRAINING_STATE = "training_state.pt"
# Signs that an exception from a serializer (torch.save, safetensors) is a failed write, not a bug.
_WRITE_FAILURE = re.compile(r"basic_ios|file write failed|No space left|Read-only file system|Permission denied|"
                            r"Os \{ code|Not a directory|Disk quota", re.IGNORECASE)


_WRITE_REASONS = [(r"No space left|os error 28", "disk full"), (r"Disk quota", "disk quota exceeded"),
                  (r"Read-only file system|os error 30", "read-only file system"),
                  (r"Permission denied|os error 13", "permission denied"), (r"Not a directory", "not a directory")]


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """The directory of the checkpoint of `step`: `run_dir/checkpoints/step_{step:09d}` (`run_dir="."`: the name
    relative to a run dir, as eval.jsonl records it)."""
    return checkpoints_dir(run_dir) / f"step_{step:09d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first. Temporary and partial dirs are ignored."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / META).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def unverifiable_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The `step_*` dirs of a run without `meta.json`, as (step, path), oldest first.

    uvic never leaves one (a checkpoint is renamed into place with its meta.json), so such a dir is a checkpoint
    whose meta.json was lost or removed by hand: it cannot be verified, so it is never resumed or exported, and
    never deleted either (`sweep_leftovers` leaves it; `abandon_newer_checkpoints` and a save of its step move it
    aside). Whoever passes over it names it (`passed_over`).
    """
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := _NAME.match(p.name)) and not (p / META).is_file())


def passed_over(run_dir: str | Path, chosen: Path | None) -> list[Path]:
    """The checkpoint dirs without meta.json newer than `chosen` (all of them when None) that a choice of the
    run's latest checkpoint skips, each named in a warning."""
    step = -1 if chosen is None else int(_NAME.match(Path(chosen).name).group(1))
    skipped = [p for s, p in unverifiable_checkpoints(run_dir) if s > step]
    for p in skipped:
        logger.warning("%s has no %s (lost or removed?): it cannot be verified, so it is skipped, and kept; using %s",
                       p, META, chosen or "no checkpoint")
    return skipped


def choose_latest(run_dir: str | Path) -> Path | None:
    """`latest_checkpoint`, warning about each newer checkpoint dir without meta.json it passes over."""
    chosen = latest_checkpoint(run_dir)
    passed_over(run_dir, chosen)
    return chosen


def resolve_checkpoint(path: str | Path, *, verify: bool = True) -> Path:
    """A checkpoint dir from a checkpoint path or a run dir (its latest checkpoint), verified unless `verify=False`.

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: the checkpoint fails `verify_checkpoint`.
    """
    path = Path(path)
    if not (path / META).is_file():
        latest = choose_latest(path) if not _NAME.match(path.name) else None
        if latest is None:
            raise FileNotFoundError(f"no checkpoint at {path} (expected a step_* dir with meta.json, or a run dir "
                                    f"with checkpoints/step_*/)")
        path = latest
    if verify:
        verify_checkpoint(path)
    return path


def read_checkpoint(path: str | Path, read: Callable[[Path], T], attempts: int = 10) -> T:
    """`read(ckpt)` on the verified checkpoint `path` names: a checkpoint dir, or a run dir's newest checkpoint.

    A live run may rotate a run dir's checkpoint away between choosing it and reading it. When a read fails and
    the checkpoint dir is gone (or was replaced by a re-save), the choice is made again from what the run holds
    now, up to `attempts` times; a checkpoint that is still there and fails is reported as it is.

    Raises:
        FileNotFoundError: no checkpoint there. CheckpointError: the chosen checkpoint fails verification.
        Whatever `read` raises for a checkpoint that stays in place.
    """
    path = Path(path)
    run_dir = path.is_dir() and not (path / META).is_file()
    for _ in range(attempts - 1 if run_dir else 0):
        ckpt, identity = resolve_checkpoint(path, verify=False), None
        try:
            identity = ckpt.stat().st_ino
            verify_checkpoint(ckpt)
            return read(ckpt)
        except (OSError, ValueError):
            try:
                raced = ckpt.stat().st_ino != identity
            except OSError:
                raced = True
            if not raced:
                raise
            logger.info("%s was removed while it was read (a live run rotated it): choosing again", ckpt)
    return read(resolve_checkpoint(path))  # a checkpoint dir, or the last attempt


# ---------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------


def _file_hashes(ckpt: Path) -> dict[str, str]:
    return {p.relative_to(ckpt).as_posix(): sha256_file(p)
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != META}


def _problem(path: Path) -> tuple[int | None, str | None]:
    """(step, None) when `path` verifies, else (step or None, what is wrong)."""
    meta_file = path / META
    if not meta_file.is_file():
        return None, f"{path} is not a complete checkpoint (no {META})"
    try:
        meta = json.loads(meta_file.read_text())
        step = int(meta["step"])
        hashes = meta.get("sha256")
        if hashes is not None and not isinstance(hashes, dict):
            raise TypeError("'sha256' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{meta_file} is unreadable ({type(e).__name__}: {e})"
    m = _NAME.match(path.name)
    if m and int(m.group(1)) != step:
        return step, f"{meta_file} records step {step}, but the directory is {path.name}"
    if not hashes:
        return step, f"{meta_file} records no SHA-256 hashes, so its files cannot be checked"
    for name, want in hashes.items():
        f = path / name
        if not f.is_file():
            return step, f"{f} is missing"
        if sha256_file(f) != want:
            return step, f"{f} is corrupted (its SHA-256 differs from the one recorded when it was saved)"
    return step, None


def newest_verified_checkpoint(run_dir: str | Path, exclude: Path | None = None) -> Path | None:
    """The newest checkpoint of `run_dir` that passes `verify_checkpoint` (skipping `exclude`), or None."""
    for _, p in reversed(list_checkpoints(run_dir)):
        if p != exclude and _problem(p)[1] is None:
            return p
    return None


def verify_checkpoint(path: str | Path) -> int:
    """Check a checkpoint against its `meta.json`: every file's SHA-256, and the step against the dir name.

    Returns:
        The step.
    Raises:
        CheckpointError: the first problem found, and the newest checkpoint of the same run that verifies.
    """
    path = Path(path)
    step, problem = _problem(path)
    if problem is None:
        return step
    hint = ""
    if path.parent.name == "checkpoints":
        good = newest_verified_checkpoint(path.parent.parent, exclude=path)
        hint = (f"; the newest checkpoint of this run that verifies is {good} (use that path instead, e.g. with --resume)"
                if good else "; no other checkpoint of this run verifies")
    raise CheckpointError(f"checkpoint {path} failed verification: {problem}{hint}")


# ---------------------------------------------------------------------------------------------------------
# Saving, rotation and clean-up
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TrainingState:
    """What a checkpoint saves and restores besides the extra models.

    Attributes:
        model: the trained model (as prepared by accelerate), saved as `model.safetensors`.
        optimizer: its optimizer, saved as `optimizer.bin`.
        objects: named objects with `state_dict()` / `load_state_dict()` whose state is tensors and plain data
            (the LR schedule, the run's `ShardedRNG`), saved in `training_state.pt`.
    """

    model: nn.Module | None = None
    optimizer: Any = None
    objects: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(
    accelerator: Accelerator,
    run_dir: str | Path,
    step: int,
    config: dict[str, Any],
    extra_models: dict[str, nn.Module] | None = None,
    keep: int = 3,
    *,
    state: TrainingState | None = None,
    keep_also: Path | None = None,
) -> Path:
    """Save `state`, the RNG states and `extra_models` atomically as `checkpoint_dir(run_dir, step)`; keep the last
    `keep`, and `keep_also` whatever its age (the best FID's checkpoint, which `best.json` names).

    Call on every process (each writes its own RNG states). Returns the checkpoint path.

    Raises:
        StorageError: a write failed on some process (disk full, read-only, not a directory); the partial
            checkpoint is removed and every process raises, naming the last complete checkpoint.
    """
    from accelerate.utils import broadcast_object_list

    root = checkpoints_dir(run_dir)
    final = checkpoint_dir(run_dir, step)
    # One name per launch: the main process's PID, the same on every process of the launch.
    pid = broadcast_object_list([os.getpid()])[0] if accelerator.num_processes > 1 else os.getpid()
    tmp = root / f".tmp-{final.name}-{pid}"
    main = accelerator.is_main_process

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            remove_dir(tmp)

    def finish() -> None:
        for name, model in (extra_models or {}).items():
            state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            save_file(state, str(tmp / f"{name}.safetensors"))
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (tmp / META).write_text(json.dumps({"step": step, "sha256": _file_hashes(tmp)}))
        fsync_tree(tmp)  # every file on disk before the rename makes the checkpoint visible
        if final.is_dir() and not (final / META).is_file():  # not a checkpoint uvic wrote: set aside, not replaced
            _set_aside(run_dir, step - 1, [final], f"saving step {step}, {final} has no {META} (uvic did not write it)")
        _move_into_place(tmp, final)
        fsync_dir(root)

    # Each phase ends with every process learning whether any failed, so that all stop together.
    failure = agree(accelerator, _attempt(prepare, root) if main else None)
    if failure is None:
        failure = agree(accelerator, _attempt(lambda: _save_state(accelerator, state or TrainingState(), tmp), root))
    if failure is None:
        failure = agree(accelerator, _attempt(finish, root) if main else None)
    if failure is not None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(run_dir) if root.is_dir() else None
        raise StorageError(f"could not save checkpoint {final}: {failure}. The partial checkpoint was removed; "
                           f"the last complete checkpoint is {last or 'none'}")
    # Rotation. The new checkpoint is complete: an old one that cannot be deleted is reported, not fatal.
    if main:
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            if keep_also is not None and old.resolve() == Path(keep_also).resolve():
                continue
            try:
                remove_dir(old)
            except OSError as e:
                logger.warning("could not delete the old checkpoint %s: %s", old, describe_os_error(e))
    accelerator.wait_for_everyone()
    return final


def _save_state(accelerator: Accelerator, state: TrainingState, out: Path) -> None:
    """Write `state` (main process) and this process's RNG states into the checkpoint dir `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        if state.model is not None:
            save_model(accelerator.unwrap_model(state.model), str(out / MODEL))  # shared tensors stored once
        if state.optimizer is not None:
            torch.save(state.optimizer.state_dict(), out / OPTIMIZER)
        scaler = getattr(accelerator, "scaler", None)
        torch.save({"accelerator_step": int(accelerator.step),
                    "scaler": None if scaler is None else scaler.state_dict(),
                    "objects": {name: obj.state_dict() for name, obj in state.objects.items()}},
                   out / TRAINING_STATE)
    torch.save(_rng_states(), out / f"random_states_{accelerator.process_index}.pt")


def _rng_states() -> dict[str, Any]:
    """The global generators' states as tensors and plain data (what accelerate's `save_state` pickles)."""
    _, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_states(states: dict[str, Any]) -> None:
    version, internal, gauss_next = states["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss_next))
    numpy_state = states["numpy"]
    np.random.set_state(("MT19937", numpy_state["key"].numpy().astype(np.uint32), int(numpy_state["pos"]),
                         int(numpy_state["has_gauss"]), float(numpy_state["cached_gaussian"])))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])


def _load_state(accelerator: Accelerator, state: TrainingState, path: Path) -> None:
    """Restore what `_save_state` wrote; every file is read with `torch.load(weights_only=True)` or safetensors."""
    if not (path / TRAINING_STATE).is_file():
        pickles = sorted(p.name for p in path.glob("*.pkl"))
        raise FileNotFoundError(f"{path / TRAINING_STATE} is missing" + (
            f" (the checkpoint holds {', '.join(pickles)}: pickled training state, which uvic never loads because "
            f"unpickling can run code; its weights can still be exported or sampled)" if pickles else ""))
    if state.model is not None:
        load_model(accelerator.unwrap_model(state.model), path / MODEL, strict=True)
    if state.optimizer is not None:
        state.optimizer.load_state_dict(load_torch_data(path / OPTIMIZER, what="optimizer state"))
    saved = load_torch_data(path / TRAINING_STATE, what="training state")
    accelerator.step = int(saved["accelerator_step"])
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and saved["scaler"] is not None:
        scaler.load_state_dict(saved["scaler"])
    for name, obj in state.objects.items():
        obj.load_state_dict(saved["objects"][name])
    rng_file = path / f"random_states_{accelerator.process_index}.pt"
    if rng_file.is_file():
        _set_rng_states(load_torch_data(rng_file, what="random states"))
    else:  # resumed on more processes than saved it; the run's own generator (`objects`) is restored regardless
        logger.warning("%s has no %s: process %d's global generators (dropout, data-loader workers) start from the "
                       "seed instead", path, rng_file.name, accelerator.process_index)


def _attempt(fn: Callable[[], Any], where: Path) -> str | None:
    """Run `fn`; None if it worked, else what failed when it is a failed write (anything else is re-raised)."""
    try:
        fn()
        return None
    except OSError as e:
        return describe_os_error(e)
    except Exception as e:  # noqa: BLE001 - torch.save / safetensors report a failed write in their own types
        # torch.save on a full disk raises "basic_ios::clear", and then, from its zip writer's __exit__, an
        # "unexpected pos" assertion whose context is that error: the sign of a failed write may sit down the chain.
        chain, link = [], e
        while link is not None and len(chain) < 8:
            chain.append(link)
            link = link.__cause__ or link.__context__
        os_error = next((c for c in chain if isinstance(c, OSError) and c.errno is not None), None)
        if os_error is not None:
            return describe_os_error(os_error)
        cause = next((c for c in chain if _WRITE_FAILURE.search(" ".join(str(c).split()))), None)
        if cause is None:
            raise
        text = " ".join(str(cause).split())
        try:
            free_mib = shutil.disk_usage(where).free / 2**20
        except OSError:
            free_mib = None
        reason = next((r for pattern, r in _WRITE_REASONS if re.search(pattern, text, re.IGNORECASE)), None)
        if reason is None and free_mib is not None and free_mib < 1:
            reason = "write failed, probably disk full"
        free = "" if free_mib is None else f"; {free_mib:.1f} MiB free there"
        return f"{reason or 'write failed'} ({type(cause).__name__}: {text}{free})"


def agree(accelerator: Accelerator, failure: str | None) -> str | None:
    """The first failure of any process (a collective: every process must call it)."""
    if accelerator.num_processes == 1:
        return failure
    from accelerate.utils import gather_object

    return next((f"process {i}: {f}" for i, f in enumerate(gather_object([failure])) if f is not None), None)


def remove_dir(path: Path) -> None:
    """Delete a directory by renaming it to `.deleting-{name}-{pid}` first, so that a kill midway never leaves a
    half-deleted directory under a name that is read (the `.deleting-` leftover is swept at the next start).
    A symlink is unlinked, never followed: what it points to is not the run's to delete."""
    if path.is_symlink():
        path.unlink()
        return
    doomed = path.with_name(f".deleting-{path.name}-{os.getpid()}")
    if doomed.is_symlink():
        doomed.unlink()
    elif doomed.exists():  # left by an earlier process that had the same PID
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _move_into_place(new: Path, final: Path) -> None:
    """Rename `new` to `final`; an existing `final` (the same step saved again, e.g. the final save after a periodic
    one) is renamed aside first and deleted last, so a crash never leaves the step without a complete copy."""
    old = final.with_name(f".old-{final.name}")
    if old.exists():
        remove_dir(old)  # a leftover from a crashed replacement
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    if old.exists():
        remove_dir(old)


def write_dir_atomically(out_dir: str | Path, write: Callable[[Path], Any], what: str = "the pipeline") -> Path:
    """Run `write(tmp)` on a fresh `.tmp-{name}-{pid}` next to `out_dir`, then rename it into place (an existing
    `out_dir` is replaced only once the new one is complete). Returns `out_dir`.

    Raises:
        StorageError: a write failed (disk full, read-only, a file in the way): the partial directory is removed
            and `out_dir`, if it existed, is left as it was.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise StorageError(f"could not write {what} to {out_dir}: a file is in the way (it is not a directory); "
                           f"nothing was written")
    tmp = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")

    def attempt() -> None:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_writers_leftovers(out_dir)
        if tmp.exists():
            remove_dir(tmp)
        write(tmp)
        fsync_tree(tmp)
        _move_into_place(tmp, out_dir)
        fsync_dir(out_dir.parent)

    failure = _attempt(attempt, out_dir.parent if out_dir.parent.is_dir() else Path("."))
    if failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "left as it was" if out_dir.exists() else "not written"
        raise StorageError(f"could not write {what} to {out_dir}: {failure}; the partial copy was removed and "
                           f"{out_dir} is {kept}")
    return out_dir


def _remove_dead_writers_leftovers(out_dir: Path) -> None:
    """Remove the `.tmp-{name}-{pid}` / `.deleting-{name}-{pid}` dirs next to `out_dir` whose process is gone (a
    killed export); those of a live process are another writer's work in progress and are left alone."""
    for p in out_dir.parent.glob(f".*-{out_dir.name}-*"):
        prefix, _, pid = p.name.rpartition("-")
        if prefix not in (f".tmp-{out_dir.name}", f".deleting-{out_dir.name}") or not pid.isdigit() or not p.is_dir():
            continue
        if p.is_symlink():
            p.unlink()
            continue
        try:
            os.kill(int(pid), 0)  # no error: the writer is alive
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except OSError:  # alive, another user's process
            pass


def sweep_leftovers(run_dir: str | Path) -> list[str]:
    """Remove what interrupted saves and deletions left in `run_dir/checkpoints`; returns the names handled.

    Call on the main process while holding the run-dir lock (nothing else may be writing). Removed: `.tmp-*`
    (partial saves) and `.deleting-*` (interrupted deletions), the names uvic writes only while it saves or deletes.
    A `.old-step_N` whose `step_N` is missing (a kill between the two renames of a re-save) is the complete copy of
    that step: it is renamed back, otherwise removed. Symlinks among them are unlinked, never followed. A `step_*`
    dir without `meta.json` is never removed (`unverifiable_checkpoints`): it is named in a warning.
    """
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    handled = []
    for p in sorted(root.iterdir()):
        if p.is_symlink() and p.name.startswith((".deleting-", ".tmp-", ".old-")):
            p.unlink()  # a link, never followed
        elif not p.is_dir():
            continue
        elif p.name.startswith(".deleting-"):
            shutil.rmtree(p)
        elif p.name.startswith(".tmp-"):
            remove_dir(p)
        elif p.name.startswith(".old-"):
            final = root / p.name[len(".old-"):]
            if (p / META).is_file() and not (final / META).is_file() and not p.is_symlink():
                if final.exists():  # a step dir without meta.json: not ours to delete
                    logger.warning("%s has no %s and %s holds a complete copy of that step: both are kept, "
                                   "move one away", final, META, p.name)
                    continue
                os.replace(p, final)
                logger.warning("restored %s from %s (a re-save of that step was interrupted)", final, p.name)
            else:
                remove_dir(p)
        else:
            continue
        handled.append(p.name)
    if handled:
        logger.info("removed leftovers of interrupted saves/deletions in %s: %s", root, ", ".join(handled))
    for _, p in unverifiable_checkpoints(run_dir):
        logger.warning("%s has no %s (lost or removed?): it cannot be verified, so it is not resumed or exported; "
                       "it is kept", p, META)
    return handled


def abandon_newer_checkpoints(run_dir: str | Path, step: int) -> Path | None:
    """Move the checkpoints of `run_dir` newer than `step` to `checkpoints/abandoned/after_step_{step}_{time}/`.

    Call on the main process when a run resumes from `step` while newer checkpoints exist: training continues
    from `step` as a new branch, so the newer ones must not be rotated in step order with it or picked up by a
    later `--resume latest`. Newer step dirs without meta.json (`unverifiable_checkpoints`) go with them, so that
    no save of the new branch replaces one. Nothing is deleted. Returns the folder they went to, or None when there
    were none.
    """
    newer = [p for s, p in sorted(list_checkpoints(run_dir) + unverifiable_checkpoints(run_dir)) if s > step]
    if not newer:
        return None
    return _set_aside(run_dir, step, newer, f"resuming from step {step} of {run_dir}")


def _set_aside(run_dir: str | Path, step: int, newer: list[Path], why: str) -> Path:
    """Move the checkpoint dirs `newer` to a new `checkpoints/abandoned/after_step_{step}_{time}/`; returns it."""
    base = checkpoints_dir(run_dir) / "abandoned" / f"after_step_{step:09d}_{time.strftime('%Y%m%d-%H%M%S')}"
    dest, i = base, 1
    while dest.exists():
        dest, i = base.with_name(f"{base.name}-{i}"), i + 1
    dest.mkdir(parents=True)
    for p in newer:
        os.replace(p, dest / p.name)
    logger.warning("%s: moved the %d newer checkpoint(s) %s to %s", why, len(newer), ", ".join(p.name for p in newer),
                   dest)
    return dest


def load_checkpoint(
    accelerator: Accelerator,
    path: str | Path,
    extra_models: dict[str, nn.Module] | None = None,
    *,
    state: TrainingState | None = None,
) -> int:
    """Restore what `save_checkpoint` wrote into `state` (prepared objects) and `extra_models`; returns the step.

    Nothing is unpickled in full: safetensors and `torch.load(weights_only=True)` only.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint.
        CheckpointError (a ValueError): it fails `verify_checkpoint`, or a file in it cannot be read, holds
            anything but tensors and plain data, or is from a different model.
    """
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META})")
    step = verify_checkpoint(path)
    try:
        _load_state(accelerator, state or TrainingState(), path)
        for name, model in (extra_models or {}).items():
            model.load_state_dict(load_file(str(path / f"{name}.safetensors")))
    except Exception as e:  # noqa: BLE001 - any failure here means "this checkpoint cannot be resumed"
        raise CheckpointError(f"checkpoint {path} is unreadable or does not match this run: "
                              f"{type(e).__name__}: {' '.join(str(e).split())}") from e
    logger.info("resumed from %s at step %d", path, step)
    return step


def read_checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The resolved config dict stored in a checkpoint."""
    path = Path(path)
    try:
        return yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the config of checkpoint {path}: {' '.join(str(e).split())}") from e


def load_model_weights(model: nn.Module, path: str | Path, name: str) -> nn.Module:
    """Load `{name}.safetensors` of a checkpoint into `model` (strict). Raises ValueError when unreadable."""
    file = Path(path) / f"{name}.safetensors"
    try:
        model.load_state_dict(load_file(str(file)))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load {file}: {type(e).__name__}: {e}") from e
    return model
