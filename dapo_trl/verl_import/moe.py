"""Mixture-of-experts keys: router replay (verl's R3 becomes `routing_replay`, R2 is refused), the router's
load-balancing loss (`router_aux_loss_coef`), and verl's Megatron-only settings, reported as such (`MEGATRON_KEYS`).
"""

from __future__ import annotations

import fnmatch

from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation, as_boolean, recipe_line

ROUTER_REPLAY_MODE = "actor_rollout_ref.actor.router_replay.mode"
ENGINE_ROUTING = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
RETURN_ROUTED_EXPERTS = "--enable-return-routed-experts"
# verl writes model.override_config into the Hugging Face model config: its FSDP workers read the keys themselves,
# its Megatron workers read them under model_config. (`map_config_overrides` leaves these to `map_router_aux_loss`.)
ROUTER_AUX_LOSS_KEYS = (
    "actor_rollout_ref.model.override_config.router_aux_loss_coef",
    "actor_rollout_ref.model.override_config.model_config.router_aux_loss_coef",
)

MEGATRON_ONLY = (
    "Megatron-only: a setting of verl's Megatron-Core backend; the trainer here is Hugging Face transformers under "
    "accelerate (DeepSpeed ZeRO or DDP, see accelerate.yaml)"
)
_SPEED_ONLY = "Megatron-Core's dispatch of tokens to experts and its fused kernels: speed only"
_EXPERT_PARALLEL = (
    "Megatron's expert parallelism (the experts split over GPUs): none here, the experts' parameters are sharded like "
    "the others' when accelerate.yaml uses ZeRO-3"
)
# Keys of verl's Megatron backend under actor_rollout_ref (actor and reference; the reference's are not needed, as
# all its keys): (glob pattern, status, what it is and what to do here; `{value}` is the key's value, `{recipe}` the
# recipe's router_aux_loss_coef). The first match wins; the last pattern takes every other Megatron key.
MEGATRON_KEYS: list[tuple[str, str, str]] = [
    (
        "*.megatron.override_transformer_config.moe_aux_loss_coeff",
        UNSUPPORTED,
        "Megatron-Core's MoE load-balancing loss coefficient (applied with a moe_router_load_balancing_type other "
        "than none). Here that loss is the model's own in transformers, weighted by router_aux_loss_coef (the "
        "recipe's: {recipe}): pass --router_aux_loss_coef {value} for this coefficient",
    ),
    (
        "*.megatron.override_transformer_config.moe_router_load_balancing_type",
        UNSUPPORTED,
        "Megatron-Core's load-balancing scheme ({value}). Here the router's load-balancing loss is the model's own in "
        "transformers: on with --router_aux_loss_coef > 0 (its coefficient), off with --router_aux_loss_coef 0 (none)",
    ),
    ("*.megatron.override_transformer_config.moe_token_dispatcher_type", NOT_NEEDED, _SPEED_ONLY),
    ("*.megatron.override_transformer_config.moe_enable_deepep", NOT_NEEDED, _SPEED_ONLY),
    ("*.megatron.override_transformer_config.moe_permute_fusion", NOT_NEEDED, _SPEED_ONLY),
    ("*.megatron.override_transformer_config.moe_grouped_gemm", NOT_NEEDED, _SPEED_ONLY),
    ("*.megatron.override_transformer_config.moe_shared_expert_overlap", NOT_NEEDED, _SPEED_ONLY),
    ("*.megatron.expert_model_parallel_size", NOT_NEEDED, _EXPERT_PARALLEL),
    ("*.megatron.expert_tensor_parallel_size", NOT_NEEDED, _EXPERT_PARALLEL),
    (
        "*.megatron.override_transformer_config.moe_*",
        UNSUPPORTED,
        "A Megatron-Core MoE setting with no counterpart in transformers' MoE blocks",
    ),
    ("*.megatron.*", UNSUPPORTED, "No counterpart here"),
]


def map_moe(t: Translation) -> None:
    """After `map_rollout`: routing replay reads the generation, dynamic sampling, tools and batch layout decided."""
    map_routing_replay(t)
    map_router_aux_loss(t)
    map_megatron(t)


def map_routing_replay(t: Translation) -> None:
    """verl's router replay: `actor.router_replay.mode` decides (its Megatron actor replays); the rollout's
    `enable_rollout_routing_replay` makes the engine return each token's experts, which R3 replays."""
    if not (t.given(ROUTER_REPLAY_MODE) or t.given(ENGINE_ROUTING)):
        return
    mode = str(t.value(ROUTER_REPLAY_MODE) or "disabled")
    engine_routing = as_boolean(t.value(ENGINE_ROUTING))
    if mode == "R3":
        _map_r3(t, engine_routing)
        return
    t.set(routing_replay=False)
    if mode == "R2":
        t.mark(
            ROUTER_REPLAY_MODE,
            UNSUPPORTED,
            "",
            "R2 (verl records the routing of its own old-log-prob forward and replays it in the policy update) is "
            "not supported: dapo-trl replays the inference engine's routing, R3 (actor.router_replay.mode=R3 with "
            "rollout.enable_rollout_routing_replay=True; here routing_replay: true)",
            blocking=True,
        )
        t.mark(ENGINE_ROUTING, NOT_NEEDED, how="with R2 verl drops the engine's routing: see actor.router_replay.mode")
    elif mode == "disabled":
        t.mark(
            ROUTER_REPLAY_MODE,
            MAPPED,
            recipe_line("routing_replay", False),
            "no router replay: the training forwards route the tokens themselves",
        )
        t.mark(
            ENGINE_ROUTING,
            NOT_NEEDED if engine_routing else MAPPED,
            recipe_line("routing_replay", False),
            "the engine returns each token's experts, but with actor.router_replay.mode disabled verl's actor "
            "replays none (R3 needs mode=R3 as well)"
            if engine_routing
            else "the engine returns no routing",
        )
    else:
        t.mark(
            ROUTER_REPLAY_MODE,
            UNSUPPORTED,
            "",
            f"unknown router replay mode {mode!r}: verl accepts disabled, R2 and R3 (R3 is routing_replay here)",
            blocking=True,
        )
        t.mark(ENGINE_ROUTING, NOT_NEEDED, how="see actor.router_replay.mode")


def _map_r3(t: Translation, engine_routing: bool) -> None:
    """R3: `routing_replay` with the streaming rollout, whose vLLM server returns the routed experts; what the
    trainer refuses with it (DAPOConfig's and DAPOTrainer's checks) is reported here instead."""
    problems = []
    if not t.recipe.get("use_vllm"):
        problems.append("it needs the routed experts of a vLLM server; this rollout generates with transformers")
    elif t.recipe.get("vllm_mode") == "colocate":
        problems.append(
            f"it needs a vLLM server (`vllm serve {RETURN_ROUTED_EXPERTS}`), not vllm_mode colocate: TRL builds the "
            "colocated engine without returning routed experts"
        )
    if not t.recipe.get("rollout_streaming", True):
        problems.append("it needs rollout_streaming, which this translation turns off")
    if t.recipe.get("tool_config"):
        problems.append("it does not run with tools (the engine routes the first turn only)")
    if t.recipe.get("sequence_parallel_size", 1) > 1:
        problems.append(
            "it does not run with sequence parallelism yet: set actor_rollout_ref.actor.ulysses_sequence_parallel_size"
            "=1 (and the reference's)"
        )
    if not t.recipe.get("padding_free", True):
        problems.append(
            "the replayed routing rides the packed forwards: set actor_rollout_ref.model.use_remove_padding=True"
        )
    if t.recipe.get("kl_in_reward") and t.recipe.get("kl_in_reward_controller") == "adaptive":
        problems.append(
            "the streaming rollout cannot step the adaptive KL controller: set algorithm.kl_ctrl.type=fixed"
        )
    if problems:
        t.set(routing_replay=False)
        t.mark(
            ROUTER_REPLAY_MODE,
            UNSUPPORTED,
            "",
            "R3 (the training forwards replay the engine's routing; here routing_replay: true) cannot run in this "
            "translation: " + "; ".join(problems),
            blocking=True,
        )
        t.mark(ENGINE_ROUTING, UNSUPPORTED, "", "see actor.router_replay.mode")
        return
    streaming = "rollout_streaming" not in t.recipe  # no other key decides the streaming rollout
    t.set(routing_replay=True, **({"rollout_streaming": True} if streaming else {}))
    t.vllm.extra_args.append(RETURN_ROUTED_EXPERTS)
    t.mark(
        ROUTER_REPLAY_MODE,
        MAPPED,
        "routing_replay: true" + (", rollout_streaming: true" if streaming else ""),
        "R3: the training forwards (old and policy log-probs) route each sampled token to the experts the vLLM "
        "server chose for it, with the trainer router's gate weights; it needs the streaming rollout "
        "(rollout_streaming), whose requests return the routing, and the server's "
        f"{RETURN_ROUTED_EXPERTS}",
    )
    t.record(
        ENGINE_ROUTING,
        MAPPED if engine_routing else APPROXIMATED,
        f"vllm_server.sh {RETURN_ROUTED_EXPERTS}",
        "the server returns each token's routed experts"
        if engine_routing
        else "verl's R3 needs it on (its actor asserts the engine's routing is there); here vllm_server.sh is "
        f"started with {RETURN_ROUTED_EXPERTS} for routing_replay",
    )
    t.notes.append(
        f"routing replay (R3): vllm_server.sh starts vLLM with {RETURN_ROUTED_EXPERTS} (vLLM >= 0.31; on GPUs "
        "also export VLLM_USE_V2_MODEL_RUNNER=1 before starting it). routing_replay needs that server: not "
        "--vllm_mode colocate (TRL builds the colocated engine without returning routed experts), and a "
        "mixture-of-experts model whose routers transformers marks"
    )


def map_router_aux_loss(t: Translation) -> None:
    """The router's load-balancing loss: verl's FSDP actor adds none; TRL adds the model config's coefficient x that
    loss for a mixture-of-experts policy unless router_aux_loss_coef says otherwise."""
    given = [key for key in ROUTER_AUX_LOSS_KEYS if t.given(key) and t.value(key) is not None]
    if not given:
        t.set(router_aux_loss_coef=0.0)
        t.record(
            ROUTER_AUX_LOSS_KEYS[0],
            MAPPED,
            recipe_line("router_aux_loss_coef", 0.0),
            "verl's FSDP actor adds no router load-balancing loss (its forwards keep the logits only); TRL's default "
            "adds the model config's coefficient x that loss for a mixture-of-experts policy (0.001 for Qwen3-MoE). "
            "A dense model has no such loss either way",
        )
        return
    value = float(t.value(given[0]))
    t.set(router_aux_loss_coef=value)
    for key in given:
        t.mark(
            key,
            APPROXIMATED,
            recipe_line("router_aux_loss_coef", value),
            "the coefficient of the MoE router's load-balancing loss, which verl writes into the model config "
            "(override_config.model_config. is its Megatron workers' spelling). verl's FSDP actor adds no such loss "
            "itself; here, TRL's router_aux_loss_coef, the loss is added to a mixture-of-experts policy's loss "
            "with this weight (0 turns it off)",
        )


def map_megatron(t: Translation) -> None:
    """Every key of verl's Megatron backend, by `MEGATRON_KEYS`: what it is there, and what to do here."""
    for key in list(t.found.values):
        if key in t.entries or not key.startswith("actor_rollout_ref.") or not t.given(key) or t.value(key) is None:
            continue  # null or unresolved keys are reported as such by `mark_remaining`
        for pattern, status, why in MEGATRON_KEYS:
            if fnmatch.fnmatchcase(key, pattern):
                why = why.format(value=t.value(key), recipe=t.recipe.get("router_aux_loss_coef"))
                reference = key.startswith("actor_rollout_ref.ref.")  # reference forwards: see NOT_NEEDED_KEYS
                t.mark(key, NOT_NEEDED if reference else status, "", f"{MEGATRON_ONLY}. {why}")
                break
