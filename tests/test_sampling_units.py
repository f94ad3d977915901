"""Dynamic sampling's pure pieces against plain references: keep mask, batch assembly, prompt streams."""

import math
import random

import pytest
import torch

from dapo_trl.algorithm import assemble_batch, concat_padded, group_keep_mask
from dapo_trl.training.sampling.streams import IterablePromptStream, PromptStream


def keep_reference(values: list[float], group: int, atol: float) -> list[bool]:
    kept = []
    for start in range(0, len(values), group):
        scored = [v for v in values[start : start + group] if not math.isnan(v)]
        kept.append(len(scored) >= 2 and max(scored) - min(scored) > atol)
    return kept


def test_keep_mask_matches_reference_on_random_groups():
    rng = random.Random(0)
    for group in (2, 4, 16):
        values = []
        for _ in range(200):
            kind = rng.choice(["constant", "binary", "noisy", "nan"])
            if kind == "constant":
                values += [rng.choice([-1.0, 1.0])] * group
            elif kind == "binary":
                values += [rng.choice([-1.0, 1.0]) for _ in range(group)]
            elif kind == "noisy":
                values += [1.0 + rng.uniform(-1e-9, 1e-9) for _ in range(group)]
            else:
                values += [float("nan")] * (group - 1) + [1.0]
        got = group_keep_mask(torch.tensor(values), group).tolist()
        assert got == keep_reference(values, group, 1e-6)


def test_keep_mask_ignores_float_noise_and_length_shaping():
    accuracy = torch.tensor([1.0, 1.0 + 1e-8, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0])
    assert group_keep_mask(accuracy, 4).tolist() == [False, True]
    with pytest.raises(ValueError, match="groups of 4"):
        group_keep_mask(torch.ones(6), 4)


def test_concat_padded_sides():
    left = concat_padded([torch.tensor([[1, 2]]), torch.tensor([[3, 4, 5]])], 0, pad_left=True)
    right = concat_padded([torch.tensor([[1, 2]]), torch.tensor([[3, 4, 5]])], 9, pad_left=False)
    assert left.tolist() == [[0, 1, 2], [3, 4, 5]] and right.tolist() == [[1, 2, 9], [3, 4, 5]]


def test_assemble_cuts_exactly_and_returns_surplus():
    def part(first_row: int, rows: int, width: int) -> dict:
        ids = torch.arange(first_row, first_row + rows)
        return {"advantages": ids.float(), "completion_ids": ids[:, None].repeat(1, width)}

    padding = {"completion_ids": (-1, False)}
    batch, surplus = assemble_batch([part(0, 4, 2), part(4, 8, 3)], 8, padding)
    assert batch["advantages"].tolist() == list(range(8))
    assert batch["completion_ids"].shape == (8, 3) and batch["completion_ids"][0].tolist() == [0, 0, -1]
    assert surplus["advantages"].tolist() == [8, 9, 10, 11]
    batch, surplus = assemble_batch([part(0, 8, 2)], 8, padding)
    assert surplus is None
    with pytest.raises(ValueError, match="only 4 rows"):
        assemble_batch([part(0, 4, 2)], 8, padding)


def test_prompt_stream_is_seeded_covers_every_pass_and_resumes():
    stream = PromptStream(10, seed=3)
    first = stream.draw(25)
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a fresh permutation per pass
    assert PromptStream(10, seed=3).draw(25) == first
    saved = stream.state_dict()
    continuation = stream.draw(7)
    resumed = PromptStream(10, seed=3)
    resumed.load_state_dict(saved)
    assert resumed.draw(7) == continuation
    with pytest.raises(ValueError, match="same dataset"):
        PromptStream(11, seed=3).load_state_dict(saved)


def stream_rows(size: int = 23, shards: int = 4):
    from datasets import Dataset

    rows = [{"prompt": f"p{i}", "solution": str(i)} for i in range(size)]
    return Dataset.from_list(rows).to_iterable_dataset(num_shards=shards)


def prompts(rows: list[dict]) -> list[str]:
    return [row["prompt"] for row in rows]


def test_iterable_stream_is_seeded_and_covers_every_row_once_per_pass():
    first = prompts(IterablePromptStream(stream_rows(), seed=3, buffer_size=5).draw(50))
    assert prompts(IterablePromptStream(stream_rows(), seed=3, buffer_size=5).draw(50)) == first  # every process
    assert sorted(first[:23]) == sorted(f"p{i}" for i in range(23)) == sorted(first[23:46])
    assert first[:23] != first[23:46]  # a new shard order and buffer draws each pass
    assert first[:23] != [f"p{i}" for i in range(23)]  # shuffled
    assert prompts(IterablePromptStream(stream_rows(), seed=4, buffer_size=5).draw(23)) != first[:23]
    in_order = IterablePromptStream(stream_rows(), seed=3, buffer_size=5, shuffle=False)
    assert prompts(in_order.draw(25)) == [f"p{i}" for i in range(23)] + ["p0", "p1"]


@pytest.mark.parametrize("shards", [1, 4])
def test_iterable_stream_resumes_exactly_from_any_position(tmp_path, shards):
    """Saved mid-buffer, mid-shard, at shard and pass boundaries: the checkpoint (through torch.save / torch.load,
    as the trainer stores it) continues with exactly the rows an uninterrupted stream draws next."""
    for drawn in range(0, 52):
        stream = IterablePromptStream(stream_rows(shards=shards), seed=1, buffer_size=5)
        stream.draw(drawn)
        torch.save(stream.state_dict(), tmp_path / "state.pt")
        continuation = prompts(stream.draw(20))
        resumed = IterablePromptStream(stream_rows(shards=shards), seed=1, buffer_size=5)
        resumed.load_state_dict(torch.load(tmp_path / "state.pt"))
        assert prompts(resumed.draw(20)) == continuation, drawn


def test_iterable_stream_refuses_a_foreign_checkpoint():
    with pytest.raises(ValueError, match="same train_dataset"):
        IterablePromptStream(stream_rows(shards=2), seed=1).load_state_dict(
            IterablePromptStream(stream_rows(shards=4), seed=1).state_dict()
        )
    with pytest.raises(ValueError, match="same dataset"):
        PromptStream(10, seed=3).load_state_dict(IterablePromptStream(stream_rows(), seed=1).state_dict())
    from datasets import IterableDataset

    with pytest.raises(ValueError, match="non-empty"):
        IterablePromptStream(IterableDataset.from_generator(lambda: iter(())), seed=1).draw(1)


@pytest.mark.parametrize("saved_with,resumed_with", [("group", "batch"), ("batch", "group"), ("group", "none")])
def test_carried_groups_saved_under_other_reward_normalisation_are_dropped(saved_with, resumed_with, caplog):
    from types import SimpleNamespace

    from dapo_trl.training.sampling.dynamic_sampling import BATCH_REWARDS, DynamicSampler

    def sampler(scale_rewards):
        args = SimpleNamespace(scale_rewards=scale_rewards, multi_objective_aggregation="sum_then_normalize", seed=0)
        return DynamicSampler(args, [{"prompt": "p"}] * 4, group_size=2, padding={})

    saving = sampler(saved_with)
    saving.carried = {"advantages": torch.ones(4)}
    if saved_with == "batch":
        saving.carried[BATCH_REWARDS] = torch.ones(4)
    resumed = sampler(resumed_with)
    resumed.load_state_dict(saving.state_dict())  # was a KeyError at the next step
    assert resumed.carried is None and "dropping 2 carried groups" in caplog.text
    legacy = {key: value for key, value in saving.state_dict().items() if key != "rewards"}  # older checkpoints
    resumed = sampler(resumed_with)
    resumed.load_state_dict(legacy)
    assert (resumed.carried is None) == ("batch" in (saved_with, resumed_with))  # group/none: cannot tell, kept
    same = sampler(saved_with)
    same.load_state_dict(saving.state_dict())
    assert same.carried is not None and same.carried.keys() == saving.carried.keys()
