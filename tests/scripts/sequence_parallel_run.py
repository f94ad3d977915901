"""Ulysses sequence parallelism against a plain forward, on two real processes (gloo, fp32).

Run under `accelerate launch --multi_gpu --num_processes 2`:
  python sequence_parallel_run.py OUT CASE[,CASE...]     (CASE: a KV head count, or moe)
Each process holds its own rows (TRL's layout: prompts left-padded, completions right-padded; odd lengths; one row
longer than half the group's tokens, so it straddles the shard boundary, and a long prompt first, so shard 0 holds
no loss token). The group's per-token log-probs come from `SequenceParallel.per_token` (DeepSpeed's Ulysses
attention, the model wrapped in DDP, with activation checkpointing), the loss is DAPO's token-level sum over the
process's rows divided by the tokens of all processes (times the process count, as TRL's normaliser), and DDP
averages the gradients. The reference is an independent padded forward of every process's rows on one process,
without sequence parallelism. Writes OUT/result_kv{k}_rank{r}.json: the largest log-prob, loss and gradient differences,
and which cases the batch covered. Case moe: a tiny Qwen3-MoE's router auxiliary loss over the group's sharded
sequence against the model's own (transformers' load_balancing_loss_func) over the group's rows in one padded
forward, and the router weights' gradients of the two; writes OUT/result_moe_rank{r}.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl.trainer.utils import add_fused_lm_head

from dapo_trl.algorithm.router_aux import router_load
from dapo_trl.moe.routing_replay import RouterHooks
from dapo_trl.training.step.packing import pack_rows
from dapo_trl.training.step.sequence_parallel import SequenceParallel, shard_packed

VOCAB = 97
PAD = 0


def build_model(kv_heads: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).float()


def rows_of(rank: int) -> dict[str, torch.Tensor]:
    """(prompt length, completion length) per row; rank 0's first row has a long prompt (packed first: longest)."""
    shapes = [[(41, 3), (3, 8), (5, 2)], [(2, 7), (4, 4)]][rank]
    generator = torch.Generator().manual_seed(100 + rank)
    prompt_width, keep = max(p for p, _ in shapes), max(c for _, c in shapes) + rank  # widths differ by process
    ids = torch.full((len(shapes), prompt_width + keep), PAD)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(shapes):
        span = slice(prompt_width - prompt, prompt_width + completion)
        ids[row, span] = torch.randint(1, VOCAB, (prompt + completion,), generator=generator)
        mask[row, span] = 1
    completion_mask = mask[:, prompt_width:].clone()
    completion_mask[0, -1:] = 0  # a scored position masked out of the loss (a tool reply)
    advantages = torch.randn(len(shapes), generator=generator)
    return {"ids": ids, "mask": mask, "keep": keep, "completion_mask": completion_mask, "advantages": advantages}


def reference_logps(model, ids: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
    """A padded forward with the attention mask: per-token log-probs of the last `keep` columns."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -keep - 1 : -1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)
    return logps * mask[:, -keep:]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for case in sys.argv[2].split(","):
        compare_router_aux_loss(out) if case == "moe" else compare(out, int(case))
    dist.barrier()  # leave together (see script_args.leave_together): a lone exit can abort the peer's gloo
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def sharded_per_token(sp: SequenceParallel, mine: dict, shard_forward) -> tuple:
    """The group's sharded forward of this process's rows (no budget: one pass), as the trainer runs it."""

    def unused_padded_forward(*args):
        raise AssertionError("every group here has rows")

    return sp.per_token(
        mine["ids"],
        mine["mask"],
        mine["keep"],
        shard_forward=shard_forward,
        padded_forward=unused_padded_forward,
        max_tokens=None,
        max_rows=None,
        pad_token_id=PAD,
        agree_count=None,
        one_forward=False,
    )


def compare(out: Path, kv_heads: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(kv_heads)
    model.gradient_checkpointing_enable({"use_reentrant": False})  # recomputation must shard the same way
    model.train()
    add_fused_lm_head(model)
    reference = build_model(kv_heads)
    sp = SequenceParallel(2, model.config, "sdpa")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    mine = rows_of(rank)
    everyone = [rows_of(r) for r in range(world)]
    total_tokens = sum(float(rows["completion_mask"].sum()) for rows in everyone)

    def shard_forward(ids, positions, labels, attention, real):
        out = ddp(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True, **attention)
        return out.log_probs, None, None

    logps, _, _ = sharded_per_token(sp, mine, shard_forward)
    loss = -(logps * mine["advantages"][:, None] * mine["completion_mask"]).sum() / total_tokens * world
    loss.backward()

    expected_logps = reference_logps(reference, mine["ids"], mine["mask"], mine["keep"])
    expected_loss = -(expected_logps * mine["advantages"][:, None] * mine["completion_mask"]).sum() / total_tokens
    full = (
        sum(
            -(
                reference_logps(reference, rows["ids"], rows["mask"], rows["keep"])
                * rows["advantages"][:, None]
                * rows["completion_mask"]
            ).sum()
            for rows in everyone
        )
        / total_tokens
    )
    full.backward()
    gradient_error = max(
        float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )

    # Which cases the group's packed sequence covered (rank 0's layout decides them: the same on both processes).
    group = sp.gather_rows(mine["ids"], mine["mask"], mine["keep"])
    packed = pack_rows(group.input_ids, group.attention_mask, group.logits_to_keep, None, PAD)
    length = packed.input_ids.size(1)
    shards = [shard_packed(packed, 2, r, PAD) for r in range(2)]
    starts = (packed.position_ids[0] == 0).nonzero().flatten().tolist() + [length]
    boundary = shards[0][0].size(1)
    result = {
        "logps_error": float((logps.detach() - expected_logps.detach()).abs().max()),
        "loss_error": abs(loss.item() / world - expected_loss.item()),
        "gradient_error": gradient_error,
        "gradient_scale": max(float(p.grad.abs().max()) for p in reference.parameters()),
        "odd_length": length % 2 == 1,
        "row_straddles_boundary": any(s < boundary < e for s, e in zip(starts[:-1], starts[1:], strict=True)),
        "shard_without_loss_token": any(bool((shard[2] == -100).all()) for shard in shards),
        "kv_replicated": sp.ulysses.kv_replication_factor > 1,
        "groups_restored": all(
            layer.self_attn.num_key_value_groups == model.config.num_attention_heads // kv_heads
            for layer in model.model.layers
        ),
    }
    (out / f"result_kv{kv_heads}_rank{rank}.json").write_text(json.dumps(result))


def build_moe_model() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        output_router_logits=True,
        attn_implementation="sdpa",
    )
    return Qwen3MoeForCausalLM(config).float()


def compare_router_aux_loss(out: Path) -> None:
    rank = dist.get_rank()
    model, reference = build_moe_model(), build_moe_model()
    model.train()
    add_fused_lm_head(model)
    hooks = RouterHooks(model)
    sp = SequenceParallel(2, model.config, "sdpa")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    mine = rows_of(rank)

    def shard_forward(ids, positions, labels, attention, real):
        hooks.collect, hooks.collected = True, []
        try:
            out = ddp(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True, **attention)
        finally:
            hooks.collect = False
        return out.log_probs, None, router_load(hooks.collected, 2, real)

    logps, _, aux_loss = sharded_per_token(sp, mine, shard_forward)
    (aux_loss + 0.0 * logps.sum()).backward()  # DDP averages the two processes' router gradients

    group = sp.gather_rows(mine["ids"], mine["mask"], mine["keep"])
    positions = (group.attention_mask.cumsum(1) - 1).clamp(min=0)
    expected = reference(input_ids=group.input_ids, attention_mask=group.attention_mask, position_ids=positions)
    expected = expected.aux_loss
    expected.backward()
    routers = [(name, p) for name, p in model.named_parameters() if ".mlp.gate." in name]
    reference_routers = dict(reference.named_parameters())
    result = {
        "aux_loss": aux_loss.item(),
        "aux_loss_error": abs(aux_loss.item() - expected.item()),
        "router_gradient_error": max(float((p.grad - reference_routers[n].grad).abs().max()) for n, p in routers),
        "router_gradient_scale": max(float(reference_routers[n].grad.abs().max()) for n, _ in routers),
    }
    (out / f"result_moe_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
