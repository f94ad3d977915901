"""Batch math of dynamic sampling and the exact step denominator, as pure tensor functions.

Shapes use N = number of completions, G = completions per prompt (a group), S = micro-batches per generation
batch (`steps_per_generation`), K = micro-batches per optimizer step (`gradient_accumulation_steps`).
"""

from __future__ import annotations

import torch


def trl_items_for_exact_normalizer(
    window_tokens: torch.Tensor, steps_per_generation: int, gradient_accumulation_steps: int
) -> torch.Tensor:
    """The `num_items_in_batch` that makes TRL's "dapo" normaliser equal the optimizer step's exact token count.

    TRL divides each process's summed micro-batch loss by num_items * K / (S * P), and DDP then averages the P
    gradients, so the optimizer step sees sum(loss over the step) * S / (num_items * K). Choosing
    num_items = window_tokens * S / K makes that sum(loss over the step) / window_tokens: paper Eq. 11's
    1 / sum_i |o_i| over the whole step, whatever P, K and S are (P cancels out).
    """
    return window_tokens.to(torch.float32) * steps_per_generation / gradient_accumulation_steps


def group_keep_mask(accuracy: torch.Tensor, num_generations: int, atol: float = 1e-6) -> torch.Tensor:
    """Dynamic sampling's filter (paper Eq. 11 constraint 0 < |{o_i correct}| < G): groups whose accuracy varies.

    A group whose accuracy is all-correct or all-wrong has zero advantage everywhere and no gradient. The spread
    is compared with a tolerance so float noise in a constant group does not keep it. NaN (unscorable) entries
    are ignored; a group with fewer than two scored responses is dropped.

    Args:
        accuracy: (N,) raw accuracy reward per response, N = num_groups * G, group members contiguous.
    Returns:
        (num_groups,) bool, True where the group is kept.
    """
    if accuracy.numel() % num_generations != 0:
        raise ValueError(f"{accuracy.numel()} rewards do not split into groups of {num_generations}")
    groups = accuracy.reshape(-1, num_generations).to(torch.float64)
    scored = ~torch.isnan(groups)
    highest = torch.where(scored, groups, torch.full_like(groups, -torch.inf)).amax(dim=1)
    lowest = torch.where(scored, groups, torch.full_like(groups, torch.inf)).amin(dim=1)
    return (scored.sum(dim=1) >= 2) & (highest - lowest > atol)


def concat_padded(tensors: list[torch.Tensor], pad_value: float, pad_left: bool) -> torch.Tensor:
    """Concatenate (rows, width_k, ...) tensors along rows, padding each to the widest on the left or the right."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.size(1) for t in tensors)
    padded = []
    for tensor in tensors:
        missing = width - tensor.size(1)
        if missing:
            filler = tensor.new_full((tensor.size(0), missing, *tensor.shape[2:]), pad_value)
            tensor = torch.cat([filler, tensor] if pad_left else [tensor, filler], dim=1)
        padded.append(tensor)
    return torch.cat(padded)


def assemble_batch(
    parts: list[dict[str, torch.Tensor]], target_rows: int, padding: dict[str, tuple[float, bool]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Concatenate kept groups in arrival order, cut to exactly `target_rows` rows, return (batch, surplus).

    `padding[key] = (pad_value, pad_left)` says how to widen each 2-D tensor. `target_rows` must be a whole number
    of groups, so the cut always falls on a group boundary; surplus is None when nothing is left over.
    """
    keys = parts[0].keys()
    merged = {key: concat_padded([part[key] for part in parts], *padding.get(key, (0, False))) for key in keys}
    total_rows = next(iter(merged.values())).size(0)
    if total_rows < target_rows:
        raise ValueError(f"only {total_rows} rows to assemble a batch of {target_rows}")
    batch = {key: value[:target_rows] for key, value in merged.items()}
    surplus = {key: value[target_rows:] for key, value in merged.items()} if total_rows > target_rows else None
    return batch, surplus
