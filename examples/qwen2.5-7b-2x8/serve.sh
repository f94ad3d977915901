#!/usr/bin/env bash
# The generation node of examples/qwen2.5-7b-2x8: vLLM serving Qwen2.5-7B as 8 data-parallel replicas (one per GPU)
# on port 8000, reloading the trainer's weights from the shared file system (WEIGHT_SYNC=shared_storage: no
# --weight-transfer-config, no NCCL group with the trainer). Run it first, from any directory:
#   examples/qwen2.5-7b-2x8/serve.sh            (extra arguments go to `vllm serve`)
# It is ready when `curl -sf http://THIS_HOST:8000/health` answers; train.sh waits for that.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-7B}"   # the policy's initial weights: the recipe's model_name_or_path
export TP=1 DP=8                                    # 8 GPUs: 8 replicas of 1 GPU each
export PORT=8000 MAX_MODEL_LEN=22528                # 2048 prompt + 20480 response tokens
export WEIGHT_SYNC=shared_storage
exec scripts/start_vllm_server.sh "$@"
