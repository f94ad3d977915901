"""DAPO's math as pure tensor functions: no trainer state, each one testable against the paper's formula.

Shapes use N = number of completions, G = completions per prompt (a group), S = micro-batches per generation
batch (`steps_per_generation`), K = micro-batches per optimizer step (`gradient_accumulation_steps`).
"""

from __future__ import annotations

import torch


def soft_overlong_penalty(
    completion_lengths: torch.Tensor, max_completion_length: int, overlong_buffer_len: int
) -> torch.Tensor:
    """Soft overlong punishment, paper Eq. 13, before `overlong_penalty_factor`.

    With L_max = max_completion_length, L_cache = overlong_buffer_len and |y| the completion length:
    0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache in between; -1 if |y| > L_max.

    Args:
        completion_lengths: (N,) number of completion tokens per response.
    Returns:
        (N,) float penalties in [-1, 0].
    """
    if overlong_buffer_len <= 0 or overlong_buffer_len > max_completion_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len} must be in [1, max_completion_length={max_completion_length}]"
        )
    lengths = completion_lengths.to(torch.float64)
    expected_len = max_completion_length - overlong_buffer_len
    linear = (expected_len - lengths) / overlong_buffer_len
    penalty = torch.where(lengths <= expected_len, torch.zeros_like(lengths), linear)
    penalty = torch.where(lengths > max_completion_length, torch.full_like(lengths, -1.0), penalty)
    return penalty.to(torch.float32)


def optimizer_window_token_counts(chunk_token_counts: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
    """Token count of the optimizer step each micro-batch belongs to.

    A generation batch is split into S micro-batches; every K consecutive ones form one optimizer step. DAPO's
    token-level loss divides by the active tokens of that whole step (all micro-batches, all processes), which is
    not S / K times the generation batch's count when lengths differ between micro-batches.

    Args:
        chunk_token_counts: (S,) active tokens of each micro-batch, summed over processes.
        gradient_accumulation_steps: K; must divide S.
    Returns:
        (S,) for each micro-batch, the active tokens of its optimizer step.
    """
    num_chunks = chunk_token_counts.numel()
    if num_chunks % gradient_accumulation_steps != 0:
        raise ValueError(
            f"steps_per_generation ({num_chunks}) must be a multiple of gradient_accumulation_steps "
            f"({gradient_accumulation_steps})"
        )
    windows = chunk_token_counts.reshape(-1, gradient_accumulation_steps).sum(dim=1, keepdim=True)
    return windows.expand(-1, gradient_accumulation_steps).reshape(-1)


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
