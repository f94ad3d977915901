"""A mixture-of-experts router's auxiliary load-balancing loss (Switch Transformer, Eqs. 4-6), from statistics that
add up: what a forward over part of the tokens contributes, summed over parts (token-budget chunks, or the shards of
one sequence under sequence parallelism), gives exactly the loss of all the tokens at once.

The loss is E * sum_e f_e * P_e with f_e the share of top-k assignments that went to expert e and P_e the mean
router probability of e, both pooled over layers and real tokens (transformers' `load_balancing_loss_func`, which
every MoE family uses). Neither is additive over parts; their numerators and the token count are.

A micro-batch trained in several backward passes (a token budget) needs more: each pass's gradient must be its
tokens' part of the whole micro-batch's loss. Since f is a constant of the loss (top-k counts, no gradient), that
loss is linear in the summed probabilities: `part_loss` of a pass, against the whole micro-batch's load (measured
before the first pass: `recorded_loads`), adds up over the passes to the whole loss, value and gradient (`part_of`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass
class RouterLoad:
    """Additive statistics of the routers' load over some tokens: per expert, top-k assignments and summed router
    probabilities (differentiable), and the count of (token, layer) pairs they cover."""

    assignments: torch.Tensor  # (experts,) float
    probabilities: torch.Tensor  # (experts,) float, carries the router's gradient
    rows: torch.Tensor  # () float

    def __add__(self, other: RouterLoad) -> RouterLoad:
        return RouterLoad(
            self.assignments + other.assignments, self.probabilities + other.probabilities, self.rows + other.rows
        )


def router_load(router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor | None) -> RouterLoad:
    """The load of one forward: `router_logits` one (tokens, experts) per MoE layer, `token_mask` (tokens,) the real
    ones (None: all)."""
    experts = router_logits[0].size(-1)
    device = router_logits[0].device
    weight = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    assignments = torch.zeros(experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        token_weight = torch.ones(probs.size(0), device=device) if weight is None else weight
        assignments = assignments.scatter_add(0, chosen.reshape(-1), token_weight.repeat_interleave(top_k))
        probabilities = probabilities + (probs * token_weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + token_weight.sum()
    return RouterLoad(assignments.detach(), probabilities, rows)


def part_loss(part: RouterLoad, whole: RouterLoad) -> torch.Tensor:
    """E * sum_e (whole.assignments_e / R) * (part.probabilities_e / R), R = whole.rows: the share of `whole`'s
    load-balancing loss that `part`'s tokens carry. Linear in the part's probabilities, with the whole's assignment
    shares as constants, so parts that add up to `whole` have losses (and gradients) that add up to its loss."""
    rows = whole.rows.clamp(min=1.0)
    return whole.assignments.numel() * torch.sum((whole.assignments / rows) * (part.probabilities / rows))


_WHOLE: ContextVar[RouterLoad | None] = ContextVar("router_load_whole", default=None)
_RECORDED: ContextVar[list[RouterLoad] | None] = ContextVar("router_loads_recorded", default=None)


def load_balancing_loss(load: RouterLoad) -> torch.Tensor:
    """E * sum_e (assignments_e / rows) * (probabilities_e / rows): 1 when perfectly balanced x top-k.

    Inside `part_of(whole)`, the load is one part of `whole`: its `part_loss`. Inside `recorded_loads()`, the load is
    also kept (detached): a forward turns its whole load into one loss here (chunks and shards summed first)."""
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(RouterLoad(load.assignments.detach(), load.probabilities.detach(), load.rows.detach()))
    whole = _WHOLE.get()
    return part_loss(load, load if whole is None else whole)


@contextlib.contextmanager
def recorded_loads() -> Iterator[list[RouterLoad]]:
    """Within the block, every load turned into a loss (one per forward) is appended to the yielded list."""
    token = _RECORDED.set([])
    try:
        yield _RECORDED.get()
    finally:
        _RECORDED.reset(token)


@contextlib.contextmanager
def part_of(whole: RouterLoad | None) -> Iterator[None]:
    """Within the block, forwards' loads are parts of `whole` (None: each its own whole): see `part_loss`."""
    token = _WHOLE.set(whole)
    try:
        yield
    finally:
        _WHOLE.reset(token)
