"""Routing replay (R3): the trainer's forwards route each token to the experts the inference engine chose for it.

A mixture-of-experts policy scored by the trainer re-routes every token; a small numerical difference from the
engine flips a near-tie in some router's top-k, the token goes to other experts, and its log-prob moves far more
than a dense model's would: the training-inference mismatch of MoE RL. Replaying the engine's choices removes that
part. The replayed top-k *selection* is the engine's; the gate weights are still the trainer's router's
probabilities over the replayed experts, so the router keeps its gradient ("Stabilizing MoE RL by aligning training
and inference routers", arXiv 2510.11370).

Routings are small integers, expert index + 1 (0: not recorded, the router chooses itself), shaped
(..., decoder layers, top-k) as vLLM returns them, in the smallest integer type that holds them
(`architecture.Routing.dtype`). A forward replays one by passing it as the model keyword argument `ROUTING_KWARG`
(batch, sequence, layers, top-k): transformers hands a model's extra keyword arguments to every decoder layer and on
to its attention, a pre-hook on each MoE layer's attention reads the layer's slice, and a hook on the router (which
runs after attention in the layer) substitutes the selection. Because the routing travels with the attention's
arguments, activation checkpointing's recomputation (which re-runs the layer's forward with the same arguments after
the forward returned, hooks of the layer itself excluded) replays the same routing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .architecture import LAYER_INDEX, Routing, recorded_class, routers, routing_geometry, unwrapped

ROUTING_KWARG = "dapo_routed_experts"


def encode_routing(expert_ids: Any, routing: Routing) -> torch.Tensor:
    """Engine expert indices (any integer array, (..., layers, top_k)) as replayable routing: index + 1, compact."""
    ids = torch.as_tensor(expert_ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= routing.num_experts):
        raise ValueError(f"routed experts outside 0..{routing.num_experts - 1}: the engine serves another model?")
    if ids.dim() < 2 or tuple(ids.shape[-2:]) != (routing.layers, routing.top_k):
        raise ValueError(
            f"routed experts of shape {tuple(ids.shape)}: expected (..., {routing.layers} layers, "
            f"{routing.top_k} experts per token)"
        )
    return (ids.to(torch.int32) + 1).to(routing.dtype)


def softmax_top_k_scores(logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Gate weights of the chosen experts in the softmax-then-top-k routers (Qwen2/3-MoE, Qwen3-Next, OLMoE,
    Mixtral): the softmax over all experts at the chosen ones, renormalised to sum 1 when the router does."""
    chosen = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    return chosen / chosen.sum(dim=-1, keepdim=True) if normalize else chosen


def top_k_softmax_scores(logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Gate weights in the top-k-then-softmax routers (gpt-oss): the softmax over the chosen experts' logits."""
    return torch.softmax(logits.gather(-1, indices), dim=-1)


# How a router turns its logits into gate weights of the chosen experts; which one a router uses is found from its
# own first output (the one that reproduces its weights bit for bit), so an unknown router is refused, never guessed.
SCORE_RULES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor], bool]] = {
    "softmax, top-k, renormalised": (softmax_top_k_scores, True),
    "softmax, top-k": (softmax_top_k_scores, False),
    "top-k, softmax": (top_k_softmax_scores, False),
}


def score_rule(router_output: tuple[torch.Tensor, ...], router_name: str) -> str:
    """The `SCORE_RULES` entry that reproduces this router's gate weights from its logits and choices exactly."""
    logits, scores, indices = router_output
    logits = logits.reshape(-1, logits.size(-1)).detach()
    for name, (rule, normalize) in SCORE_RULES.items():
        if torch.equal(rule(logits, indices, normalize).to(scores.dtype), scores.detach()):
            return name
    raise ValueError(
        f"routing replay cannot reproduce {router_name}'s gate weights from its logits (its scoring is none of "
        f"{', '.join(SCORE_RULES)}): this architecture is not supported; turn routing_replay off."
    )


class RouterHooks:
    """Hooks on a mixture-of-experts policy's routers, installed once: replay a routing passed with a forward
    (`ROUTING_KWARG`), count how often the policy's own router agrees with it, and collect the router logits a
    forward produces (for the auxiliary load-balancing loss, `algorithm.router_aux`) while `collect` is on."""

    def __init__(self, model: Any):
        self.routing = routing_geometry(model)
        self.routers = routers(model)
        self._current: dict[int, torch.Tensor | None] = {}  # layer -> the replayed routing of the running forward
        self._rules: dict[int, str] = {}
        self.agreement: torch.Tensor | None = None  # (experts the router chose as replayed, replayed), on device
        self.collect = False
        self.collected: list[torch.Tensor] = []  # router logits, one (tokens, experts) per MoE layer run
        layers = {router.layer for router in self.routers}
        self._handles = []
        for layer, attention in _attention_modules(model, layers).items():
            self._handles.append(attention.register_forward_pre_hook(self._layer_starts(layer), with_kwargs=True))
        for router in self.routers:
            self._handles.append(router.module.register_forward_hook(self._router_output(router.layer)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _layer_starts(self, layer: int):
        def hook(module, args, kwargs):
            routing = kwargs.get(ROUTING_KWARG)
            self._current[layer] = None if routing is None else routing[..., layer, :]

        return hook

    def _router_output(self, layer: int):
        def hook(module, args, output):
            logits, scores, indices = output
            if self.collect:
                self.collected.append(logits.reshape(-1, logits.size(-1)))
            replay = self._current.pop(layer, None)
            if replay is None:
                return None
            if layer not in self._rules:
                self._rules[layer] = score_rule(output, type(module).__name__)
            replay = replay.reshape(-1, replay.size(-1))
            if replay.size(0) != indices.size(0):
                raise ValueError(
                    f"a routing of {replay.size(0)} tokens was passed to a forward of {indices.size(0)} tokens"
                )
            recorded = replay[:, :1] > 0
            replayed = torch.where(recorded, replay.long() - 1, indices)
            with torch.no_grad():
                own = torch.zeros(indices.size(0), self.routing.num_experts, dtype=torch.bool, device=indices.device)
                own.scatter_(1, indices, True)
                matched = (own.gather(1, replayed) & recorded).sum()
                counts = torch.stack([matched.double(), recorded.sum().double() * indices.size(1)])
                self.agreement = counts if self.agreement is None else self.agreement + counts
            rule, normalize = SCORE_RULES[self._rules[layer]]
            flat_logits = logits.reshape(-1, logits.size(-1))
            new_scores = torch.where(recorded, rule(flat_logits, replayed, normalize).to(scores.dtype), scores)
            return logits, new_scores, replayed

        return hook

    def take_agreement(self) -> float | None:
        """The share of replayed expert choices the policy's own router also made since the last call (None if
        nothing was replayed)."""
        if self.agreement is None:
            return None
        (matched, total), self.agreement = self.agreement.tolist(), None
        return None if total == 0 else matched / total


def _attention_modules(model: Any, layers: set[int]) -> dict[int, torch.nn.Module]:
    """The attention module (what transformers records `attentions` from) of each decoder layer in `layers`."""
    cls = recorded_class(type(unwrapped(model)), "attentions")
    found = {}
    for name, module in unwrapped(model).named_modules():
        match = LAYER_INDEX.search(name)
        if cls is not None and isinstance(module, cls) and match and int(match.group(1)) in layers:
            found.setdefault(int(match.group(1)), module)
    missing = layers - set(found)
    if missing:
        raise ValueError(f"routing replay found no attention module in MoE layers {sorted(missing)}")
    return found


def routing_from_rows(row_routings: list[torch.Tensor | None], attention_mask: torch.Tensor, routing: Routing):
    """A forward's routing (rows, width, layers, top-k) from each row's recorded routing (its tokens in order, from
    the row's first attended token; None: not recorded): where a row has more attended tokens than recorded ones
    (vLLM records no routing for the last sampled token), the rest route themselves."""
    rows, width = attention_mask.shape
    out = torch.zeros(rows, width, routing.layers, routing.top_k, dtype=routing.dtype, device=attention_mask.device)
    attended = attention_mask.bool()
    counts = attended.sum(dim=1).tolist()
    firsts = attended.int().argmax(dim=1).tolist()
    for row, recorded in enumerate(row_routings):
        if recorded is None or counts[row] == 0:
            continue
        length = min(counts[row], recorded.size(0))
        out[row, firsts[row] : firsts[row] + length] = recorded[:length].to(out.device)
    return out
