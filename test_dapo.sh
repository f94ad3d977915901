#!/usr/bin/env bash
# Smoke test: 2 real DAPO training steps.
#   ./test_dapo.sh                                    built-in tiny model + built-in problems, offline, CPU is fine
#   MODEL_PATH=Qwen/Qwen2.5-0.5B-Instruct ./test_dapo.sh   the same on a real model (hub access or a local folder)
#   TOOLS=code_interpreter ./test_dapo.sh            with ReTool's sandboxed code interpreter (Hermes template)
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

args=(
  --model_name_or_path "$MODEL_PATH"
  --dataset_name "$DATASET"
  --output_dir "$OUTPUT_DIR"
  --max_steps 2
  --per_device_train_batch_size 8
  --num_generations 4
  --max_completion_length "${MAX_COMPLETION_LENGTH:-64}"
  --overlong_buffer_len "${OVERLONG_BUFFER_LEN:-16}"
  --learning_rate 1e-6
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
