"""A mixture-of-experts router's auxiliary load-balancing loss (Switch Transformer, Eqs. 4-6), from statistics that
add up: what a forward over part of the tokens contributes, summed over parts (token-budget chunks, or the shards of
one sequence under sequence parallelism), gives exactly the loss of all the tokens at once.

The loss is E * sum_e f_e * P_e with f_e the share of top-k assignments that went to expert e and P_e the mean
router probability of e, both pooled over layers and real tokens (transformers' `load_balancing_loss_func`, which
every MoE family uses). Neither is additive over parts; their numerators and the token count are.
"""

from __future__ import annotations

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


def load_balancing_loss(load: RouterLoad) -> torch.Tensor:
    """E * sum_e (assignments_e / rows) * (probabilities_e / rows): 1 when perfectly balanced x top-k."""
    rows = load.rows.clamp(min=1.0)
    return load.assignments.numel() * torch.sum((load.assignments / rows) * (load.probabilities / rows))
