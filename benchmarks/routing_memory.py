"""Where routing replay's routings live: the host memory each process holds for them through one generation batch.

What is measured
----------------
`--processes` gloo processes (CPU) run routing replay's own code on a DAPO-shaped batch with a real model's routing
geometry (Qwen3-30B-A3B: 48 decoder layers x 8 experts, 1 byte each, 384 B a token): each scores its share of every
dynamic-sampling round (in 4 waves, as the streaming rollout scores a round) and shelves the rows' routings
(`training.step.routing_shelf.RoutingShelf`), dynamic sampling drops the groups without spread (`--keep-rate`) and the
shelf frees them, the kept rows are dealt to the processes in global order (each process's block, as
`batching.process_share` deals them) and split into `--micro-batches`, the shelves keep the batch's rows
(`ReplayedRouting.settle`), and each micro-batch in turn fetches its rows' routings from the processes that scored them
(`ReplayedRouting.fetch`: all-to-all over gloo) as the host tensors it trains with, padded to its longest row, then
trains and drops them. With `--lengths uniform` every completion is `--tokens` long, the worst case the docs' figure
assumes; `--lengths lognormal` draws DAPO-like lengths (median `--tokens` / 6.7, as 3k of 20k, capped at `--tokens`).
The defaults are DAPO's batch (512 prompts x 16, 16 updates per rollout) on 8 processes with responses shortened to
64 tokens: the bytes scale with the length, the ratios do not.

Reported per process: the peak of the routing bytes it holds (its shelf plus the micro-batch it fetched, sampled after
every step of the above) against its share of the batch's routing (the batch's real tokens / processes); what it held
when every micro-batch fetched at the deal, padded to the batch's widest row (the previous release: its micro-batches
then); and what gathering the rows to every process (the first design) held: the whole batch's routing, on the
accelerator. Then the DAPO batch (512 x 16 x 20k tokens) at the measured ratio, per process count.

    python benchmarks/routing_memory.py [--processes 8] [--prompts 512] [--tokens 64] [--micro-batches 16]
    python benchmarks/routing_memory.py --lengths lognormal --tokens 200
    python benchmarks/routing_memory.py --quick    # 2 processes, 8 prompts x 16 x 64 tokens: a check
"""

from __future__ import annotations

import argparse
import math
import os
import socket
from types import SimpleNamespace

LAYERS, TOP_K, EXPERTS = 48, 8, 128  # Qwen3-30B-A3B
DAPO_BATCH_TOKENS = 512 * 16 * 20_000
GROUP = 16
WAVES_PER_ROUND = 4  # rollout_stream.MAX_WAVES_PER_ROUND
PROMPT_TOKENS = 64


def worker(rank: int, settings: dict, results: dict) -> None:
    import torch

    from dapo_trl.moe.architecture import Routing
    from dapo_trl.training.step.replayed_routing import COMPLETION_ROUTING, PROMPT_ROUTING, ReplayedRouting
    from dapo_trl.training.step.routing_shelf import ROUTING_ID, RoutingShelf, all_to_all_exchange, rows_per_round

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(settings["port"]))
    processes, tokens, micro_batches = settings["processes"], settings["tokens"], settings["micro_batches"]
    torch.distributed.init_process_group("gloo", rank=rank, world_size=processes)
    routing = Routing(LAYERS, TOP_K, EXPERTS)
    rows_per_micro_batch = settings["prompts"] * GROUP // processes // micro_batches
    shelf = RoutingShelf(
        routing,
        rank,
        processes,
        all_to_all_exchange(torch.device("cpu")),
        rows_per_round(rows_per_micro_batch, processes),
    )
    replayed = ReplayedRouting(SimpleNamespace(routing=routing), shelf)
    generator = torch.Generator().manual_seed(rank)
    held: list[dict] = []
    peak = 0

    def completion_length() -> int:
        if settings["lengths"] == "uniform":
            return tokens
        median = tokens / 6.7
        drawn = torch.empty(1).log_normal_(math.log(median), 1.0, generator=generator)
        return max(1, min(tokens, round(float(drawn))))

    def sample() -> None:
        nonlocal peak
        batches = sum(
            batch[key].nbytes for batch in held for key in (PROMPT_ROUTING, COMPLETION_ROUTING) if key in batch
        )
        peak = max(peak, shelf.nbytes + batches)

    def gather_objects(items: list) -> list:
        """Every process's `items[0]`, in process order (the trainer's `Process.gather_objects`)."""
        gathered = [None] * processes
        torch.distributed.all_gather_object(gathered, items[0])
        return gathered

    kept_ids: list[list[int]] = []  # global order: each round's rows, process by process
    row_tokens: dict[int, int] = {}  # this process's rows' completion lengths
    target_groups, groups_per_round = settings["prompts"], settings["prompts"]
    round_index = 0
    while sum(len(ids) for ids in kept_ids) < target_groups * GROUP:
        local_groups = groups_per_round // processes
        for wave in range(WAVES_PER_ROUND):  # the streaming rollout scores a round in at most 4 waves
            wave_groups = local_groups // WAVES_PER_ROUND
            lengths = [completion_length() for _ in range(wave_groups * GROUP)]
            routings = [  # vLLM records every token but the last sampled one
                torch.randint(
                    0, EXPERTS, (PROMPT_TOKENS + n - 1, LAYERS, TOP_K), generator=generator, dtype=torch.int32
                )
                for n in lengths
            ]
            ids = shelf.put([(routing_ids + 1).to(routing.dtype) for routing_ids in routings])
            row_tokens.update(zip(ids.tolist(), lengths, strict=True))
            sample()
            seed = torch.Generator().manual_seed(1000 * (WAVES_PER_ROUND * round_index + wave) + rank)
            row_kept = (torch.rand(wave_groups, generator=seed) < settings["keep_rate"]).repeat_interleave(GROUP)
            shelf.release(ids[~row_kept].tolist())
            kept_ids.extend(gather_objects([ids[row_kept].tolist()]))
            if sum(len(ids) for ids in kept_ids) >= target_groups * GROUP:
                break  # the batch is full: the stream cuts the round here (its later waves are not generated)
        round_index += 1
    batch = [row_id for ids in kept_ids for row_id in ids][: target_groups * GROUP]
    shelf.release(set(shelf.rows) - set(batch))  # the surplus beyond the batch: discarded (carried would stay)
    lengths = {row_id: n for part in gather_objects([row_tokens]) for row_id, n in part.items()}
    share = len(batch) // processes
    mine = batch[rank * share : (rank + 1) * share]
    widest = max(lengths[row_id] for row_id in batch)  # every micro-batch padded to it, when fetched at the deal
    micro = []
    for part in torch.tensor(mine).chunk(micro_batches):
        completion = torch.zeros(part.numel(), max(lengths[row_id] for row_id in part.tolist()), dtype=torch.long)
        for row, row_id in enumerate(part.tolist()):
            completion[row, : lengths[row_id]] = 1
        prompt = torch.ones(part.numel(), PROMPT_TOKENS, dtype=torch.long)
        micro.append({ROUTING_ID: part, "prompt_mask": prompt, "completion_mask": completion})

    replayed.settle(micro, None, gather_objects)
    sample()
    for micro_batch in micro:  # each micro-batch fetched as it trains, then dropped
        held.append(replayed.fetch(micro_batch, gather_objects))
        sample()
        held.clear()
    bytes_per_token = routing.bytes_per_token
    real_tokens = sum(PROMPT_TOKENS + lengths[row_id] - 1 for row_id in batch)
    results[rank] = {
        "peak": peak,
        "share": real_tokens * bytes_per_token / processes,
        "padded": len(mine) * (PROMPT_TOKENS + widest) * bytes_per_token,
        "batch": len(batch) * (PROMPT_TOKENS + widest) * bytes_per_token,  # row tensors at the batch's width
        "rounds": round_index,
    }
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 processes, 8 prompts x 16 x 64 tokens: a check")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=512, help="prompts per generation batch (x 16 completions)")
    parser.add_argument("--tokens", type=int, default=64, help="every completion's length")
    parser.add_argument("--micro-batches", type=int, default=16, help="optimizer updates per generation batch")
    parser.add_argument("--keep-rate", type=float, default=0.5, help="share of groups dynamic sampling keeps")
    parser.add_argument("--lengths", choices=("uniform", "lognormal"), default="uniform", help="completion lengths")
    args = parser.parse_args()
    if args.quick:
        args.processes, args.prompts, args.tokens = 2, 8, 64
    import torch.multiprocessing

    import dapo_trl.training.step.replayed_routing  # noqa: F401 - imported once: the forked workers inherit it

    settings = {**vars(args), "port": free_port()}
    results = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.start_processes(
        worker, args=(settings, results), nprocs=args.processes, join=True, start_method="fork"
    )
    mib = 2**20
    batch = results[0]["batch"]
    print(
        f"{args.processes} processes, {args.prompts} prompts x {GROUP} x {args.tokens} tokens ({args.lengths}, "
        f"+{PROMPT_TOKENS} prompt), "
        f"Qwen3-30B-A3B routing ({LAYERS} x {TOP_K}, 1 B), keep rate {args.keep_rate}, {args.micro_batches} "
        f"micro-batches, {results[0]['rounds']} rounds\n"
    )
    print(
        "| process | peak routing bytes held (MiB) | its share (MiB) | peak / share "
        "| fetched at the deal, padded (MiB) | gathered to every process (MiB) |"
    )
    print(
        "|--------:|------------------------------:|----------------:|-------------:"
        "|----------------------------------:|--------------------------------:|"
    )
    ratios = []
    for rank in range(args.processes):
        result = results[rank]
        ratios.append(result["peak"] / result["share"])
        print(
            f"| {rank:>7} | {result['peak'] / mib:>29.1f} | {result['share'] / mib:>15.1f} | {ratios[-1]:>12.2f} |"
            f" {result['padded'] / mib:>33.1f} | {batch / mib:>31.1f} |"
        )
    dapo = DAPO_BATCH_TOKENS * LAYERS * TOP_K / 2**30
    worst = max(ratios)
    print(
        f"\nthe DAPO batch (512 x 16 x 20k tokens, {dapo:.1f} GiB of Qwen3-30B-A3B routing) at peak / share "
        f"{worst:.2f}:\n"
    )
    print("| processes | host memory per process (GiB) | on the accelerator |")
    print("|----------:|------------------------------:|--------------------|")
    for processes in (8, 16, 32, 64):
        print(f"| {processes:>9} | {dapo / processes * worst:>29.1f} | one pack's routing |")


if __name__ == "__main__":
    main()
