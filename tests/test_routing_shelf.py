"""Routing replay's routings in host memory (`training.step.routing_shelf`): each process keeps the routings of the
rows it scored, hands each row's to the process that trains it, and frees what no batch will hold.

The end-to-end runs (tests/test_rollout_streaming.py's crash under ZeRO-3 on two processes) check that every
trained row replays its own routing; these check the exchange itself against routings built here, row by row."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing

from dapo_trl.moe.architecture import Routing
from dapo_trl.training.faults.checkpoints import IncompleteCheckpointError, load_process_state, process_file
from dapo_trl.training.faults.preemption import StepEndState
from dapo_trl.training.sampling.dynamic_sampling import DynamicSampler, Filling, ScoredRound, row_padding
from dapo_trl.training.step.replayed_routing import COMPLETION_ROUTING, PROMPT_ROUTING, ReplayedRouting
from dapo_trl.training.step.routing_shelf import NO_ROUTING, ROUTING_ID, RoutingShelf, all_to_all_exchange

WIDE = Routing(layers=3, top_k=2, num_experts=300)  # int16 routings: the exchange moves them as bytes


def row_routing(process: int, row: int, routing: Routing = WIDE) -> torch.Tensor:
    """A routing of its own length and values for each (process, row)."""
    generator = torch.Generator().manual_seed(1000 * process + row)
    tokens = 1 + (7 * process + 3 * row) % 11
    return torch.randint(1, routing.num_experts + 1, (tokens, routing.layers, routing.top_k), generator=generator)


def test_a_process_alone_hands_its_rows_back_in_order_and_a_checkpoint_keeps_its_ids_apart():
    shelf = RoutingShelf(WIDE, index=0, processes=1, exchange=None, rows_per_round=2)
    ids = shelf.put([row_routing(0, row) for row in range(5)]).tolist()
    assert len(set(ids)) == 5 and all(RoutingShelf.holder(row_id) == 0 for row_id in ids)
    assert all(routing.dtype == WIDE.dtype for routing in shelf.rows.values())
    shelf.release([ids[1]])
    got = shelf.fetch([[ids[4], NO_ROUTING, ids[0]]])
    assert torch.equal(got[0], row_routing(0, 4).to(WIDE.dtype)) and got[1] is None
    assert torch.equal(got[2], row_routing(0, 0).to(WIDE.dtype))
    assert sorted(shelf.rows) == [ids[2], ids[3]]  # handed over: no longer held
    shelf.keep_only([ids[3]])  # a step's end: the carried rows only
    resumed = RoutingShelf(WIDE, index=0, processes=1, exchange=None, rows_per_round=2)
    resumed.load_state_dict(shelf.state_dict())
    assert torch.equal(resumed.fetch([[ids[3]]])[0], row_routing(0, 3).to(WIDE.dtype))
    assert not set(resumed.put([row_routing(0, 9)]).tolist()) & set(ids)  # new ids never reuse a checkpoint's


def test_a_micro_batch_keeps_its_routings_until_its_last_ppo_epoch():
    """`num_iterations` > 1 trains a micro-batch once per epoch: each fetch but the last leaves its routings held."""
    shelf = RoutingShelf(WIDE, index=0, processes=1, exchange=None, rows_per_round=2)
    ids = shelf.put([row_routing(0, row) for row in range(3)]).tolist()
    first = shelf.fetch([[ids[2], ids[0]]], last_use=False)
    assert sorted(shelf.rows) == sorted(ids)
    last = shelf.fetch([[ids[2], ids[0]]], last_use=True)
    assert all(torch.equal(a, b) for a, b in zip(first, last, strict=True)) and sorted(shelf.rows) == [ids[1]]
    with pytest.raises(RuntimeError, match="holds no routing for rows"):
        shelf.fetch([[ids[0]]])


def _exchange_worker(rank: int, port: int, results: dict) -> None:
    torch.set_num_threads(1)  # forked: no thread pool of the parent's to rely on (and the tensors are tiny)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shelf = RoutingShelf(WIDE, rank, 2, all_to_all_exchange(torch.device("cpu")), rows_per_round=2)
        own = shelf.put([row_routing(rank, row) for row in range(6)]).tolist()
        everyone = [None, None]
        torch.distributed.all_gather_object(everyone, own)
        zero, one = everyone
        # Process 0 trains rows 0-3 of process 1 and two of its own; process 1 the rest; filler rows hold no routing.
        wanted = [[one[0], zero[2], one[3], NO_ROUTING, one[1], zero[5], one[2]], [zero[0], one[5], zero[1]]]
        held = sorted(shelf.rows)
        first_epoch = shelf.fetch(wanted, last_use=False)  # num_iterations > 1: the holders keep what they sent
        kept_for_next_epoch = sorted(shelf.rows) == held
        got = shelf.fetch(wanted)
        expected = {zero[i]: (0, i) for i in range(6)} | {one[i]: (1, i) for i in range(6)}
        own_row = {row_id: row_routing(*where).short() for row_id, where in expected.items()}
        results[rank] = {
            "matches": [
                routing is None if row_id == NO_ROUTING else torch.equal(routing, own_row[row_id])
                for row_id, routing in zip(wanted[rank], got, strict=True)
            ],
            "kept_for_next_epoch": kept_for_next_epoch,
            "epochs_agree": all(a is b is None or torch.equal(a, b) for a, b in zip(first_epoch, got, strict=True)),
            "left": sorted(shelf.rows),
            "unwanted": sorted({*(zero if rank == 0 else one)} - {*wanted[0], *wanted[1]}),
        }
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_hand_each_row_its_own_routing_and_drop_what_they_sent():
    """Over gloo, two rows a pair per round (four rounds for process 0's rows from process 1): every row of each
    process's share arrives whole, in its order, whichever process scored it; a fetch before the micro-batch's last
    PPO epoch leaves everything held, the last keeps only what nobody took."""
    results = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.start_processes(
        _exchange_worker, args=(free_port(), results), nprocs=2, join=True, start_method="fork"
    )
    for rank in (0, 1):
        assert all(results[rank]["matches"]), results[rank]
        assert results[rank]["kept_for_next_epoch"] and results[rank]["epochs_agree"]
        assert results[rank]["left"] == results[rank]["unwanted"]


def sampler(release: list) -> DynamicSampler:
    args = SimpleNamespace(
        scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize",
        seed=0,
        filter_groups_enable=True,
        filter_groups_atol=0.0,
        filter_groups_carry_surplus=False,
        max_filter_gen_batches=1,
        filter_groups_on_exhausted="fill",
    )
    sampling = DynamicSampler(args, [{"prompt": "p"}] * 8, group_size=2, padding=row_padding(0))
    sampling.release = release.extend
    return sampling


def test_dropped_rows_are_released_as_they_are_dropped_and_filler_routes_itself():
    released: list[int] = []
    sampling = sampler(released)
    filling = Filling(target_rows=4)
    rows = {
        "advantages": torch.arange(6.0),
        "completion_mask": torch.ones(6, 3, dtype=torch.long),
        ROUTING_ID: torch.tensor([10, 11, 12, 13, 14, 15]),
    }
    sampling.add(filling, ScoredRound(rows, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])))  # group 0 kept only
    assert released == [12, 13, 14, 15]
    batch, _ = sampling.finish(filling)  # short: the dropped groups' first rows fill it, without a routing
    assert batch[ROUTING_ID].tolist() == [10, 11, NO_ROUTING, NO_ROUTING]


def test_carried_groups_of_an_older_checkpoint_route_themselves(caplog):
    older = sampler([])
    older.carried = {
        "advantages": torch.ones(2),
        PROMPT_ROUTING: torch.ones(2, 3, WIDE.layers, WIDE.top_k, dtype=WIDE.dtype),
        COMPLETION_ROUTING: torch.ones(2, 4, WIDE.layers, WIDE.top_k, dtype=WIDE.dtype),
    }
    resumed = sampler([])
    resumed.load_state_dict(older.state_dict())
    assert sorted(resumed.carried) == ["advantages", ROUTING_ID] and resumed.carried[ROUTING_ID].tolist() == [-1, -1]
    assert "route themselves" in caplog.text


def test_carried_routings_resume_only_on_as_many_processes(tmp_path):
    shelf = RoutingShelf(WIDE, index=0, processes=2, exchange=None, rows_per_round=1)
    shelf.put([row_routing(0, 0)])
    state = {"processes": 2, "state": shelf.state_dict()}
    torch.save(state, tmp_path / process_file("dapo_routings", 0))
    with pytest.raises(IncompleteCheckpointError, match="routings each process holds.*resume with 2 processes"):
        load_process_state(str(tmp_path), {"dapo_routings": RoutingShelf(WIDE, 0, 1, None, 1)}, 0, 1, "cpu")
    empty = RoutingShelf(WIDE, index=0, processes=1, exchange=None, rows_per_round=1)
    torch.save({"processes": 2, "state": empty.state_dict()}, tmp_path / process_file("dapo_routings", 0))
    load_process_state(str(tmp_path), {"dapo_routings": empty}, 0, 1, "cpu")  # nothing carried: any count resumes


def test_a_micro_batch_fetches_its_routings_as_it_trains_at_its_own_width():
    """`settle` (the batch dealt) keeps the batch's and the carried rows' routings and drops the rest; `fetch` (a
    micro-batch about to train) lays each row's routing out as its masks: the prompt left-padded, the completion
    right-padded, to the micro-batch's width, and the shelf no longer holds what it handed over."""
    shelf = RoutingShelf(WIDE, index=0, processes=1, exchange=None, rows_per_round=2)
    replayed = ReplayedRouting(SimpleNamespace(routing=WIDE), shelf)
    routings = [torch.full((tokens, 3, 2), 1 + row) for row, tokens in enumerate((4, 2, 5, 3))]
    ids = shelf.put(routings)
    # Row 0: 4 attended tokens, a routing of 4; row 2: 6, a routing of 5 (vLLM records no routing of the last token).
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    micro_batch = {ROUTING_ID: ids[[0, 2]], "prompt_mask": prompt_mask, "completion_mask": completion_mask}
    replayed.settle([micro_batch], {ROUTING_ID: ids[[3]]}, lambda items: items)
    assert sorted(shelf.rows) == sorted(ids[[0, 2, 3]].tolist())  # row 1: neither trained nor carried
    fetched = replayed.fetch(micro_batch, lambda items: items)
    assert ROUTING_ID not in fetched and sorted(shelf.rows) == [int(ids[3])]
    prompt, completion = fetched[PROMPT_ROUTING][..., 0, 0], fetched[COMPLETION_ROUTING][..., 0, 0]
    assert prompt.tolist() == [[0, 1, 1], [3, 3, 3]] and completion.tolist() == [[1, 1, 0], [3, 3, 0]]
    assert fetched[PROMPT_ROUTING].dtype == WIDE.dtype and fetched[PROMPT_ROUTING].device.type == "cpu"


def test_a_step_abandoned_after_its_micro_batch_fetched_gets_the_routings_back():
    """A preemption abandons a step after its micro-batch fetched (the holders dropped what they sent): restoring
    the last step's end (`StepEndState`, as the run guard does before it writes that step's checkpoint) puts the
    routings back on the shelf, so the checkpoint and the resumed step have them."""
    shelf = RoutingShelf(WIDE, index=0, processes=1, exchange=None, rows_per_round=2)
    replayed = ReplayedRouting(SimpleNamespace(routing=WIDE), shelf)
    ids = shelf.put([row_routing(0, row) for row in range(2)])
    micro_batch = {
        ROUTING_ID: ids,
        "prompt_mask": torch.ones(2, 1, dtype=torch.long),
        "completion_mask": torch.ones(2, 11, dtype=torch.long),
    }
    step_end = StepEndState.capture(0, {}, {"dapo_routings": shelf}, {})
    first = replayed.fetch(micro_batch, lambda items: items)
    assert not shelf.rows
    step_end.restore({}, {"dapo_routings": shelf}, "cpu")
    again = replayed.fetch(micro_batch, lambda items: items)
    assert torch.equal(first[COMPLETION_ROUTING], again[COMPLETION_ROUTING])
    assert again[COMPLETION_ROUTING].count_nonzero() > 0
