#!/usr/bin/env bash
# Test input for tests/test_from_verl.py: a verl run in the shape of the DAPO recipe for Qwen2.5-32B
# (verl-recipe dapo/run_dapo_qwen2.5_32b.sh), written for these tests from the recipe's documented settings.
set -xeuo pipefail

PROJECT=DAPO
RUN_NAME="DAPO-Qwen2.5-32B"

# Batch: 512 prompts x 16 responses per step, generated 3 batches at a time, 32 prompts per update.
PROMPTS_PER_STEP=512
PROMPTS_PER_ROUND=$((PROMPTS_PER_STEP * 3))
RESPONSES_PER_PROMPT=16
PROMPTS_PER_UPDATE=32

# Lengths: 2k prompt, 20k response of which the last 4k are the overlong buffer.
PROMPT_LEN=$((1024 * 2))
RESPONSE_LEN=$((1024 * 20))
BUFFER_LEN=$((1024 * 4))
TOKENS_PER_GPU=$(( PROMPT_LEN + RESPONSE_LEN ))

NNODES=${NNODES:-16}
DATA_HOME=${DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${DATA_HOME}/models/Qwen2.5-32B"}
CKPTS_DIR=${CKPTS_DIR:-"${DATA_HOME}/ckpts/${PROJECT}/${RUN_NAME}"}
TRAIN_FILE=${TRAIN_FILE:-"${DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${DATA_HOME}/data/aime-2024.parquet"}

offload=True
sp_size=8
gen_tp=4

ray job submit --no-wait --runtime-env="${PWD}/runtime_env.yaml" -- \
  python3 -m recipe.dapo.main_dapo \
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
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PROMPTS_PER_UPDATE} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${TOKENS_PER_GPU} \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=${sp_size} \
    actor_rollout_ref.actor.fsdp_config.param_offload=${offload} \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=${offload} \
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${TOKENS_PER_GPU} \
    actor_rollout_ref.ref.fsdp_config.param_offload=${offload} \
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=${sp_size} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${TOKENS_PER_GPU} \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=${gen_tp} \
    actor_rollout_ref.rollout.enable_chunked_prefill=True \
    actor_rollout_ref.rollout.max_num_batched_tokens=${TOKENS_PER_GPU} \
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
