#!/usr/bin/env bash
# Full DAPO run with the paper's settings (DAPO, arXiv 2503.14476; verl run_dapo_qwen2.5_32b.sh).
# Every knob is an environment variable; extra arguments go to train_dapo.py and win over these.
#   MODEL_PATH=Qwen/Qwen2.5-32B ACCELERATE_CONFIG=configs/accelerate/zero3_1node_8gpu.yaml ./run_dapo.sh
#   NNODES=2 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 ACCELERATE_CONFIG=configs/accelerate/zero3_2nodes_16gpu.yaml \
#     VLLM_SERVER_HOST=node2 ./run_dapo.sh            (see examples/slurm_dapo.sbatch)
#   MODEL_PATH=./my-model DATASET=./dapo_math_17k.parquet ./run_dapo.sh --max_steps 100
set -euo pipefail
cd "$(dirname "$0")"

MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-32B}"
DATASET="${DATASET:-BytedTsinghua-SIA/DAPO-Math-17k}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/dapo-$(basename "$MODEL_PATH")}"
# Batch: 16 responses per prompt; 512 prompts per step = PER_DEVICE_BATCH_SIZE * processes * steps / 16.
NUM_GENERATIONS="${NUM_GENERATIONS:-16}"
PER_DEVICE_BATCH_SIZE="${PER_DEVICE_BATCH_SIZE:-16}"
GRADIENT_ACCUMULATION_STEPS="${GRADIENT_ACCUMULATION_STEPS:-8}"
STEPS_PER_GENERATION="${STEPS_PER_GENERATION:-$GRADIENT_ACCUMULATION_STEPS}"
LEARNING_RATE="${LEARNING_RATE:-1e-6}"
WARMUP_STEPS="${WARMUP_STEPS:-10}"
WEIGHT_DECAY="${WEIGHT_DECAY:-0.1}"
MAX_GRAD_NORM="${MAX_GRAD_NORM:-1.0}"
NUM_TRAIN_EPOCHS="${NUM_TRAIN_EPOCHS:-1}"
# Lengths: 20480 = 16384 expected + 4096 overlong buffer.
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-2048}"
MAX_COMPLETION_LENGTH="${MAX_COMPLETION_LENGTH:-20480}"
OVERLONG_BUFFER_LEN="${OVERLONG_BUFFER_LEN:-4096}"
OVERLONG_PENALTY_FACTOR="${OVERLONG_PENALTY_FACTOR:-1.0}"
APPLY_OVERLONG_PENALTY="${APPLY_OVERLONG_PENALTY:-true}"
MASK_TRUNCATED_COMPLETIONS="${MASK_TRUNCATED_COMPLETIONS:-false}"
# Clip-higher and token-level loss.
LOSS_TYPE="${LOSS_TYPE:-dapo}"
EPSILON="${EPSILON:-0.2}"
EPSILON_HIGH="${EPSILON_HIGH:-0.28}"
BETA="${BETA:-0.0}"
ENTROPY_COEFF="${ENTROPY_COEFF:-0.0}"
TEMPERATURE="${TEMPERATURE:-1.0}"
TOP_P="${TOP_P:-1.0}"
# Dual-clip (verl's clip_ratio_c): None = off, as in the paper; verl's DAPO and ReTool recipes set 10.0.
CLIP_RATIO_C="${CLIP_RATIO_C:-None}"
# Dynamic sampling.
FILTER_GROUPS_ENABLE="${FILTER_GROUPS_ENABLE:-true}"
MAX_FILTER_GEN_BATCHES="${MAX_FILTER_GEN_BATCHES:-10}"
# Long responses (docs/long-context.md): real tokens per forward and GPU (verl's ppo_max_token_len_per_gpu; empty =
# no budget), and Ulysses sequence parallelism over groups of that many processes (1 = off).
MAX_TOKENS_PER_MICROBATCH="${MAX_TOKENS_PER_MICROBATCH:-}"
SEQUENCE_PARALLEL_SIZE="${SEQUENCE_PARALLEL_SIZE:-1}"
# Infrastructure.
BF16="${BF16:-true}"
REPORT_TO="${REPORT_TO:-tensorboard}"
SAVE_STEPS="${SAVE_STEPS:-50}"
NUM_PROCESSES="${NUM_PROCESSES:-}"            # processes in all (all nodes); default: the accelerate config's, else 1
ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-}"      # e.g. configs/accelerate/zero3_1node_8gpu.yaml
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT_SET="${MASTER_PORT:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
VLLM_SERVER_HOST="${VLLM_SERVER_HOST:-}"        # set to generate on a separate vLLM server (vllm_mode=server)
VLLM_SERVER_PORT="${VLLM_SERVER_PORT:-8000}"
VLLM_WEIGHT_SYNC="${VLLM_WEIGHT_SYNC:-nccl}"    # or shared_storage (VLLM_WEIGHT_SYNC_DIR, default OUTPUT_DIR/vllm_weights)
VLLM_WEIGHT_SYNC_DIR="${VLLM_WEIGHT_SYNC_DIR:-}"
# Streaming rollout (docs/rollout.md; needs the vLLM server): stream dynamic sampling group by group, and generate
# the next batch while the trainer trains, with weights ROLLOUT_MAX_STALENESS steps old (needs shared_storage sync).
ROLLOUT_STREAMING="${ROLLOUT_STREAMING:-false}"
ROLLOUT_MAX_STALENESS="${ROLLOUT_MAX_STALENESS:-0}"
# Preemption: SIGTERM or SIGUSR1 to this script abandons the step in progress, saves the last completed one and exits 0
# (docs/reliability.md).
PREEMPTION_GRACE_SECONDS="${PREEMPTION_GRACE_SECONDS:-300}"

args=(
  --model_name_or_path "$MODEL_PATH" --dataset_name "$DATASET" --output_dir "$OUTPUT_DIR"
  --num_generations "$NUM_GENERATIONS" --per_device_train_batch_size "$PER_DEVICE_BATCH_SIZE"
  --gradient_accumulation_steps "$GRADIENT_ACCUMULATION_STEPS" --steps_per_generation "$STEPS_PER_GENERATION"
  --learning_rate "$LEARNING_RATE" --lr_scheduler_type constant_with_warmup --warmup_steps "$WARMUP_STEPS"
  --weight_decay "$WEIGHT_DECAY" --max_grad_norm "$MAX_GRAD_NORM" --num_train_epochs "$NUM_TRAIN_EPOCHS"
  --max_prompt_length "$MAX_PROMPT_LENGTH" --max_completion_length "$MAX_COMPLETION_LENGTH"
  --overlong_buffer_len "$OVERLONG_BUFFER_LEN" --overlong_penalty_factor "$OVERLONG_PENALTY_FACTOR"
  --apply_overlong_penalty "$APPLY_OVERLONG_PENALTY" --mask_truncated_completions "$MASK_TRUNCATED_COMPLETIONS"
  --loss_type "$LOSS_TYPE" --epsilon "$EPSILON" --epsilon_high "$EPSILON_HIGH" --beta "$BETA"
  --entropy_coeff "$ENTROPY_COEFF" --temperature "$TEMPERATURE" --top_p "$TOP_P" --clip_ratio_c "$CLIP_RATIO_C"
  --filter_groups_enable "$FILTER_GROUPS_ENABLE" --max_filter_gen_batches "$MAX_FILTER_GEN_BATCHES"
  --sequence_parallel_size "$SEQUENCE_PARALLEL_SIZE"
  --bf16 "$BF16" --report_to "$REPORT_TO" --save_steps "$SAVE_STEPS" --logging_steps 1
  --preemption_grace_seconds "$PREEMPTION_GRACE_SECONDS"
)
[[ -n "$MAX_TOKENS_PER_MICROBATCH" ]] && args+=(--max_tokens_per_microbatch "$MAX_TOKENS_PER_MICROBATCH")

if [[ -n "$VLLM_SERVER_HOST" ]]; then
  args+=(--use_vllm true --vllm_mode server --vllm_server_host "$VLLM_SERVER_HOST" --vllm_server_port "$VLLM_SERVER_PORT"
         --vllm_weight_sync "$VLLM_WEIGHT_SYNC" --rollout_streaming "$ROLLOUT_STREAMING"
         --rollout_max_staleness "$ROLLOUT_MAX_STALENESS")
  [[ -n "$VLLM_WEIGHT_SYNC_DIR" ]] && args+=(--vllm_weight_sync_dir "$VLLM_WEIGHT_SYNC_DIR")
  if [[ "$ROLLOUT_MAX_STALENESS" != "0" ]]; then   # the decoupled objective: truncated per-token weight, cap 2
    args+=(--vllm_importance_sampling_mode token_truncate --vllm_importance_sampling_clip_max 2.0)
  fi
fi

launcher=(accelerate launch)
if [[ -n "$ACCELERATE_CONFIG" ]]; then
  launcher+=(--config_file "$ACCELERATE_CONFIG")
elif [[ "${NUM_PROCESSES:-1}" -gt 1 || "$NNODES" -gt 1 ]]; then
  launcher+=(--multi_gpu)
fi
[[ -n "$NUM_PROCESSES" ]] && launcher+=(--num_processes "$NUM_PROCESSES")
if [[ "$NNODES" -gt 1 ]]; then
  launcher+=(--num_machines "$NNODES" --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR"
             --main_process_port "$MASTER_PORT")
elif [[ -n "${MASTER_PORT_SET:-}" ]]; then   # two runs on one machine need two ports
  launcher+=(--main_process_port "$MASTER_PORT")
fi
if [[ "${DRY_RUN:-0}" == "1" ]]; then   # print the command instead of running it
  printf '%q ' "${launcher[@]}" train_dapo.py "${args[@]}" "$@"; echo
  exit 0
fi
# torchrun (several processes) forwards SIGUSR1 too, and waits for the checkpoint before it kills the processes.
export TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((${PREEMPTION_GRACE_SECONDS%.*} + 60))}"
"${launcher[@]}" train_dapo.py "${args[@]}" "$@" &
launcher_pid=$!
# A preemption signal to this script goes to the training processes themselves (the launcher's children): they
# agree to abandon the step in progress, save the last completed one, and exit 0, and so does the launcher.
forward() { pkill "-$1" -P "$launcher_pid" || kill "-$1" "$launcher_pid" 2> /dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
status=0
while kill -0 "$launcher_pid" 2> /dev/null; do
  wait "$launcher_pid" || status=$?   # returns early (128 + n) when a trapped signal arrives
done
wait "$launcher_pid" 2> /dev/null && status=0 || status=$?
exit "$status"
