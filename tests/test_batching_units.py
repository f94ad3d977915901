"""Padding-free batching's pure pieces against plain references: partitions, budgets, trimming, packing."""

import itertools
import random

import pytest
import torch

from dapo_trl.training.step.batching import (
    balance_micro_batches,
    balanced_partition,
    fed_tokens,
    process_rows,
    token_budget_chunks,
    trim_micro_batch,
)
from dapo_trl.training.step.packing import pack_rows, padding_free_per_token, unpack_per_token


def padded_rows(prompt_lengths, completion_lengths, prompt_width=None, completion_width=None, seed=0):
    """TRL's layout: prompts left-padded, completions right-padded; ids are random, masks mark the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompt_width = prompt_width or max(prompt_lengths)
    completion_width = completion_width or max(max(completion_lengths), 1)
    rows = len(prompt_lengths)
    prompt_ids = torch.randint(3, 500, (rows, prompt_width), generator=generator)
    completion_ids = torch.randint(3, 500, (rows, completion_width), generator=generator)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        prompt_mask[row, prompt_width - p :] = 1
        completion_mask[row, :c] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator),
        "old_per_token_logps": torch.randn(rows, completion_width, generator=generator),
    }


def test_balanced_partition_covers_every_row_once_with_equal_counts():
    rng = random.Random(0)
    for _ in range(50):
        parts_count = rng.choice([1, 2, 3, 4])
        weights = [rng.randint(1, 1000) for _ in range(parts_count * rng.randint(1, 8))]
        parts = balanced_partition(weights, parts_count, equal_count=True)
        assert sorted(itertools.chain.from_iterable(parts)) == list(range(len(weights)))
        assert {len(part) for part in parts} == {len(weights) // parts_count}


def test_balanced_partition_is_near_optimal_on_small_cases():
    """LPT's makespan against the brute-force optimum of equal-count partitions (within LPT's 4/3 bound)."""
    rng = random.Random(1)
    for _ in range(30):
        weights = [rng.randint(1, 100) for _ in range(8)]
        parts = balanced_partition(weights, 2, equal_count=True)
        makespan = max(sum(weights[i] for i in part) for part in parts)
        best = min(
            max(sum(weights[i] for i in half), sum(weights) - sum(weights[i] for i in half))
            for half in itertools.combinations(range(8), 4)
        )
        assert makespan <= best * 4 / 3 + 1e-9


def test_token_budget_chunks_respect_the_budget_and_keep_long_rows_alone():
    lengths = [700, 50, 300, 300, 1200, 10, 600]
    chunks = token_budget_chunks(lengths, max_tokens=1000)
    assert sorted(itertools.chain.from_iterable(chunks)) == list(range(len(lengths)))
    for chunk in chunks:
        assert sum(lengths[i] for i in chunk) <= 1000 or len(chunk) == 1
    assert [4] in chunks  # 1200 > budget: a chunk of its own, never dropped
    assert token_budget_chunks(lengths, None) == [[4, 0, 6, 2, 3, 1, 5]]  # no budget: one chunk, longest first


def test_pack_and_unpack_round_trip_places_values_at_completion_tokens():
    batch = padded_rows([3, 1, 2], [2, 4, 0], completion_width=4)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    packed = pack_rows(ids, mask, 4)
    assert packed.input_ids.shape == (1, int(mask.sum()))
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    scored = (packed.labels != -100)[0]
    assert int(scored.sum()) == int(batch["completion_mask"].sum())
    # The fused head scores token j + 1 at position j: feed the label itself back as the "value".
    values = packed.labels[:, 1:].float()
    unpacked = unpack_per_token(packed, values, 4)
    expected = batch["completion_ids"].float() * batch["completion_mask"]
    assert torch.equal(unpacked, expected)


def test_trim_micro_batch_cuts_only_all_padding_columns():
    batch = padded_rows([2, 3], [1, 3], prompt_width=6, completion_width=8)
    trimmed = trim_micro_batch(batch)
    assert trimmed["prompt_ids"].shape == (2, 3) and trimmed["completion_ids"].shape == (2, 3)
    assert trimmed["old_per_token_logps"].shape == (2, 3)
    assert torch.equal(trimmed["prompt_ids"], batch["prompt_ids"][:, 3:])
    assert torch.equal(fed_tokens(trimmed), fed_tokens(batch))


def test_balance_micro_batches_keeps_rows_within_each_window():
    rng = random.Random(2)
    prompts = [rng.randint(1, 9) for _ in range(16)]
    completions = [rng.randint(0, 40) for _ in range(16)]
    batch = padded_rows(prompts, completions)
    micro_batches = [{key: value[i * 4 : (i + 1) * 4] for key, value in batch.items()} for i in range(4)]
    balanced = balance_micro_batches(micro_batches, window=2)
    assert [b["prompt_ids"].size(0) for b in balanced] == [4, 4, 4, 4]
    for window in range(2):
        before = sorted(batch["advantages"][window * 8 : (window + 1) * 8].tolist())
        after = sorted(torch.cat([b["advantages"] for b in balanced[window * 2 : window * 2 + 2]]).tolist())
        assert before == after  # the same rows, only re-dealt inside the optimizer step
    loads = [int(fed_tokens(b).sum()) for b in balanced]
    assert sum(loads) == int(fed_tokens(batch).sum())


def test_process_rows_balanced_or_contiguous():
    assert process_rows([1, 1, 1, 1], 2, balance=False) == [[0, 1], [2, 3]]
    parts = process_rows([10, 1, 9, 2], 2, balance=True)
    assert sorted(sum(([10, 1, 9, 2][i] for i in part), 0) for part in parts) == [11, 11]


def row_values(row_ids):
    """A fake model's per-token value: the cumulative sum of the row's own real ids up to t, times 1e-3."""
    return torch.cumsum(row_ids.float(), dim=0) * 1e-3


def fake_padded_forward(ids_, mask_, keep_):
    out = torch.zeros(ids_.shape)
    for r in range(ids_.size(0)):
        real = mask_[r].bool()
        out[r, real] = row_values(ids_[r, real])
    out = out * mask_
    return out[:, -keep_:], out[:, -keep_:] * 2, None


def fake_packed_forward(packed):  # every bin: blocks start where the position ids restart at 0
    out = []
    for ids, positions, labels in zip(packed.input_ids, packed.position_ids, packed.labels, strict=True):
        bounds = (positions == 0).nonzero().flatten().tolist() + [ids.size(0)]
        values = torch.cat([row_values(ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        out.append(values.masked_fill(labels == -100, 0)[1:])
    values = torch.stack(out)
    return values, values * 2, None


def fake_rows():
    batch = padded_rows([3, 1, 4, 2, 5], [4, 6, 0, 2, 3])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return ids, mask, batch["completion_ids"].size(1)


@pytest.mark.parametrize("budget", [None, 16, 5])
def test_padding_free_per_token_matches_a_padded_reference(budget):
    """A fake model whose per-token value depends on the row's own earlier tokens only, padded vs packed/trimmed."""
    ids, mask, keep = fake_rows()
    reference, reference_entropy, _ = fake_padded_forward(ids, mask, keep)
    for packed, one_sequence in ((fake_packed_forward, True), (fake_packed_forward, False), (None, False)):
        logps, entropy, _ = padding_free_per_token(
            ids,
            mask,
            keep,
            packed_forward=packed,
            padded_forward=fake_padded_forward,
            max_tokens=budget,
            max_rows=2,
            one_sequence=one_sequence,
        )
        assert torch.allclose(logps, reference) and torch.allclose(entropy, reference_entropy)


class CountedForwards:
    """The fake forwards, counting calls, with a weight the padded one multiplies by (to follow the autograd graph)."""

    def __init__(self):
        self.calls, self.agreed, self.weight = 0, [], torch.ones((), requires_grad=True)

    def padded(self, ids_, mask_, keep_):
        self.calls += 1
        logps, entropy, aux = fake_padded_forward(ids_, mask_, keep_)
        return logps * self.weight, entropy, aux

    def packed(self, packed):
        self.calls += 1
        logps, entropy, aux = fake_packed_forward(packed)
        return logps * self.weight, entropy, aux

    def agree(self, count):  # as if another process had two more chunks
        self.agreed.append(count)
        return count + 2


@pytest.mark.parametrize("budget", [None, 16, 5])
@pytest.mark.parametrize("mode", ["sequence", "bins", "trimmed"])
def test_sharded_weights_run_forwards_in_lockstep_with_exact_results(budget, mode):
    """ZeRO-3 / FSDP gather weights in every forward (and backward): a process with fewer chunks than another runs
    one-row forwards up to the agreed count. Its results do not change, and the extra forwards are in the graph."""
    ids, mask, keep = fake_rows()
    reference, reference_entropy, _ = fake_padded_forward(ids, mask, keep)
    forwards = CountedForwards()
    logps, entropy, _ = padding_free_per_token(
        ids,
        mask,
        keep,
        packed_forward=None if mode == "trimmed" else forwards.packed,
        padded_forward=forwards.padded,
        max_tokens=budget,
        max_rows=2,
        one_sequence=mode == "sequence",
        agree_count=forwards.agree,
    )
    assert len(forwards.agreed) == 1 and forwards.calls == forwards.agreed[0] + 2
    assert torch.allclose(logps, reference) and torch.allclose(entropy, reference_entropy)
    logps.sum().backward()  # reaches the weight through every forward, the lockstep ones at zero weight
    assert forwards.weight.grad is not None and torch.isfinite(forwards.weight.grad)
    empty = CountedForwards()
    none, _, _ = padding_free_per_token(
        ids[:0],
        mask[:0],
        keep,
        packed_forward=None,
        padded_forward=empty.padded,
        max_tokens=budget,
        max_rows=2,
        agree_count=lambda count: 3,
    )
    assert none.shape == (0, keep) and empty.calls == 3  # a process without rows still runs the agreed forwards


@pytest.mark.parametrize("mode", ["sequence", "bins", "trimmed"])
def test_one_forward_runs_every_row_at_once_with_exact_results(mode):
    """ZeRO-3 with reentrant checkpointing (PEFT's, forced by TRL): one forward per backward, whatever the budget."""
    ids, mask, keep = fake_rows()
    reference, reference_entropy, _ = fake_padded_forward(ids, mask, keep)
    forwards = CountedForwards()
    logps, entropy, _ = padding_free_per_token(
        ids,
        mask,
        keep,
        packed_forward=None if mode == "trimmed" else forwards.packed,
        padded_forward=forwards.padded,
        max_tokens=5,
        max_rows=2,
        one_sequence=mode == "sequence",
        agree_count=lambda count: count,
        one_forward=True,
    )
    assert forwards.calls == 1
    assert torch.allclose(logps, reference) and torch.allclose(entropy, reference_entropy)


def test_pack_rows_into_bins_of_the_longest_row():
    batch = padded_rows([3, 1, 2, 2], [4, 1, 0, 1])  # real lengths 7, 2, 2, 3
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    packed = pack_rows(ids, mask, 4, capacity=7, pad_token_id=-1)
    assert packed.input_ids.shape == (2, 7)  # [7] and [3, 2, 2]: first-fit decreasing
    assert packed.position_ids[1].tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert int((packed.input_ids == -1).sum()) == 0 and int((packed.labels != -100).sum()) == 6
    values = packed.labels[:, 1:].float()
    expected = batch["completion_ids"].float() * batch["completion_mask"]
    assert torch.equal(unpack_per_token(packed, values, 4), expected)
    aligned = pack_rows(ids, mask, 4, capacity=7, pad_token_id=-1, alignment=8)
    assert aligned.input_ids.shape == (2, 8) and aligned.position_ids[0].tolist() == list(range(8))  # tail continues
    assert torch.equal(unpack_per_token(aligned, aligned.labels[:, 1:].float(), 4), expected)


def test_bins_of_one_row_each_read_as_unpacked_sequences_so_sdpa_needs_no_mask():
    """transformers builds a dense packed-sequence mask when position ids restart inside a row of the batch (no mask
    lets sdpa run its causal kernels, flash among them). A bin's tail of padding continues its last row's positions:
    bins that each hold one row need no mask; a bin of two rows still gets one."""
    from transformers.masking_utils import find_packed_sequence_indices

    batch = padded_rows([3, 1, 2], [4, 4, 1])  # real lengths 7, 5, 3: bins of 7 hold [7] and [5] (tail 2), [3]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    one_each = pack_rows(ids[:2], mask[:2], 4, capacity=7)
    assert one_each.position_ids.tolist() == [list(range(7)), list(range(7))]
    assert find_packed_sequence_indices(one_each.position_ids) is None
    shared = pack_rows(ids[1:], mask[1:], 4, capacity=8)  # 5 + 3 in one bin
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert find_packed_sequence_indices(shared.position_ids) is not None
