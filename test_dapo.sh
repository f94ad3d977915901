#!/usr/bin/env bash
# Smoke test: 2 real DAPO training steps.
#   ./test_dapo.sh                                    built-in tiny model + built-in problems, offline, CPU is fine
#   MODEL_PATH=Qwen/Qwen2.5-0.5B-Instruct ./test_dapo.sh   the same on a real model (hub access or a local folder)
#   TOOLS=code_interpreter ./test_dapo.sh            with ReTool's sandboxed code interpreter (Hermes template)
#   DEMO=1 ./test_dapo.sh                            150 steps (about 1.5 min on 2 CPU cores): accuracy climbs from
#                                                    about 30% to about 60%; charts in OUTPUT_DIR/plots
# Extra arguments are passed to train_dapo.py (e.g. ./test_dapo.sh --max_steps 4).
set -euo pipefail
cd "$(dirname "$0")"

MODEL_PATH="${MODEL_PATH:-builtin:tiny}"
DATASET="${DATASET:-builtin:arithmetic}"
OUTPUT_DIR="${OUTPUT_DIR:-$(mktemp -d -t dapo-smoke-XXXXXX)}"
NUM_PROCESSES="${NUM_PROCESSES:-1}"

if [[ "$MODEL_PATH" == builtin:* && "$DATASET" == builtin:* ]]; then
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1   # nothing to download: fail loudly if anything tries
fi
export TOKENIZERS_PARALLELISM=false

if [[ -n "${DEMO:-}" ]]; then   # long enough to watch the built-in model learn
  MAX_STEPS="${MAX_STEPS:-150}" BATCH_SIZE="${BATCH_SIZE:-128}" NUM_GENERATIONS="${NUM_GENERATIONS:-8}"
  LEARNING_RATE="${LEARNING_RATE:-5e-4}" MAX_COMPLETION_LENGTH="${MAX_COMPLETION_LENGTH:-32}"
  OVERLONG_BUFFER_LEN="${OVERLONG_BUFFER_LEN:-8}" LR_SCHEDULER_TYPE="${LR_SCHEDULER_TYPE:-constant}"
fi

args=(
  --model_name_or_path "$MODEL_PATH"
  --dataset_name "$DATASET"
  --output_dir "$OUTPUT_DIR"
  --max_steps "${MAX_STEPS:-2}"
  --per_device_train_batch_size "${BATCH_SIZE:-8}"
  --num_generations "${NUM_GENERATIONS:-4}"
  --max_completion_length "${MAX_COMPLETION_LENGTH:-64}"
  --overlong_buffer_len "${OVERLONG_BUFFER_LEN:-16}"
  --learning_rate "${LEARNING_RATE:-1e-6}"
  --lr_scheduler_type "${LR_SCHEDULER_TYPE:-linear}"
  --max_filter_gen_batches "${MAX_FILTER_GEN_BATCHES:-3}"
  --logging_steps 1
  --save_strategy no
  --report_to "${REPORT_TO:-tensorboard}"
)

if [[ -n "${TOOLS:-}" ]]; then
  args+=(--tools "$TOOLS" --chat_template "${CHAT_TEMPLATE:-qwen2_5}" --reward_funcs "${REWARD_FUNCS:-retool}"
         --sandbox "${SANDBOX:-local}")
  [[ -n "${SANDBOX_URL:-}" ]] && args+=(--sandbox_url "$SANDBOX_URL")
fi

if [[ "$NUM_PROCESSES" -gt 1 ]]; then
  exec accelerate launch --multi_gpu --num_processes "$NUM_PROCESSES" --num_machines 1 --mixed_precision no \
    --dynamo_backend no train_dapo.py "${args[@]}" "$@"
fi
exec python train_dapo.py "${args[@]}" "$@"
