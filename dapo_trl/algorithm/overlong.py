"""DAPO's soft overlong punishment (paper Eq. 13) as a pure tensor function."""

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
