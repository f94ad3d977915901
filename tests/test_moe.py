"""Mixture-of-experts policies: the built-in tiny MoE, routing replay (bit-identity, sensitivity, activation
checkpointing, agreement), the router's auxiliary loss from additive router loads (against transformers' own and an
independent reference written from the Switch Transformer paper), vLLM's routed-experts answer, ZeRO-3 leaf modules,
and the refusals. The end-to-end runs live beside the features they extend: routing replay through a fake engine,
crash and resume under two-process ZeRO-3 (test_rollout_streaming.py), the auxiliary loss under sequence parallelism
(test_sequence_parallel.py)."""

import base64
import io
import types
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from dapo_trl.algorithm.router_aux import RouterLoad, load_balancing_loss, router_load
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.moe.architecture import (
    Routing,
    is_moe,
    moe_block_classes,
    routers,
    routing_geometry,
    set_zero3_leaf_modules,
)
from dapo_trl.moe.routing_replay import ROUTING_KWARG, RouterHooks, encode_routing, routing_from_rows, score_rule
from dapo_trl.training.rollout.rollout_engine import GroupResult
from dapo_trl.training.rollout.server_answers import _routed_experts
from dapo_trl.training.step.packing import pack_rows, padding_free_per_token

from .helpers import tiny_config


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", architecture="moe")


@pytest.fixture
def moe(moe_dir):
    return AutoModelForCausalLM.from_pretrained(moe_dir).eval()


def rows(seed: int = 0):
    """TRL's layout: prompts left-padded, completions right-padded; three rows of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    shapes, prompt_width, keep = [(5, 4), (2, 6), (7, 2)], 7, 6
    ids = torch.zeros(3, prompt_width + keep, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(shapes):
        span = slice(prompt_width - prompt, prompt_width + completion)
        ids[row, span] = torch.randint(3, 700, (prompt + completion,), generator=generator)
        mask[row, span] = 1
    return ids, mask, keep


def recorded_routing(model, call) -> list[torch.Tensor]:
    """The top-k indices each router chose during `call()` (an independent recorder, not `RouterHooks`)."""
    chosen = []
    handles = [router.module.register_forward_hook(lambda m, a, o: chosen.append(o[2])) for router in routers(model)]
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return chosen


def packed_log_probs(model, ids, mask, keep, routing=None):
    """Per-token log-probs through the padding-free packed path (bins), optionally replaying `routing`."""

    def packed_forward(packed):
        extra = {} if packed.routing is None else {ROUTING_KWARG: packed.routing}
        # use_cache=False: with a cache, transformers does not read packed rows from the position ids
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **extra).logits
        logits = logits[:, :-1]
        labels = packed.labels[:, 1:]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
        return logps * (labels != -100), None, None

    def unused(*args):
        raise AssertionError("packed only")

    logps, _, _ = padding_free_per_token(
        ids,
        mask,
        keep,
        packed_forward=packed_forward,
        padded_forward=unused,
        max_tokens=12,
        max_rows=None,
        routing=routing,
    )
    return logps


# --------------------------------------------------------------------------------------------- the tiny MoE
def test_builtin_tiny_moe_is_a_qwen3_moe_with_the_dense_models_tokenizer(moe_dir, tmp_path):
    config = AutoModelForCausalLM.from_pretrained(moe_dir).config
    assert config.model_type == "qwen3_moe" and config.head_dim == 32  # vLLM-CPU refuses head_dim 16
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert is_moe(model) and [cls.__name__ for cls in moe_block_classes(model)] == ["Qwen3MoeSparseMoeBlock"]
    assert routing_geometry(model) == Routing(layers=2, top_k=2, num_experts=8)
    dense = build_tiny_model(tmp_path / "dense")
    assert not is_moe(AutoModelForCausalLM.from_pretrained(dense))
    assert (dense / "tokenizer.json").read_text() == (moe_dir / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="holds the tiny moe model, not the dense one"):
        build_tiny_model(moe_dir)


# -------------------------------------------------------------------------------------------- routing replay
def test_replaying_its_own_routing_gives_the_policys_log_probs_bit_for_bit(moe):
    """Recorded from a packed forward, carried in the rows' layout, replayed through packing: the same bits."""
    hooks = RouterHooks(moe)
    ids, mask, keep = rows()
    with torch.no_grad():
        own = []
        expected = packed_log_probs_recording(moe, ids, mask, keep, own)
        routing = torch.stack(own, dim=-2)  # (rows, width, layers, top-k) in the rows' layout
        replayed = packed_log_probs(moe, ids, mask, keep, routing)
    assert torch.equal(replayed, expected)
    assert hooks.take_agreement() == 1.0

    perturbed = routing.clone()
    real = mask.nonzero()
    row, column = real[0].tolist()  # row 0's first prompt token: every later token of its row attends to it
    unchosen = [expert for expert in range(1, 9) if expert not in perturbed[row, column, 0].tolist()]
    perturbed[row, column, 0] = torch.tensor(unchosen[:2], dtype=routing.dtype)
    with torch.no_grad():
        changed = packed_log_probs(moe, ids, mask, keep, perturbed)
    assert not torch.equal(changed, expected)
    others = torch.arange(3) != row
    torch.testing.assert_close(changed[others], expected[others], atol=1e-6, rtol=0)  # packed rows stay apart
    assert hooks.take_agreement() < 1.0


def packed_log_probs_recording(model, ids, mask, keep, own: list) -> torch.Tensor:
    """`packed_log_probs` without replay, appending each router's choices (+1, in the rows' layout) to `own`."""
    captured = []

    def call():
        captured.append(packed_log_probs(model, ids, mask, keep))

    chosen = recorded_routing(model, call)
    assert len(chosen) % 2 == 0
    # One packed forward per chunk: map each chunk's bin positions back to its rows' real tokens.
    lengths = mask.sum(1).tolist()
    from dapo_trl.training.step.packing import balanced_chunks, bin_forwards

    units = [unit for chunk in balanced_chunks(lengths, 12) for unit in bin_forwards(chunk, lengths)]
    per_layer = [torch.zeros(*ids.shape, 2, dtype=torch.uint8) for _ in range(2)]
    for unit_index, (chunk, capacity) in enumerate(units):
        index = torch.tensor(chunk)
        packed = pack_rows(ids[index], mask[index], keep, capacity)
        for layer in range(2):
            flat = chosen[unit_index * 2 + layer]  # (bins x capacity, top-k)
            target = per_layer[layer][index]
            target[mask[index].bool()] = (flat[packed.gather_index] + 1).to(torch.uint8)
            per_layer[layer][index] = target
    own.extend(per_layer)
    return captured[0]


def test_replay_is_recomputed_the_same_under_activation_checkpointing(moe):
    RouterHooks(moe)
    ids = torch.randint(3, 700, (2, 9))
    routing = torch.randint(1, 9, (2, 9, 2, 1), dtype=torch.uint8)
    routing = torch.cat([routing, (routing % 8) + 1], dim=-1)  # two distinct experts per token

    def router_gradient(checkpointing: bool, replay: bool) -> torch.Tensor:
        moe.zero_grad()
        moe.train()
        if checkpointing:
            moe.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            moe.activation_checkpointing_disable()
        extra = {ROUTING_KWARG: routing} if replay else {}
        moe(ids, **extra).logits.float().pow(2).mean().backward()
        return moe.model.layers[0].mlp.gate.weight.grad.clone()

    replayed = router_gradient(checkpointing=False, replay=True)
    assert torch.equal(router_gradient(checkpointing=True, replay=True), replayed)
    assert replayed.abs().sum() > 0  # the router keeps its gradient through the replayed experts' gate weights
    assert not torch.allclose(router_gradient(checkpointing=False, replay=False), replayed)


def test_an_unknown_router_scoring_is_refused_not_guessed():
    logits = torch.randn(4, 8)
    indices = torch.topk(logits, 2).indices
    assert score_rule((logits, torch.softmax(logits, -1).gather(-1, indices), indices), "R") == "softmax, top-k"
    sigmoid = torch.sigmoid(logits).gather(-1, indices)  # DeepSeek-V3's scoring
    with pytest.raises(ValueError, match="DeepseekV3TopkRouter's gate weights.*not supported"):
        score_rule((logits, sigmoid, indices), "DeepseekV3TopkRouter")


def test_routings_are_compact_and_checked():
    routing = Routing(layers=2, top_k=2, num_experts=8)
    encoded = encode_routing(np.array([[[0, 7], [3, 4]]], dtype=np.int32), routing)
    assert encoded.dtype == torch.uint8 and encoded.tolist() == [[[1, 8], [4, 5]]] and routing.bytes_per_token == 4
    assert Routing(layers=48, top_k=8, num_experts=128).bytes_per_token == 384  # Qwen3-30B-A3B
    assert Routing(layers=61, top_k=8, num_experts=256).dtype == torch.int16  # DeepSeek-V3
    with pytest.raises(ValueError, match="outside 0..7"):
        encode_routing(np.array([[[0, 8], [1, 2]]]), routing)
    with pytest.raises(ValueError, match="expected \\(..., 2 layers, 2 experts per token\\)"):
        encode_routing(np.zeros((3, 1, 2), dtype=np.uint8), routing)


def test_a_rows_routing_starts_at_its_first_attended_token():
    """vLLM's routing covers prompt and completion tokens but the last: that one routes itself (0)."""
    routing = Routing(layers=1, top_k=1, num_experts=8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    recorded = [torch.tensor([[[1]], [[2]], [[3]]], dtype=torch.uint8), None]
    out = routing_from_rows(recorded, mask, routing)[..., 0, 0]
    assert out.tolist() == [[0, 0, 1, 2, 3, 0], [0, 0, 0, 0, 0, 0]]


def test_the_engines_routed_experts_ride_with_its_results():
    """vLLM's completions answer: `routed_experts` is base64 of a .npy array (its `numpy2base64`), shape
    (prompt + completion tokens - 1, layers, top-k); absent unless the server records routing."""
    arrays = [np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8, np.zeros((3, 2, 2), dtype=np.uint8)]
    choices = []
    for array in arrays:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        choices.append({"token_ids": [1], "routed_experts": base64.b64encode(buffer.getvalue()).decode("ascii")})
    decoded = _routed_experts(choices)
    assert all(np.array_equal(got, want) for got, want in zip(decoded, arrays, strict=True))
    assert _routed_experts([{"token_ids": [1], "routed_experts": None}]) is None
    result = GroupResult(("stream", 0), 0, [[1, 2], [3]], [[-0.1, -0.2], [-0.3]], routed_experts=decoded)
    assert result.nbytes == 3 * 4 + 3 * 4 + 2 * 8 + 5 * 4 + 3 * 4
    with pytest.raises(ValueError, match="1 routings for 2 completions"):
        GroupResult(("stream", 0), 0, [[1], [2]], [[-0.1], [-0.2]], routed_experts=decoded[:1])


# ------------------------------------------------------------------------------------ router auxiliary loss
def switch_transformer_loss(logits_per_layer, top_k: int, mask) -> float:
    """Switch Transformer Eqs. 4-6 as transformers pools them over layers, written out token by token."""
    experts = logits_per_layer[0].size(-1)
    fraction, probability, rows = [0.0] * experts, [0.0] * experts, 0
    for logits in logits_per_layer:
        for token, token_logits in enumerate(logits):
            if not mask[token]:
                continue
            probs = torch.softmax(token_logits.double(), -1).tolist()
            for expert in sorted(range(experts), key=lambda e: -probs[e])[:top_k]:
                fraction[expert] += 1
            for expert in range(experts):
                probability[expert] += probs[expert]
            rows += 1
    return experts * sum((f / rows) * (p / rows) for f, p in zip(fraction, probability, strict=True))


def test_the_router_load_gives_the_papers_loss_and_adds_up_over_parts():
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(10, 8, generator=generator) for _ in range(2)]
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 0])
    loss = load_balancing_loss(router_load(logits, 2, mask))
    assert loss.item() == pytest.approx(switch_transformer_loss(logits, 2, mask), abs=1e-6)
    transformers_loss = load_balancing_loss_func(tuple(logits), 8, 2, mask[None])
    assert loss.item() == pytest.approx(transformers_loss.item(), abs=1e-6)
    first = router_load([layer[:4] for layer in logits], 2, mask[:4])
    second = router_load([layer[4:] for layer in logits], 2, mask[4:])
    assert isinstance(first + second, RouterLoad)
    assert load_balancing_loss(first + second).item() == pytest.approx(loss.item(), abs=1e-6)
    # A single part's loss is not the whole's: why chunks and shards sum loads, not losses.
    assert abs(load_balancing_loss(first).item() - loss.item()) > 1e-3


def test_packed_forwards_aux_loss_counts_real_tokens_only(moe):
    """The load over a packed forward's real tokens (not a bin's tail of padding) equals transformers' own loss over
    the padded rows with their attention mask."""
    hooks = RouterHooks(moe)
    ids, mask, keep = rows(1)
    packed = pack_rows(ids, mask, keep, capacity=None)
    padded_tail = torch.cat([packed.input_ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    positions = torch.cat([packed.position_ids, torch.arange(5)[None]], dim=1)
    hooks.collect, hooks.collected = True, []
    with torch.no_grad():
        moe(input_ids=padded_tail, position_ids=positions, use_cache=False)
    hooks.collect = False
    real = torch.cat([packed.real_tokens(), torch.zeros(1, 5, dtype=torch.bool)], dim=1)
    ours = load_balancing_loss(router_load(hooks.collected, 2, real))
    with torch.no_grad():
        expected = moe(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    assert ours.item() == pytest.approx(expected.item(), abs=1e-5)


# ------------------------------------------------------------------------------------- ZeRO-3 and refusals
def test_zero3_gathers_every_moe_block_as_one_unit(moe):
    from deepspeed.utils import z3_leaf_module

    plugin = types.SimpleNamespace(zero_stage=3)
    assert set_zero3_leaf_modules(moe, types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin)))
    assert all(z3_leaf_module(layer.mlp) for layer in moe.model.layers)
    assert not any(z3_leaf_module(layer.self_attn) for layer in moe.model.layers)
    no_deepspeed = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=None))
    assert set_zero3_leaf_modules(moe, no_deepspeed) == []


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"routing_replay": True}, "needs rollout_streaming=true"),
        ({"routing_replay": True, "rollout_streaming": True, "padding_free": False}, "needs padding_free=true"),
    ],
)
def test_routing_replay_settings_are_refused_with_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, **overrides)


def test_routing_replay_on_a_dense_model_is_refused(tmp_path):
    from datasets import Dataset

    from dapo_trl import DAPOTrainer

    from .scripts.fake_engine import FakeEngine

    class Trainer(DAPOTrainer):
        def build_rollout_engine(self, max_in_flight):
            return FakeEngine(self.num_generations, 2, 8, 0)

    args = tiny_config(tmp_path, routing_replay=True, rollout_streaming=True)
    dataset = Dataset.from_list([{"prompt": "What is 1 + 1?", "solution": "2"}] * 8)
    with pytest.raises(ValueError, match="needs a mixture-of-experts policy"):
        Trainer(model=str(build_tiny_model(tmp_path / "dense")), args=args, train_dataset=dataset)


def test_weight_syncs_that_would_leave_stale_experts_are_refused(moe_dir, tmp_path, monkeypatch):
    """vLLM 0.31's layer-wise reload skips the fused experts: shared-storage server sync and colocated vLLM-CPU are
    refused for a mixture-of-experts policy; NCCL sync and dense policies pass."""
    from dapo_trl.moe.architecture import is_moe_checkpoint
    from dapo_trl.training.rollout import vllm_backends

    assert is_moe_checkpoint(str(moe_dir), None) and not is_moe_checkpoint(str(build_tiny_model(tmp_path / "d")), None)
    server = tiny_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_weight_sync="shared_storage")
    with pytest.raises(ValueError, match="vllm_weight_sync='shared_storage' cannot sync a mixture-of-experts"):
        vllm_backends.check_moe_weight_sync(server, moe=True)
    vllm_backends.check_moe_weight_sync(server, moe=False)
    vllm_backends.check_moe_weight_sync(tiny_config(tmp_path, use_vllm=True, vllm_weight_sync="nccl"), moe=True)
    colocate = tiny_config(tmp_path, use_vllm=True, vllm_mode="colocate")
    monkeypatch.setattr(vllm_backends, "vllm_runs_on_cpu", lambda: True)
    with pytest.raises(ValueError, match="colocated vLLM-CPU cannot sync a mixture-of-experts"):
        vllm_backends.check_moe_weight_sync(colocate, moe=True)
    monkeypatch.setattr(vllm_backends, "vllm_runs_on_cpu", lambda: False)
    vllm_backends.check_moe_weight_sync(colocate, moe=True)  # GPUs: TRL's own load_weights


def test_lora_trains_attention_and_the_experts_of_a_moe_policy(moe_dir, tmp_path):
    """PEFT's `target_parameters` puts LoRA on the experts' 3-D weights beside attention's linear layers: one DAPO
    step moves the adapters on both and nothing else; the MoE blocks found under PEFT's wrappers are the model's."""
    from datasets import Dataset
    from peft import LoraConfig

    from dapo_trl import DAPOTrainer

    lora = LoraConfig(  # docs/moe.md's configuration
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate"],  # attention, and the routers
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        task_type="CAUSAL_LM",
    )
    rows = [{"prompt": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(8)]
    with warnings.catch_warnings(record=True) as caught:  # every target exists: PEFT ignores no pattern
        warnings.simplefilter("always")
        trainer = DAPOTrainer(
            model=str(moe_dir),
            reward_funcs=lambda completions, **kwargs: [float(len(c) % 2) for c in completions],
            args=tiny_config(tmp_path, learning_rate=1e-2, filter_groups_enable=False, num_generations=4),
            train_dataset=Dataset.from_list(rows),
            peft_config=lora,
        )
    assert not [str(w.message) for w in caught if "did not match" in str(w.message)]
    assert [cls.__name__ for cls in moe_block_classes(trainer.model)] == ["Qwen3MoeSparseMoeBlock"]  # not PEFT's
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all("lora_" in name for name in moved)
    assert any(".experts." in name for name in moved) and any("self_attn" in name for name in moved)
    assert any(".mlp.gate." in name for name in moved)  # the routers
