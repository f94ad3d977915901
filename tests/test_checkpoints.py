"""`training.faults.checkpoints`: a checkpoint is resumed from only when complete; `latest` finds the newest complete
one; older checkpoints are rotated away only after the new one is complete; a failed write names the disk."""

import json

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from dapo_trl import DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.training.faults import checkpoints
from dapo_trl.training.faults.checkpoints import COMPLETE_FILE, IncompleteCheckpointError, resolve_resume

from .helpers import tiny_config


def fake_checkpoint(root, step: int, complete: bool = True):
    folder = root / f"checkpoint-{step}"
    (folder / "global_step1").mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    (folder / "global_step1" / "shard.pt").write_bytes(b"x" * 10)
    if complete:
        checkpoints.mark_complete(folder)
    return folder


def test_latest_is_the_newest_complete_checkpoint_or_a_fresh_start(tmp_path):
    assert resolve_resume("latest", tmp_path / "nothing-yet") is None  # a requeued job's first start
    assert resolve_resume(True, tmp_path) is None and resolve_resume(None, tmp_path) is None
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 12, complete=False)  # killed while saving
    assert resolve_resume("latest", tmp_path) == str(tmp_path / "checkpoint-10")
    assert resolve_resume("true", tmp_path) == resolve_resume(True, tmp_path) == str(tmp_path / "checkpoint-10")
    (tmp_path / "checkpoint-10" / "global_step1" / "shard.pt").write_bytes(b"x")  # truncated afterwards
    assert resolve_resume("latest", tmp_path) == str(tmp_path / "checkpoint-2")


def test_an_incomplete_checkpoint_is_refused_naming_what_is_missing_and_what_to_use(tmp_path):
    fake_checkpoint(tmp_path, 2)
    interrupted = fake_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(IncompleteCheckpointError, match=f"{COMPLETE_FILE} is missing.*Resume from .*checkpoint-2"):
        resolve_resume(str(interrupted), tmp_path)
    lost = fake_checkpoint(tmp_path, 6)
    (lost / "global_step1" / "shard.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="global_step1/shard.pt is missing.*checkpoint-2"):
        resolve_resume(str(lost), tmp_path)
    with pytest.raises(IncompleteCheckpointError, match="not a directory"):
        resolve_resume(str(tmp_path / "checkpoint-99"), tmp_path)
    assert resolve_resume(str(tmp_path / "checkpoint-2"), tmp_path) == str(tmp_path / "checkpoint-2")


def trainer(out, **overrides) -> DAPOTrainer:
    prompts = [{"prompt": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(16)]
    settings = {
        "save_strategy": "steps",
        "save_steps": 1,
        "max_steps": 2,
        "filter_groups_enable": True,
        "max_filter_gen_batches": 1,
        "filter_groups_on_exhausted": "fill",
        **overrides,
    }
    return DAPOTrainer(
        model=str(build_tiny_model()), args=tiny_config(out, **settings), train_dataset=Dataset.from_list(prompts)
    )


@pytest.mark.e2e
def test_a_failed_save_keeps_the_last_complete_checkpoint_and_names_the_disk(tmp_path, monkeypatch):
    """save_total_limit 1: checkpoint-1 is complete; writing checkpoint-2's sampling state fails (as on a full disk).
    The error names the folder and the free space; checkpoint-1 is still there and complete; checkpoint-2 is not
    complete, so `latest` resumes from checkpoint-1, and naming checkpoint-2 is refused."""
    out = tmp_path / "out"
    run = trainer(out, save_total_limit=1)
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if "checkpoint-2" in str(path) and str(path).endswith("dapo_sampling_state.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6592 vs 6484")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match=r"writing checkpoint .*checkpoint-2 failed: RuntimeError.* GiB free of"):
        run.train()
    monkeypatch.setattr(torch, "save", real_save)
    assert not checkpoints.problems(out / "checkpoint-1")  # not rotated away before checkpoint-2 was complete
    assert checkpoints.problems(out / "checkpoint-2") == [
        f"{COMPLETE_FILE} is missing (the save was interrupted, or an older dapo-trl wrote it)"
    ]
    assert resolve_resume("latest", out) == str(out / "checkpoint-1")
    with pytest.raises(IncompleteCheckpointError, match="checkpoint-1"):
        trainer(out).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    resumed = trainer(out, save_total_limit=1)
    resumed.train(resume_from_checkpoint="latest")
    assert resumed.state.global_step == 2
    assert [path.name for path in checkpoints.complete_checkpoints(out)] == ["checkpoint-2"]  # rotated once complete
    finished = trainer(out, save_total_limit=1)  # requeued once more: the run is at max_steps, nothing to train
    finished.train(resume_from_checkpoint="latest")
    assert finished.state.global_step == 2 and not (out / "checkpoint-3").exists()
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    weights = finished.model.state_dict()  # the checkpoint's: what the command line then saves as the final model
    assert saved.keys() <= weights.keys() and all(torch.equal(saved[name], weights[name]) for name in saved)
    listed = json.loads((out / "checkpoint-2" / COMPLETE_FILE).read_text())["files"]
    assert {"trainer_state.json", "dapo_sampling_state.pt", "optimizer.pt", "scheduler.pt"} <= set(listed)
    with pytest.raises(IncompleteCheckpointError, match="has no dapo_sampling_state.pt.*settings it was saved with"):
        (out / "checkpoint-2" / "dapo_sampling_state.pt").unlink()
        checkpoints.mark_complete(out / "checkpoint-2")  # complete as far as the record goes, but not for this run
        trainer(out, max_steps=3).train(resume_from_checkpoint="latest")


@pytest.mark.e2e
def test_at_every_write_of_a_save_latest_is_the_previous_complete_checkpoint(tmp_path, monkeypatch):
    """A kill -9 can land before any write of a save. At each one of checkpoint-2's (model, optimizer, scheduler,
    RNG, trainer state, DAPO's state, the completion record) and at the rotation with save_total_limit 1, the output
    directory is checked as a killed run would leave it: checkpoint-1 complete and the one `latest` picks,
    checkpoint-2 refused; checkpoint-1 is deleted only once checkpoint-2 is complete."""
    import shutil

    import transformers.modeling_utils
    from transformers import TrainerState

    out, seen = tmp_path / "out", []

    def check_before(kind: str, path) -> None:
        if "checkpoint-2" not in str(path):
            return
        seen.append(f"{kind}:{path.name if hasattr(path, 'name') else str(path).rsplit('/', 1)[-1]}")
        assert resolve_resume("latest", out) == str(out / "checkpoint-1"), seen[-1]
        assert checkpoints.problems(out / "checkpoint-2"), seen[-1]

    def wrap(owner, name: str, kind: str, path_of) -> None:
        real = getattr(owner, name)

        def hooked(*args, **kwargs):
            check_before(kind, path_of(*args, **kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, hooked)

    wrap(torch, "save", "torch.save", lambda obj, path, *a, **k: path)
    wrap(transformers.modeling_utils, "safe_save_file", "safetensors", lambda tensors, path, *a, **k: path)
    wrap(TrainerState, "save_to_json", "trainer_state", lambda self, path: path)
    wrap(checkpoints, "mark_complete", "record", lambda folder: folder)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if str(path).endswith("checkpoint-1"):
            seen.append("rotation")
            assert not checkpoints.problems(out / "checkpoint-2")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    trainer(out, save_total_limit=1).train()
    kinds = {entry.split(":")[0] for entry in seen}
    assert kinds == {"torch.save", "safetensors", "trainer_state", "record", "rotation"}, seen
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "dapo_sampling_state.pt"} <= {
        entry.split(":")[1] for entry in seen if ":" in entry
    }, seen
    assert [path.name for path in checkpoints.complete_checkpoints(out)] == ["checkpoint-2"]
