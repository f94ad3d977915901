#!/usr/bin/env bash
# Full DAPO run (DAPO, arXiv 2503.14476) with the paper's batch layout and the settings of verl's DAPO recipe, the
# authors' published script (verl-recipe dapo/run_dapo_qwen2.5_32b.sh; tests/data/verl/dapo_recipe.sh has its keys):
#   a rollout of 512 prompts x 16 responses, trained in 16 optimizer updates of 512 responses (32 prompts) each;
#   clip 0.2 / 0.28, token-level loss, no KL, no entropy bonus, dynamic sampling (up to 10 rounds), soft overlong
#   penalty (20480 = 16384 + a 4096-token buffer), prompts up to 2048 tokens, lr 1e-6 constant after a linear
#   warm-up of 10 rollout steps (the recipe's lr_warmup_steps=10; here in optimizer steps: 10 x 16 = 160), weight
#   decay 0.1, gradient clipping 1.0, sampling at temperature 1.0, top_p 1.0.
# What differs from that recipe unless you set it:
#   - no validation: EVAL_DATASET=aime2024 validates as the paper reports it (avg@32 and pass@k on AIME 2024 at
#     temperature 1.0, top_p 0.7; verl's recipe samples 1) before training and every EVAL_STEPS optimizer steps
#     (default 80 = verl's test_freq of 5 rollout steps);
#   - no dual-clip (the paper has none; the recipe sets clip_ratio_c=10.0: CLIP_RATIO_C=10.0);
#   - one prompt batch per dynamic-sampling round (the recipe generates 3x: --filter_groups_oversample 3);
#   - no token budget or sequence parallelism (the recipe: MAX_TOKENS_PER_MICROBATCH=22528 SEQUENCE_PARALLEL_SIZE=8);
#   - checkpoints every SAVE_STEPS=50 optimizer steps (the recipe: every 5 rollout steps, 80).
# Batch layout: GRADIENT_ACCUMULATION_STEPS and STEPS_PER_GENERATION are derived so that, on any number of processes,
#   responses per update  = PER_DEVICE_BATCH_SIZE x processes x GRADIENT_ACCUMULATION_STEPS = 512
#   responses per rollout = PER_DEVICE_BATCH_SIZE x processes x STEPS_PER_GENERATION        = 512 x 16
# (processes: NUM_PROCESSES, else ACCELERATE_CONFIG's num_processes, else 1; PER_DEVICE_BATCH_SIZE, default 16, is
# lowered to fit). Set GRADIENT_ACCUMULATION_STEPS yourself to choose the layout: STEPS_PER_GENERATION then defaults
# to it x UPDATES_PER_ROLLOUT. `DRY_RUN=1 ./run_dapo.sh` prints the command.
# Generation (one line on stderr at start says which): on a vLLM server when VLLM_SERVER_HOST is set (start it first
# with scripts/start_vllm_server.sh), with vLLM colocated on every training GPU when VLLM_MODE=colocate, and otherwise
# with transformers' generate in the training processes, which runs anywhere but is very slow at responses of up to
# 20480 tokens (under ZeRO-3 every token gathers the sharded weights): the line is then a warning.
# The default model, Qwen2.5-32B, needs the 64 training GPUs of examples/qwen2.5-32b-16x8 (its token budget and
# sequence parallelism 8); on fewer GPUs train a smaller model.
# Every knob is an environment variable; extra arguments go to train_dapo.py and win over these.
# Qwen2.5-7B on one node of 8 GPUs, with the token budget and sequence parallelism of examples/qwen2.5-7b-2x8:
#   MODEL_PATH=Qwen/Qwen2.5-7B ACCELERATE_CONFIG=configs/accelerate/zero3_1node_8gpu.yaml VLLM_MODE=colocate \
#     MAX_TOKENS_PER_MICROBATCH=18432 SEQUENCE_PARALLEL_SIZE=2 ./run_dapo.sh --attn_implementation flash_attention_2
# On 2 training nodes with a vLLM server on a third (examples/slurm_dapo.sbatch runs this on every training node):
#   NNODES=2 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 ACCELERATE_CONFIG=configs/accelerate/zero3_2nodes_16gpu.yaml \
#     VLLM_SERVER_HOST=node2 MODEL_PATH=Qwen/Qwen2.5-7B MAX_TOKENS_PER_MICROBATCH=18432 SEQUENCE_PARALLEL_SIZE=2 \
#     ./run_dapo.sh --attn_implementation flash_attention_2
# A local model and data file, 100 optimizer steps: MODEL_PATH=./my-model DATASET=./dapo_math_17k.parquet \
#     ./run_dapo.sh --max_steps 100
set -euo pipefail
cd "$(dirname "$0")"

MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-32B}"
DATASET="${DATASET:-BytedTsinghua-SIA/DAPO-Math-17k}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/dapo-$(basename "$MODEL_PATH")}"
# Batch (see the header): PROMPTS_PER_ROLLOUT prompts x NUM_GENERATIONS responses, in UPDATES_PER_ROLLOUT updates.
NUM_GENERATIONS="${NUM_GENERATIONS:-16}"
PROMPTS_PER_ROLLOUT="${PROMPTS_PER_ROLLOUT:-512}"
UPDATES_PER_ROLLOUT="${UPDATES_PER_ROLLOUT:-16}"
NUM_PROCESSES="${NUM_PROCESSES:-}"            # processes in all (all nodes); default: the accelerate config's, else 1
ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-}"      # e.g. configs/accelerate/zero3_1node_8gpu.yaml
processes="$NUM_PROCESSES"
if [[ -z "$processes" && -n "$ACCELERATE_CONFIG" ]]; then
  processes="$(sed -n 's/^num_processes:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$ACCELERATE_CONFIG" | head -n 1)"
fi
processes="${processes:-1}"
if [[ -z "${GRADIENT_ACCUMULATION_STEPS:-}" ]]; then   # derive the paper's layout for this many processes
  per_update=$((PROMPTS_PER_ROLLOUT * NUM_GENERATIONS / UPDATES_PER_ROLLOUT))   # responses per optimizer update
  if (( PROMPTS_PER_ROLLOUT * NUM_GENERATIONS % UPDATES_PER_ROLLOUT || per_update % processes )); then
    echo "run_dapo.sh: $PROMPTS_PER_ROLLOUT prompts x $NUM_GENERATIONS responses in $UPDATES_PER_ROLLOUT updates" \
      "do not split evenly over $processes processes: set GRADIENT_ACCUMULATION_STEPS (and PER_DEVICE_BATCH_SIZE)" \
      "or PROMPTS_PER_ROLLOUT" >&2
    exit 2
  fi
  per_process=$((per_update / processes))
  PER_DEVICE_BATCH_SIZE="${PER_DEVICE_BATCH_SIZE:-$(( per_process < 16 ? per_process : 16 ))}"
  while (( per_process % PER_DEVICE_BATCH_SIZE )); do   # the largest batch <= the one asked for that divides it
    PER_DEVICE_BATCH_SIZE=$((PER_DEVICE_BATCH_SIZE - 1))
  done
  GRADIENT_ACCUMULATION_STEPS=$((per_process / PER_DEVICE_BATCH_SIZE))
fi
PER_DEVICE_BATCH_SIZE="${PER_DEVICE_BATCH_SIZE:-16}"
STEPS_PER_GENERATION="${STEPS_PER_GENERATION:-$((GRADIENT_ACCUMULATION_STEPS * UPDATES_PER_ROLLOUT))}"
LEARNING_RATE="${LEARNING_RATE:-1e-6}"
WARMUP_STEPS="${WARMUP_STEPS:-$((10 * UPDATES_PER_ROLLOUT))}"   # optimizer steps: verl's 10 rollout steps
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
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT_SET="${MASTER_PORT:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
VLLM_SERVER_HOST="${VLLM_SERVER_HOST:-}"        # set to generate on a separate vLLM server (vllm_mode=server)
VLLM_MODE="${VLLM_MODE:-}"                      # server (the default with VLLM_SERVER_HOST), colocate, or empty:
                                                # transformers' generate when VLLM_SERVER_HOST is not set
VLLM_GPU_MEMORY_UTILIZATION="${VLLM_GPU_MEMORY_UTILIZATION:-0.3}"   # colocate: each GPU's share for vLLM
VLLM_SERVER_PORT="${VLLM_SERVER_PORT:-8000}"
VLLM_WEIGHT_SYNC="${VLLM_WEIGHT_SYNC:-nccl}"    # or shared_storage (VLLM_WEIGHT_SYNC_DIR, default OUTPUT_DIR/vllm_weights)
VLLM_WEIGHT_SYNC_DIR="${VLLM_WEIGHT_SYNC_DIR:-}"
# Streaming rollout (docs/rollout.md; needs the vLLM server): stream dynamic sampling group by group, and generate
# the next batch while the trainer trains, with weights ROLLOUT_MAX_STALENESS steps old (needs shared_storage sync).
ROLLOUT_STREAMING="${ROLLOUT_STREAMING:-false}"
ROLLOUT_MAX_STALENESS="${ROLLOUT_MAX_STALENESS:-0}"
# With ROLLOUT_MAX_STALENESS >= 1: load each weights version under the running requests (the server paused with them
# kept, VLLM_SERVER_DEV_MODE=1) instead of after they drain; checkpoints then keep the groups generated ahead.
ROLLOUT_IN_FLIGHT_WEIGHT_UPDATES="${ROLLOUT_IN_FLIGHT_WEIGHT_UPDATES:-false}"
# Validation (off unless EVAL_DATASET is set): avg@EVAL_NUM_SAMPLES and pass@k before training and every EVAL_STEPS
# optimizer steps, sampled at temperature 1.0 and top_p 0.7 (the paper's).
EVAL_DATASET="${EVAL_DATASET:-}"                # e.g. aime2024 (several: "aime2024 aime2025")
EVAL_STEPS="${EVAL_STEPS:-$((5 * UPDATES_PER_ROLLOUT))}"
EVAL_NUM_SAMPLES="${EVAL_NUM_SAMPLES:-32}"
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
if [[ -n "$EVAL_DATASET" ]]; then   # TRL's own eval pass at 1 response per prompt; avg@n is sampled apart
  read -r -a eval_sets <<< "$EVAL_DATASET"
  args+=(--eval_dataset_name "${eval_sets[@]}" --eval_strategy steps --eval_steps "$EVAL_STEPS" --val_before_train true
         --eval_num_samples "$EVAL_NUM_SAMPLES" --eval_temperature 1.0 --eval_top_p 0.7 --num_generations_eval 1)
fi

[[ -z "$VLLM_MODE" && -n "$VLLM_SERVER_HOST" ]] && VLLM_MODE=server
case "$VLLM_MODE" in
  server)
    if [[ -z "$VLLM_SERVER_HOST" ]]; then
      echo "run_dapo.sh: VLLM_MODE=server needs VLLM_SERVER_HOST, the host of the vLLM server" >&2; exit 2
    fi
    echo "run_dapo.sh: generating on the vLLM server at http://$VLLM_SERVER_HOST:$VLLM_SERVER_PORT" >&2 ;;
  colocate)
    echo "run_dapo.sh: generating with vLLM colocated on every training GPU" \
      "(vllm_gpu_memory_utilization $VLLM_GPU_MEMORY_UTILIZATION)" >&2
    args+=(--use_vllm true --vllm_mode colocate --vllm_gpu_memory_utilization "$VLLM_GPU_MEMORY_UTILIZATION"
           --vllm_max_model_length "$((MAX_PROMPT_LENGTH + MAX_COMPLETION_LENGTH))") ;;
  "")
    echo "run_dapo.sh: warning: generating with transformers' generate (neither VLLM_SERVER_HOST nor" \
      "VLLM_MODE=colocate is set): very slow at responses of up to $MAX_COMPLETION_LENGTH tokens" >&2 ;;
  *)
    echo "run_dapo.sh: VLLM_MODE=$VLLM_MODE: expected server, colocate or empty" >&2; exit 2 ;;
esac
if [[ "$VLLM_MODE" == server ]]; then
  args+=(--use_vllm true --vllm_mode server --vllm_server_host "$VLLM_SERVER_HOST" --vllm_server_port "$VLLM_SERVER_PORT"
         --vllm_weight_sync "$VLLM_WEIGHT_SYNC" --rollout_streaming "$ROLLOUT_STREAMING"
         --rollout_max_staleness "$ROLLOUT_MAX_STALENESS")
  [[ -n "$VLLM_WEIGHT_SYNC_DIR" ]] && args+=(--vllm_weight_sync_dir "$VLLM_WEIGHT_SYNC_DIR")
  if [[ "$ROLLOUT_MAX_STALENESS" != "0" ]]; then   # the decoupled objective: truncated per-token weight, cap 2
    args+=(--vllm_importance_sampling_mode token_truncate --vllm_importance_sampling_clip_max 2.0
           --rollout_in_flight_weight_updates "$ROLLOUT_IN_FLIGHT_WEIGHT_UPDATES")
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
