"""Routing replay in DAPOTrainer (`routing_replay`): which routing each training forward replays, and how the rows
carry it.

A streamed wave arrives with the engine's routing of every completion (prompt and completion tokens, `moe.
routing_replay`). While TRL scores the wave, its forwards (old log-probs, carried groups' log-probs) replay those
routings row by row. The scored rows then put their routings on this process's `RoutingShelf` (host memory, real
tokens only) and carry only its id (`routing_shelf.ROUTING_ID`) across processes, into the step's micro-batches,
carried surplus and checkpoints. Once the step's batch is dealt, the shelves drop what it does not use (`settle`);
as each micro-batch is about to train, every process fetches its rows' routings (`fetch`) as two host row tensors
aligned with TRL's layout at the micro-batch's width, `prompt_routed_experts` (left-padded like prompt_ids) and
`completion_routed_experts` (right-padded like completion_ids); the policy's forward in the loss replays them from
there, one pack at a time on the accelerator. So a process holds, beside its shelf, one micro-batch's routing, padded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...moe.routing_replay import RouterHooks, encode_routing, routing_from_rows
from .routing_shelf import NO_ROUTING, ROUTING_ID, RoutingShelf, all_to_all_exchange, rows_per_round

PROMPT_ROUTING = "prompt_routed_experts"
COMPLETION_ROUTING = "completion_routed_experts"
HOST_ROW_TENSORS = (PROMPT_ROUTING, COMPLETION_ROUTING)  # a micro-batch's routings stay in host memory
ROUTING_SHELF_FILE = "dapo_routings"  # each process's shelf (carried groups' routings), one file per process
ROUTING_ROW_FIELDS = {ROUTING_ID: (NO_ROUTING, False)}  # what dynamic sampling moves: the id, not the routing


class ReplayedRouting:
    """The routing the next training forwards replay: a wave's engine routings while TRL scores it, or a micro-batch's
    row tensors while the loss runs."""

    def __init__(self, hooks: RouterHooks, shelf: RoutingShelf):
        self.hooks, self.shelf = hooks, shelf
        self.routing = hooks.routing
        self._rows: list[torch.Tensor] | None = None
        self._batch: torch.Tensor | None = None
        self._suspended = False
        self.probed_step = -1  # the last optimizer step whose mismatch without replay was measured

    @contextlib.contextmanager
    def wave(self, routings: list[Any] | None) -> Iterator[None]:
        """Within the block, forwards of the wave's rows (in their order) replay each row's engine routing."""
        if routings is None or any(routing is None for routing in routings):
            raise RuntimeError(
                "routing_replay=true, but the engine returned no routed experts: serve the model with "
                "`vllm serve ... --enable-return-routed-experts` (vLLM >= 0.31, with VLLM_USE_V2_MODEL_RUNNER=1 on "
                "GPUs), or have your engine fill GroupResult.routed_experts."
            )
        self._rows = [encode_routing(routing, self.routing) for routing in routings]
        try:
            yield
        finally:
            self._rows = None

    @contextlib.contextmanager
    def batch(self, inputs: dict[str, Any]) -> Iterator[None]:
        """Within the block, the forward of these rows (`inputs`, TRL's layout) replays the routing they carry."""
        if PROMPT_ROUTING not in inputs:
            raise RuntimeError("routing_replay=true, but the training rows carry no routing (a batch from elsewhere?)")
        self._batch = torch.cat([inputs[PROMPT_ROUTING], inputs[COMPLETION_ROUTING]], dim=1)
        try:
            yield
        finally:
            self._batch = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block, forwards route themselves (the mismatch-without-replay metric)."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def for_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """The routing of a forward of these rows, (rows, width, layers, top-k) in host memory (the packs move to the
        accelerator one at a time), or None (route themselves)."""
        if self._suspended:
            return None
        if self._batch is not None:
            if tuple(self._batch.shape[:2]) != tuple(input_ids.shape):
                raise RuntimeError(f"a routing of {tuple(self._batch.shape[:2])} for rows of {tuple(input_ids.shape)}")
            return self._batch
        if self._rows is not None:
            if len(self._rows) != input_ids.size(0):
                raise RuntimeError(f"{len(self._rows)} routings for a forward of {input_ids.size(0)} rows")
            return routing_from_rows(self._rows, attention_mask.cpu(), self.routing)
        return None

    def shelve(self, output: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The wave's routings put on this process's shelf; TRL's scored rows (`output`) carry their ids."""
        return {ROUTING_ID: self.shelf.put(self._rows).to(output["advantages"].device)}

    def settle(
        self,
        micro_batches: list[dict[str, Any]],
        carried: dict[str, torch.Tensor] | None,
        gather_objects: Callable[[list[Any]], list[Any]],
        still_training: list[dict[str, Any]] = (),
    ) -> None:
        """The step's batch is dealt (this process's `micro_batches`, their rows carrying ids): every shelf keeps the
        routings of the batch's rows, fetched as each micro-batch trains (`fetch`), of the carried groups, and of
        the micro-batches `still_training` (an earlier generation batch's, when an optimizer step spans two, or
        a batch made ahead in the same step), and drops the rest. Collective (`gather_objects`: each process's
        list, in process order)."""
        batches = [*micro_batches, *(batch for batch in still_training if ROUTING_ID in batch)]
        mine = [row_id for batch in batches for row_id in batch[ROUTING_ID].tolist()]
        used = {row_id for ids in gather_objects([mine]) for row_id in ids}
        self.shelf.keep_only(used | set([] if carried is None else carried[ROUTING_ID].tolist()))

    def fetch(
        self, micro_batch: dict[str, Any], gather_objects: Callable[[list[Any]], list[Any]], last_use: bool = True
    ) -> dict[str, Any]:
        """The micro-batch about to train with its rows' routings, fetched from the processes holding them, as host
        row tensors at its width (its ids dropped). The holders drop what they sent on the micro-batch's
        `last_use` (its last PPO epoch) and keep it for the next epoch otherwise. Collective: every process fetches
        its micro-batch of the same step together."""
        ids = micro_batch[ROUTING_ID]
        routings = self.shelf.fetch(gather_objects([ids.tolist()]), last_use)
        mask = torch.cat([micro_batch["prompt_mask"], micro_batch["completion_mask"]], dim=1).cpu()
        full = routing_from_rows(routings, mask, self.routing)
        width = micro_batch["prompt_mask"].size(1)
        fetched = {key: value for key, value in micro_batch.items() if key != ROUTING_ID}
        fetched[PROMPT_ROUTING], fetched[COMPLETION_ROUTING] = full[:, :width], full[:, width:]
        return fetched


def replayed_routing_for(trainer: Any, hooks: RouterHooks | None) -> ReplayedRouting | None:
    """The trainer's `ReplayedRouting` when `routing_replay` is on (None otherwise), refusing what cannot replay."""
    if not trainer.args.routing_replay:
        return None
    if hooks is None:
        raise ValueError(
            f"routing_replay=true needs a mixture-of-experts policy whose routers transformers marks (it records their "
            f"logits): {type(trainer.model).__name__} has none. Set routing_replay=false for a dense model."
        )
    if trainer.tools:
        raise ValueError(
            "routing_replay=true does not run with tools: the engine routes the first turn only, tool replies and "
            "later turns would be re-routed. Set routing_replay=false for tool use."
        )
    if trainer.args.use_vllm and trainer.args.vllm_mode == "colocate":
        raise ValueError(
            "routing_replay=true needs a vLLM server (vllm_mode='server', `vllm serve --enable-return-routed-experts`):"
            " TRL builds the colocated engine without returning routed experts."
        )
    accelerator = trainer.accelerator
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    exchange = all_to_all_exchange(accelerator.device if nccl else torch.device("cpu"))
    per_round = rows_per_round(trainer.args.per_device_train_batch_size, accelerator.num_processes)
    shelf = RoutingShelf(hooks.routing, accelerator.process_index, accelerator.num_processes, exchange, per_round)
    trainer._sampler.release = shelf.release  # dropped rows' routings are freed as dynamic sampling drops them
    return ReplayedRouting(hooks, shelf)


def settle_routings(
    trainer: Any, micro_batches: list[dict[str, Any]], still_training: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """This process's micro-batches of the step's batch, the shelves left with their routings and those of the
    micro-batches `still_training` (`ReplayedRouting.settle`) under routing replay; as they are otherwise."""
    if trainer._replayed_routing is not None:
        sampler = trainer._sampler
        gather_objects = sampler.process.gather_objects
        trainer._replayed_routing.settle(micro_batches, sampler.carried, gather_objects, still_training)
    return micro_batches


def with_routings(trainer: Any, micro_batch: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch of the current micro-step with its rows' routings (`ReplayedRouting.fetch`; kept on the
    shelves until the micro-batch's last PPO epoch) under routing replay; else (and for micro-batches of an older
    checkpoint, which carry their routings) as it is."""
    from .. import trl_seam

    if trainer._replayed_routing is None or ROUTING_ID not in micro_batch:
        return micro_batch
    last_use = trainer._optimizer_steps.last_use(trl_seam.micro_step(trainer))
    return trainer._replayed_routing.fetch(micro_batch, trainer._sampler.process.gather_objects, last_use)


def routing_files(replayed: ReplayedRouting | None) -> dict[str, RoutingShelf]:
    """{file stem: shelf}: each process's checkpoint file of the routings it holds (routing replay only)."""
    return {} if replayed is None else {ROUTING_SHELF_FILE: replayed.shelf}


@contextlib.contextmanager
def replaying_round(trainer: Any, scoring: Any) -> Iterator[ReplayedRouting | None]:
    """Within the block, a training round's forwards replay its engine routings (`scoring.routed_experts`); yields
    the trainer's `ReplayedRouting`, or None when nothing is replayed."""
    replayed = trainer._replayed_routing
    if replayed is None or not trainer.model.training:
        yield None
        return
    replayed.hooks.take_agreement()  # router agreement: this round's scoring forwards only
    with replayed.wave(scoring.routed_experts):
        yield replayed


def record_replay_metrics(trainer: Any, output: dict[str, Any], scoring: Any) -> None:
    """The round's `replay_metrics` into the step's metrics; the mismatch without replay costs a forward, so only
    a step's first round (or wave) measures it."""
    from .. import trl_seam

    replayed, step = trainer._replayed_routing, trainer.state.global_step
    without_replay, replayed.probed_step = replayed.probed_step != step, step
    for name, value in replay_metrics(trainer, output, scoring.engine_logprobs, without_replay).items():
        trl_seam.metrics(trainer, "train")[name].append(value)


def replay_metrics(
    trainer: Any, output: dict[str, Any], engine_logprobs: list[list[float]], without_replay: bool
) -> dict[str, float]:
    """Router agreement (the share of the engine's expert choices the trainer's router also made, in the scoring
    forwards since the last call) and the mean |log-prob - engine log-prob| over the wave's completion tokens with
    replay (the old log-probs the rows carry) and, when `without_replay`, without it (one more forward without
    gradient: the trainer measures it once per optimizer step), over every process's rows."""
    from .. import trl_seam

    replayed: ReplayedRouting = trainer._replayed_routing
    input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    keep = output["completion_ids"].size(1)

    def log_probs() -> torch.Tensor:
        with torch.no_grad():
            return trl_seam.per_token_log_probs(trainer, trainer.model, input_ids, attention_mask, keep)

    with_replay = output.get("old_per_token_logps")
    with_replay = log_probs() if with_replay is None else with_replay
    agreement = replayed.hooks.take_agreement()
    engine = torch.zeros_like(with_replay)
    for row, values in enumerate(engine_logprobs):
        engine[row, : min(len(values), keep)] = torch.tensor(values[:keep], dtype=engine.dtype)
    mask = output["completion_mask"].to(engine.dtype)
    sums = [((with_replay - engine).abs() * mask).sum(), mask.sum()]
    sums += [torch.tensor(0.0 if agreement is None else agreement, device=mask.device)]
    sums += [torch.tensor(float(agreement is not None), device=mask.device)]
    if without_replay:
        with replayed.suspended():
            sums.append(((log_probs() - engine).abs() * mask).sum())
    total = trainer.accelerator.reduce(torch.stack(sums), reduction="sum").tolist()
    tokens = max(total[1], 1.0)
    metrics = {"routing_replay/logprob_mismatch": total[0] / tokens}
    if total[3]:
        metrics["routing_replay/router_agreement"] = total[2] / total[3]
    if without_replay:
        metrics["routing_replay/logprob_mismatch_without_replay"] = total[4] / tokens
    return metrics
