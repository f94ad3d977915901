"""Routing replay's routings in host memory, each process holding only its share (`RoutingShelf`).

A routing is one byte (two past 254 experts) per decoder layer and routed expert per token: 384 B a token for
Qwen3-30B-A3B, 48x what a row's token id and log-prob take. Carried as row tensors on the accelerator and gathered to
every process like the others, a DAPO batch's routings (512 x 16 x 20k tokens) would be 58.6 GiB on every GPU. So:

- a scored wave's routings stay on the process that scored them, in host memory, one compact tensor per row (its
  recorded tokens only, no padding), under an id; the rows carry only the id (`ROUTING_ID`), which dynamic sampling
  gathers, keeps, carries and checkpoints like any other row field;
- rows dynamic sampling drops are released as it drops them (`release`);
- once the step's batch is dealt (`batching.process_share`), the shelves keep its rows' routings (`keep_only`) and,
  as each micro-batch is about to train, every process fetches its rows' routings from the processes holding them
  (`fetch`: all-to-all exchanges of a few rows per pair at a time, so under NCCL the accelerator holds about a
  micro-batch's worth in flight) as the host tensors that micro-batch trains with; a forward moves one pack's routing
  to the accelerator (`packing.pack_rows`);
- the rows not yet fetched and the carried groups' routings stay with the process that scored them, in its
  checkpoint file (`state_dict`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ...moe.architecture import Routing

ROUTING_ID = "routing_id"  # (rows,) int64 row field: the row's routing on the shelf of the process that scored it
NO_ROUTING = -1  # a row with no routing (dynamic sampling's zero-advantage filler): its forwards route themselves
_HOLDER_BITS = 40  # an id is (holder process << _HOLDER_BITS) | serial

Exchange = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]  # (sent, send splits, receive splits)


def all_to_all_exchange(device: torch.device) -> Exchange:
    """torch.distributed's all-to-all of one flat tensor, through `device` (the accelerator under NCCL)."""

    def exchange(sent: torch.Tensor, send_splits: list[int], receive_splits: list[int]) -> torch.Tensor:
        received = torch.empty(sum(receive_splits), dtype=sent.dtype, device=device)
        torch.distributed.all_to_all_single(received, sent.to(device), receive_splits, send_splits)
        return received.cpu()

    return exchange


class RoutingShelf:
    """This process's scored rows' routings, `(tokens, layers, top_k)` host tensors keyed by id."""

    def __init__(self, routing: Routing, index: int, processes: int, exchange: Exchange | None, rows_per_round: int):
        self.routing, self.index, self.processes = routing, index, processes
        self.exchange, self.rows_per_round = exchange, max(1, rows_per_round)
        self.rows: dict[int, torch.Tensor] = {}
        self.serial = 0

    @property
    def nbytes(self) -> int:
        return sum(routing.nbytes for routing in self.rows.values())

    @staticmethod
    def holder(row_id: int) -> int:
        """The process holding `row_id`: the one that scored it."""
        return row_id >> _HOLDER_BITS

    def put(self, routings: Sequence[torch.Tensor]) -> torch.Tensor:
        """Shelve each row's routing (compact, host memory); the rows' ids, in order."""
        ids = []
        for routing in routings:
            ids.append((self.index << _HOLDER_BITS) | self.serial)
            self.rows[ids[-1]] = routing.to("cpu", self.routing.dtype).contiguous()
            self.serial += 1
        return torch.tensor(ids, dtype=torch.int64)

    def release(self, ids: Iterable[int]) -> None:
        """Drop the routings of rows no longer needed (ids any process may hold: each drops its own)."""
        for row_id in ids:
            self.rows.pop(int(row_id), None)

    def keep_only(self, ids: Iterable[int]) -> None:
        """Drop every routing but those of `ids` (the batch's rows and the carried groups', once the batch is dealt)."""
        kept = {int(row_id) for row_id in ids}
        self.rows = {row_id: routing for row_id, routing in self.rows.items() if row_id in kept}

    def fetch(self, wanted: Sequence[Sequence[int]], last_use: bool = True) -> list[torch.Tensor | None]:
        """This process's rows' routings, in the order of `wanted[self.index]`, where `wanted[p]` lists the ids of
        process p's rows (every process passes the same lists; `NO_ROUTING` gives None). Collective: each process
        sends the routings it holds to the processes whose rows they are, `rows_per_round` per pair and round, and
        drops what it sent when this is the rows' `last_use` (a micro-batch trains once per PPO epoch,
        `num_iterations`: it keeps its routings on the shelf until its last)."""
        mine = [int(row_id) for row_id in wanted[self.index]]
        if self.processes == 1:
            take = self.rows.pop if last_use else self.rows.__getitem__
            self._require_held(row_id for row_id in mine if row_id != NO_ROUTING)
            return [None if row_id == NO_ROUTING else take(row_id) for row_id in mine]
        pairs = [[[] for _ in range(self.processes)] for _ in range(self.processes)]  # [holder][consumer] -> ids
        for consumer, ids in enumerate(wanted):
            for row_id in ids:
                if int(row_id) != NO_ROUTING:
                    pairs[self.holder(int(row_id))][consumer].append(int(row_id))
        longest = max(len(ids) for row in pairs for ids in row)
        received: dict[int, torch.Tensor] = {}
        for start in range(0, longest, self.rows_per_round):
            window = slice(start, start + self.rows_per_round)
            sends = [ids[window] for ids in pairs[self.index]]
            receives = [pairs[holder][self.index][window] for holder in range(self.processes)]
            received.update(self._exchange_round(sends, receives))
            if last_use:
                self.release(row_id for ids in sends for row_id in ids)
        return [None if row_id == NO_ROUTING else received[row_id] for row_id in mine]

    def _require_held(self, ids: Iterable[int]) -> None:
        """Every row of `ids` has its routing on this shelf, or the error names the first missing ones."""
        missing = [row_id for row_id in ids if row_id not in self.rows]
        if missing:
            raise RuntimeError(f"routing replay: process {self.index} holds no routing for rows {missing[:5]}")

    def _exchange_round(self, sends: list[list[int]], receives: list[list[int]]) -> dict[int, torch.Tensor]:
        """One all-to-all round: first each row's token count, then the routings as bytes."""
        self._require_held(row_id for ids in sends for row_id in ids)
        counts = [self.rows[row_id].size(0) for ids in sends for row_id in ids]
        sizes = [len(ids) for ids in sends], [len(ids) for ids in receives]
        got = self.exchange(torch.tensor(counts, dtype=torch.int64), *sizes).tolist()
        width = self.routing.bytes_per_token
        payload = [self.rows[row_id].view(-1).view(torch.uint8) for ids in sends for row_id in ids]
        send_bytes = [sum(part) * width for part in _split(counts, sizes[0])]
        receive_counts = _split(got, sizes[1])
        receive_bytes = [sum(part) * width for part in receive_counts]
        flat = torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8)
        data = self.exchange(flat, send_bytes, receive_bytes)
        shape, out, offset = (self.routing.layers, self.routing.top_k), {}, 0
        for ids, counts in zip(receives, receive_counts, strict=True):
            for row_id, tokens in zip(ids, counts, strict=True):
                size = tokens * width
                out[row_id] = data[offset : offset + size].clone().view(self.routing.dtype).view(tokens, *shape)
                offset += size
        return out

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"rows": dict(self.rows), "serial": self.serial}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        self.rows, self.serial = dict(state["rows"]), max(self.serial, int(state["serial"]))

    same_processes_because = "it carries groups whose routings each process holds for its own rows"

    @staticmethod
    def needs_same_processes(state: dict[str, Any]) -> bool:
        """Carried groups' routings are held by the process that scored them: only as many processes resume them."""
        return bool(state["rows"])


def _split(values: list[int], lengths: list[int]) -> list[list[int]]:
    """`values` cut into consecutive parts of `lengths`."""
    return [values[start:stop] for start, stop in itertools.pairwise([0, *itertools.accumulate(lengths)])]


def rows_per_round(micro_batch_rows: int, processes: int) -> int:
    """Rows each pair of processes exchanges per round: a process receives about a micro-batch's rows a round."""
    return max(1, math.ceil(micro_batch_rows / processes))
