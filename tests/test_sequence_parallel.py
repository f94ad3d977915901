"""Ulysses sequence parallelism (`sequence_parallel_size`): the pieces on one process, exactness on two.

On two real gloo processes, fp32, SP = 2 must give the per-token log-probs, the loss and every parameter's
gradient of a plain forward without sequence parallelism (`scripts/sequence_parallel_run.py`), with KV heads divisible
by 2 and with one KV head (replicated). Trainer-level runs (2-step dynamic sampling under DDP, one ZeRO-3 step under a
token budget) live beside their SP = 1 counterparts in test_padding_free and test_deepspeed.
"""

import json
import math

import pytest
import torch
from transformers import Qwen2Config

from dapo_trl.training.step.packing import IGNORE_INDEX, pack_rows, unpack_per_token
from dapo_trl.training.step.sequence_parallel import (
    check_sequence_parallel,
    group_pass_rows,
    segment_causal_attention,
    shard_packed,
    valid_sizes,
)

from .helpers import SCRIPTS, python_command, run_command


def qwen_config(query_heads: int = 40, kv_heads: int = 8, attention: str = "sdpa") -> Qwen2Config:
    config = Qwen2Config(hidden_size=query_heads * 16, num_attention_heads=query_heads, num_key_value_heads=kv_heads)
    config._attn_implementation = attention
    return config


def test_valid_sizes_follow_the_head_counts():
    assert valid_sizes(40, 8, 8) == [1, 2, 4, 8]  # Qwen2.5-32B on 8 GPUs
    assert valid_sizes(28, 4, 8) == [1, 2, 4]  # Qwen2.5-7B: 28 query heads rule out 8
    assert valid_sizes(4, 1, 4) == [1, 2, 4]  # one KV head: replicated to any size
    assert valid_sizes(12, 3, 4) == [1]  # 3 KV heads: neither 2 nor 4 fits


@pytest.mark.parametrize(
    "size,config,world,distributed,fix",
    [
        (3, qwen_config(), 4, "MULTI_GPU", "choose one of [1, 2, 4]"),
        (3, qwen_config(28, 4), 8, "MULTI_GPU", "choose one of [1, 2, 4] (the sizes this model"),  # not 8: 28 heads
        (8, qwen_config(28, 4), 8, "DEEPSPEED", "Valid sizes with 8 processes: [1, 2, 4]"),
        (2, qwen_config(attention="flex_attention"), 2, "DEEPSPEED", "attn_implementation='flash_attention_2'"),
        (2, qwen_config(attention="eager"), 2, "DEEPSPEED", "or 'sdpa'"),
        (2, qwen_config(), 2, "FSDP", "not FSDP"),
    ],
    ids=["world-size", "world-size-and-heads", "heads", "attention-mixing-rows", "eager", "fsdp"],
)
def test_refusals_name_the_fix(size, config, world, distributed, fix):
    with pytest.raises(ValueError, match="sequence_parallel_size") as error:
        check_sequence_parallel(size, config, world, distributed)
    assert fix in str(error.value)


def test_hybrid_and_sliding_window_models_are_refused():
    config = qwen_config(kv_heads=8)
    config.layer_types = ["linear_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match=r"cannot shard this model's \['linear_attention'\] layers"):
        check_sequence_parallel(2, config, 2, "DEEPSPEED")
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="sliding-window attention layers needs"):
        check_sequence_parallel(2, config, 2, "DEEPSPEED")
    config._attn_implementation = "flash_attention_2"
    assert check_sequence_parallel(2, config, 2, "DEEPSPEED") == "flash_attention_2"


def test_flash_attention_is_accepted():
    assert check_sequence_parallel(2, qwen_config(attention="flash_attention_2"), 4, "DEEPSPEED") == "flash_attention_2"


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"sequence_parallel_size": 2, "padding_free": False}, "needs padding_free=true"),
        ({"sequence_parallel_size": 2, "use_liger_kernel": True}, "use_liger_kernel=false"),
        ({"sequence_parallel_size": 0}, "must be an integer >= 1"),
    ],
)
def test_config_refusals(tmp_path, overrides, message):
    from .helpers import tiny_config

    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, **overrides)


def test_shards_keep_each_boundary_tokens_next_label():
    """Labels are shifted before the cut: concatenated shards score exactly what one unsharded forward scores."""
    ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    packed = pack_rows(ids, mask, logits_to_keep=3, pad_token_id=0)  # 8 tokens, one sequence
    length = packed.input_ids.size(1)
    for size in (2, 3):
        shards = [shard_packed(packed, size, rank, pad_token_id=0) for rank in range(size)]
        assert len({shard[0].size(1) for shard in shards}) == 1  # equal shards
        joined = [torch.cat([shard[part] for shard in shards], dim=1) for part in range(3)]
        assert joined[0].size(1) == math.ceil(length / size) * size
        assert torch.equal(joined[0][:, :length], packed.input_ids)
        assert torch.equal(joined[1][:, :length], packed.position_ids)
        expected = torch.cat([packed.labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
        assert torch.equal(joined[2][:, :length], expected)
        assert (joined[2][:, length:] == IGNORE_INDEX).all()  # padding never scored
        real = torch.cat([shard[3] for shard in shards], dim=1)  # the real-token mask (router loads count these)
        assert torch.equal(real[:, :length], packed.real_tokens()) and not real[:, length:].any()
        assert torch.equal(joined[1][:, length:], torch.arange(joined[1].size(1) - length)[None])  # its own block
    # A score at position j of the shifted labels is token j + 1's: what unpack_per_token expects.
    scores = torch.arange(length - 1, dtype=torch.float)[None] + 1.0
    out = unpack_per_token(packed, scores, logits_to_keep=3)
    # Row 1 (longest) is packed first, at 0..4; row 0's tokens 5, 6, 7 at 5..7, its completion columns hold 6, 7, pad.
    assert out.tolist() == [[6.0, 7.0, 0.0], [2.0, 3.0, 4.0]]


def test_passes_are_planned_over_the_group_rows():
    """A budget of 10 per process is 20 per pass of a group of 2: each long row alone (the other process runs a masked
    row), short rows packed together; both processes derive the same passes."""
    members = [[30, 4, 6], [25, 3, 9]]  # token counts of each process's rows
    plans = [group_pass_rows(members, rank, 20) for rank in range(2)]
    assert plans[0] == [[0], [], [1, 2], []] and plans[1] == [[], [0], [2], [1]]  # first-fit decreasing: 9+6+4, 3
    for chunk in zip(*plans, strict=True):  # every pass but the long rows' holds at most 20 tokens
        tokens = sum(members[rank][row] for rank, rows in enumerate(chunk) for row in rows)
        assert tokens <= 20 or sum(map(len, chunk)) == 1


def test_segment_attention_keeps_packed_rows_apart():
    """Row-by-row causal SDPA on a packed sequence equals each row's own causal attention, with grouped KV heads."""
    torch.manual_seed(0)
    lengths = [3, 5, 1, 4]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    query, key, value = torch.randn(1, 4, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    out, _ = segment_causal_attention(torch.nn.Module(), query, key, value, None, scaling=0.5, position_ids=positions)
    start = 0
    for n in lengths:
        q, k, v = query[0, :, start : start + n], key[0, :, start : start + n], value[0, :, start : start + n]
        k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
        scores = (q @ k.transpose(-1, -2)) * 0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        expected = (scores.softmax(-1) @ v).transpose(0, 1)  # (n, heads, dim)
        torch.testing.assert_close(out[0, start : start + n], expected, atol=1e-6, rtol=1e-5)
        start += n


def test_attention_runs_unchanged_outside_a_sharded_forward():
    """The dispatch routes attention through Ulysses only inside `sharded()`: generation and other models keep it."""
    from transformers import Qwen2ForCausalLM

    from dapo_trl.training.step import sequence_parallel

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, 50, (2, 7))
    before = model(input_ids=ids).logits
    sequence_parallel._install_dispatch("sdpa")
    assert "sdpa" in sequence_parallel._INSTALLED and not sequence_parallel._ACTIVE
    torch.testing.assert_close(model(input_ids=ids).logits, before, atol=0, rtol=0)


@pytest.mark.e2e
def test_two_processes_equal_one_without_sequence_parallelism(tmp_path):
    """KV heads divisible by 2, and a single KV head (replicated), in one launch; then a mixture-of-experts model's
    router auxiliary loss over the sharded sequence equals the model's own over the unsharded rows, gradients too."""
    command = python_command(str(SCRIPTS / "sequence_parallel_run.py"), str(tmp_path), "2,1,moe", num_processes=2)
    run_command(command)
    for rank in range(2):
        moe = json.loads((tmp_path / f"result_moe_rank{rank}.json").read_text())
        assert moe["aux_loss"] > 1.0 and moe["aux_loss_error"] < 1e-5
        assert moe["router_gradient_error"] < 1e-5 < moe["router_gradient_scale"]
    for kv_heads, rank in [(2, 0), (2, 1), (1, 0), (1, 1)]:
        result = json.loads((tmp_path / f"result_kv{kv_heads}_rank{rank}.json").read_text())
        assert result["logps_error"] < 1e-5 and result["loss_error"] < 1e-5
        assert result["gradient_error"] < 1e-5 < result["gradient_scale"]
        assert result["odd_length"] and result["row_straddles_boundary"] and result["shard_without_loss_token"]
        assert result["kv_replicated"] == (kv_heads == 1)
        assert result["groups_restored"]  # Ulysses' KV replication does not leak into later forwards
