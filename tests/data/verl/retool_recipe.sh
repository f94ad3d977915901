# Test input for tests/test_from_verl.py: a verl run in the shape of the ReTool recipe for Qwen2.5-7B
# (verl-recipe retool/run_qwen2_7b_dapo.sh), written for these tests from the recipe's documented settings.
set -x

export VLLM_USE_V1=1

DATA_ROOT=${DATA_ROOT:-$PWD}
CKPT_ROOT=${CKPT_ROOT:-$PWD}
train_set=$DATA_ROOT/dataset/BytedTsinghua-SIA/DAPO-Math-17k
val_2024=$DATA_ROOT/dataset/Maxwell-Jia/AIME_2024
val_2025=$DATA_ROOT/dataset/yentinglin/aime_2025
sft_model=$CKPT_ROOT/checkpoint/multiturn-sft-qwen-2.5-7b-instruct/global_step_372

turns=16
prompt_len=2048
response_len=16384
tokens_per_gpu=$(( (prompt_len + response_len) * 1 ))

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.kl_ctrl.kl_coef=0.0 \
    data.train_files="['$train_set']" \
    data.val_files="['$val_2025', '$val_2024']" \
    data.return_raw_chat=True \
    data.train_batch_size=64 \
    data.max_prompt_length=$prompt_len \
    data.max_response_length=$response_len \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.custom_cls.path=recipe/retool/retool.py \
    data.custom_cls.name=CustomRLHFDataset \
    custom_reward_function.path=recipe/retool/retool.py \
    custom_reward_function.name=compute_score \
    actor_rollout_ref.model.path=$sft_model \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$tokens_per_gpu \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$(( tokens_per_gpu * 4 )) \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_user_turns=$turns \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=$turns \
    actor_rollout_ref.rollout.multi_turn.tool_config_path=recipe/retool/sandbox_fusion_tool_config.yaml \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.9 \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.val_kwargs.top_p=0.6 \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.n=30 \
    trainer.logger=['console','wandb'] \
    trainer.project_name=retool \
    trainer.experiment_name=qwen2.5-7b_dapo \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.val_before_train=True \
    trainer.log_val_generations=20 \
    trainer.save_freq=20 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 \
    trainer.default_local_dir=$CKPT_ROOT/checkpoint/qwen2.5-7b_dapo $@
