"""Checkpoints that are complete or never resumed from.

Transformers' Trainer writes a checkpoint file by file into `checkpoint-N` and then deletes older ones
(`save_total_limit`): a run killed, preempted or out of disk mid-save leaves a `checkpoint-N` without some files,
and may already have deleted the last good one; resuming it restarts the optimizer or the prompt stream without a
word. Here a checkpoint is complete once `dapo_checkpoint.json` is in it: written last, by the main process, after
every process has written its files, listing each file and its size. Older checkpoints are rotated away only after
that. A resume accepts only a complete checkpoint whose listed files are all there, and `latest` (or `true`) picks
the newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPLETE_FILE = "dapo_checkpoint.json"
LATEST = ("latest", "true")  # --resume_from_checkpoint values that mean "the newest complete one, if any"
_STEP = re.compile(r"^checkpoint-(\d+)$")


class IncompleteCheckpointError(ValueError):
    """A checkpoint a resume cannot restore exactly; the message names what is missing and what to use instead."""


def mark_complete(folder: str | Path) -> None:
    """Record `folder` as complete: every file under it with its size, written atomically (the last write)."""
    folder = Path(folder)
    files = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != COMPLETE_FILE
    }
    temporary = folder / f".{COMPLETE_FILE}.tmp"
    with open(temporary, "w") as handle:
        json.dump({"files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, folder / COMPLETE_FILE)


def problems(folder: str | Path) -> list[str]:
    """Why `folder` cannot be resumed from (empty when it can): no completion record, or listed files missing or
    of another size."""
    folder = Path(folder)
    record = folder / COMPLETE_FILE
    if not record.is_file():
        return [f"{COMPLETE_FILE} is missing (the save was interrupted, or an older dapo-trl wrote it)"]
    try:
        files = json.loads(record.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return [f"{COMPLETE_FILE} is unreadable ({exc})"]
    found = []
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != size:
            found.append(f"{name} has {path.stat().st_size} bytes, {size} when saved")
    return found


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete `checkpoint-N` folders of `output_dir`, oldest step first."""
    if not Path(output_dir).is_dir():
        return []
    steps = [(int(m.group(1)), path) for path in Path(output_dir).iterdir() if (m := _STEP.match(path.name))]
    return [path for _, path in sorted(steps) if path.is_dir() and not problems(path)]


def resolve_resume(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder to resume from: `latest` / `true` -> the newest complete one in `output_dir` (None, a
    fresh start, when there is none, so that one command can be requeued forever); a path -> that folder, if
    complete; None / False -> None."""
    if value is None or value is False:
        return None
    if value is True or str(value).lower() in LATEST:
        newest = complete_checkpoints(output_dir)
        if not newest:
            logger.info("resume_from_checkpoint=%s: no complete checkpoint in %s, starting fresh", value, output_dir)
            return None
        logger.info("resuming from the newest complete checkpoint, %s", newest[-1])
        return str(newest[-1])
    found = problems(value) if Path(value).is_dir() else ["not a directory"]
    if not found:
        return str(value)
    newest = complete_checkpoints(output_dir)  # read only to say what to use instead
    instead = (
        f"Resume from {newest[-1]}, the newest complete checkpoint (--resume_from_checkpoint latest picks it)."
        if newest
        else f"There is no complete checkpoint in {output_dir}: start fresh, or pass --resume_from_checkpoint latest."
    )
    raise IncompleteCheckpointError(f"cannot resume exactly from {value}: {'; '.join(found[:5])}. {instead}")


def rotate(run_dir: str | Path, save_total_limit: int | None, best: str | None) -> None:
    """Trainer's own rotation (`save_total_limit`, the best checkpoint kept), run once the newest is complete."""
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(str(run_dir), save_total_limit, best, use_mtime=True)


def save_failure(folder: str | Path, error: BaseException) -> OSError:
    """A checkpoint write that failed, said with the disk it was writing to and the space left there (a full disk
    surfaces from torch.save as `unexpected pos`)."""
    try:
        usage = shutil.disk_usage(Path(folder).parent)
        space = f"{usage.free / 2**30:.2f} GiB free of {usage.total / 2**30:.1f} GiB"
    except OSError:
        space = "free space unknown"
    return OSError(
        f"writing checkpoint {folder} failed: {type(error).__name__}: {error}. That disk has {space}. The checkpoint "
        "stays incomplete (never resumed from); the previous complete one is kept."
    )


@contextlib.contextmanager
def cpu_loads_unindexed(device: torch.device) -> Iterator[None]:
    """transformers before 5.2x loads the optimizer state with map_location=args.device when several processes run,
    which on CPU is "cpu:0", a location torch cannot restore storages to: while this is open (and `device` is such
    an indexed CPU device), a torch.load mapped to a CPU device maps to "cpu"."""
    if device.type != "cpu" or device.index is None:
        yield
        return
    load = torch.load

    def load_on_cpu(*args: Any, map_location: Any = None, **kwargs: Any) -> Any:
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = load_on_cpu
    try:
        yield
    finally:
        torch.load = load


def process_file(stem: str, index: int) -> str:
    """The file of process `index`'s own part of the run state (`stem`: its name without suffix)."""
    return f"{stem}_rank{index}.pt"


@contextlib.contextmanager
def complete_save(
    trainer: Any,
    folder: str,
    run_state: Callable[[], dict[str, Any]],
    save_more: Callable[[str], None],
    process_state: Callable[[], dict[str, Any]] = dict,
):
    """Around Trainer's `_save_checkpoint`: then the run state beyond it (`run_state()`: {file: part with a
    state_dict}) and `save_more(folder)` on the main process, and every process's own state (`process_state()`:
    {stem: part}, one file per process); once every process is done, the completion record, and only then the
    rotation of older checkpoints (Trainer's own rotation is held off while this is open)."""
    args = trainer.args
    limit, args.save_total_limit = args.save_total_limit, None  # Trainer would rotate before the record is written
    accelerator = trainer.accelerator
    try:
        yield
        for stem, part in process_state().items():
            state = {"processes": accelerator.num_processes, "state": part.state_dict()}
            torch.save(state, os.path.join(folder, process_file(stem, accelerator.process_index)))
        if args.should_save:
            for file, part in run_state().items():
                torch.save(part.state_dict(), os.path.join(folder, file))
            save_more(folder)
    except (OSError, RuntimeError) as exc:
        raise save_failure(folder, exc) from exc
    finally:
        args.save_total_limit = limit
    trainer.accelerator.wait_for_everyone()  # every process's files (shards, RNG states) are written
    if args.should_save:
        mark_complete(folder)
        rotate(os.path.dirname(folder), limit, trainer.state.best_model_checkpoint)


def load_run_state(checkpoint: str, run_state: dict[str, Any], device: Any) -> None:
    """Restore each part of `run_state` ({file: part with load_state_dict(state, device)}) from `checkpoint`."""
    for file, part in run_state.items():
        if not os.path.exists(path := os.path.join(checkpoint, file)):
            raise IncompleteCheckpointError(
                f"{checkpoint} has no {file}, which this run's settings need to resume exactly (it was saved "
                "with dynamic sampling, streaming or KL in the reward set otherwise): resume with the settings "
                "it was saved with."
            )
        part.load_state_dict(torch.load(path, map_location="cpu"), device)


def load_process_state(checkpoint: str, parts: dict[str, Any], index: int, processes: int, device: Any) -> None:
    """Restore each of this process's parts ({stem: part}) from `checkpoint`'s file for process `index`. A part
    saved by another number of processes is restored only where it holds nothing process-specific (its
    `needs_same_processes(state)` is false); a checkpoint written before these files existed restores nothing."""
    for stem, part in parts.items():
        own, first = (os.path.join(checkpoint, process_file(stem, rank)) for rank in (index, 0))
        path = own if os.path.exists(own) else first
        if not os.path.exists(path):
            continue
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved["processes"] != processes and part.needs_same_processes(saved["state"]):
            because = getattr(part, "same_processes_because", None)
            if because is not None:
                raise IncompleteCheckpointError(
                    f"{checkpoint} was saved by {saved['processes']} processes and {because}; this run has "
                    f"{processes}: resume with {saved['processes']} processes."
                )
            raise IncompleteCheckpointError(
                f"{checkpoint} was saved by {saved['processes']} processes in the middle of a generation batch, "
                f"whose rows are split between them; this run has {processes}: resume with "
                f"{saved['processes']} processes, or from a checkpoint saved at a generation batch's end (save_steps "
                "a multiple of the optimizer steps per generation batch)."
            )
        part.load_state_dict(saved["state"], device)
