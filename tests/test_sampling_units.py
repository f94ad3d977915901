"""Dynamic sampling's pure pieces against plain references: keep mask, batch assembly, prompt stream."""

import math
import random

import pytest
import torch

from dapo_trl.algorithm import assemble_batch, concat_padded, group_keep_mask
from dapo_trl.sampling import PromptStream


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
