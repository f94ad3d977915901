#!/usr/bin/env bash
# Test input for tests/test_from_verl.py: a DAPO run of the mixture-of-experts Qwen3-30B-A3B with rollout routing
# replay (R3), in the shape of verl's examples/router_replay/run_qwen30_a3b_megatron_vllm.sh (verl's router replay
# runs in its Megatron actor) with the DAPO recipe's settings, written for these tests. The router's load-balancing
# coefficient is set twice: as a Hugging Face model config override and as Megatron-Core's own.
set -xeuo pipefail

PROJECT=DAPO
RUN_NAME="DAPO-Qwen3-30B-A3B-R3"

# R2: replay the routing the trainer recorded; R3: replay the rollout engine's routing (needs the engine's routing).
ROUTING_REPLAY_MODE=${ROUTING_REPLAY_MODE:-R3}

# Batch: 64 prompts x 16 responses per step, generated 3 batches at a time, 16 prompts per update.
PROMPTS_PER_STEP=64
PROMPTS_PER_ROUND=$((PROMPTS_PER_STEP * 3))
RESPONSES_PER_PROMPT=16
PROMPTS_PER_UPDATE=16

# Lengths: 2k prompt, 8k response of which the last 4k are the overlong buffer.
PROMPT_LEN=$((1024 * 2))
RESPONSE_LEN=$((1024 * 8))
BUFFER_LEN=$((1024 * 4))
TOKENS_PER_GPU=$(( (PROMPT_LEN + RESPONSE_LEN) * 2 ))

NNODES=${NNODES:-2}
DATA_HOME=${DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${DATA_HOME}/models/Qwen3-30B-A3B-Base"}
CKPTS_DIR=${CKPTS_DIR:-"${DATA_HOME}/ckpts/${PROJECT}/${RUN_NAME}"}
TRAIN_FILE=${TRAIN_FILE:-"${DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${DATA_HOME}/data/aime-2024.parquet"}

# Megatron: tensor parallel 4, expert parallel 8; vLLM: tensor parallel 4.
TP=4
EP=8
ETP=1
gen_tp=4

python3 -m recipe.dapo.main_dapo --config-path=config --config-name='dapo_megatron_trainer.yaml' \
    data.train_files="${TRAIN_FILE}" data.val_files="${TEST_FILE}" data.prompt_key=prompt \
    data.truncation='left' \
    data.max_prompt_length=${PROMPT_LEN} data.max_response_length=${RESPONSE_LEN} \
    data.train_batch_size=${PROMPTS_PER_STEP} data.gen_batch_size=${PROMPTS_PER_ROUND} \
    actor_rollout_ref.rollout.n=${RESPONSES_PER_PROMPT} \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=10 \
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode="token-mean" \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.optim.clip_grad=1.0 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PROMPTS_PER_UPDATE} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${TOKENS_PER_GPU} \
    actor_rollout_ref.actor.router_replay.mode=${ROUTING_REPLAY_MODE} \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${TP} \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=${EP} \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=${ETP} \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type=aux_loss \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.001 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${TOKENS_PER_GPU} \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=${TP} \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=${EP} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    +actor_rollout_ref.model.override_config.router_aux_loss_coef=0.001 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${TOKENS_PER_GPU} \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.70 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=${gen_tp} \
    actor_rollout_ref.rollout.enable_chunked_prefill=True \
    actor_rollout_ref.rollout.max_num_batched_tokens=$((PROMPT_LEN + RESPONSE_LEN)) \
    actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
    actor_rollout_ref.rollout.val_kwargs.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.n=1 \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=True \
    reward_model.overlong_buffer.len=${BUFFER_LEN} \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name="${PROJECT}" trainer.experiment_name="${RUN_NAME}" \
    trainer.n_gpus_per_node=8 trainer.nnodes="${NNODES}" \
    trainer.val_before_train=True trainer.test_freq=5 trainer.save_freq=5 \
    trainer.total_epochs=1 \
    trainer.default_local_dir="${CKPTS_DIR}" \
    trainer.resume_mode=auto
