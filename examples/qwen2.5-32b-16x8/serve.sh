#!/usr/bin/env bash
# One of the 8 generation nodes of examples/qwen2.5-32b-16x8. Together they serve Qwen2.5-32B as ONE vLLM endpoint
# (port 8000 on generation node 0) of 16 data-parallel replicas, each tensor parallel over 4 GPUs, 2 per node
# (vLLM's multi-node data parallelism: node 0 runs the API server, the others run --headless engines that connect
# to it). Weights are reloaded from the shared file system (WEIGHT_SYNC=shared_storage): every replica reloads
# every version the trainer writes. Run it on all 8 generation nodes, from any directory:
#   GEN_RANK=0 GEN_HEAD=gen-0 examples/qwen2.5-32b-16x8/serve.sh         # generation node 0: the endpoint
#   GEN_RANK=1 GEN_HEAD=gen-0 examples/qwen2.5-32b-16x8/serve.sh         # ... up to GEN_RANK=7 on the others
# The endpoint answers `curl -sf http://gen-0:8000/health` once every replica is up; train.sh waits for that.
# Extra arguments go to `vllm serve`.
set -euo pipefail
cd "$(dirname "$0")/../.."
GEN_RANK="${GEN_RANK:?set GEN_RANK to the index of this generation node, 0-7 (0 serves the endpoint)}"
GEN_HEAD="${GEN_HEAD:?set GEN_HEAD to generation node 0 (GEN_RANK=0)}"
export MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-32B}"   # the recipe's model_name_or_path
export TP=4 DP=16                                      # 8 nodes x 8 GPUs: 16 replicas of 4 GPUs, 2 per node
export PORT=8000 MAX_MODEL_LEN=22528                   # 2048 prompt + 20480 response tokens
export WEIGHT_SYNC=shared_storage
parallel=(--data-parallel-size-local 2 --data-parallel-address "$GEN_HEAD"
          --data-parallel-rpc-port "${DP_RPC_PORT:-13345}")
if [[ "$GEN_RANK" != 0 ]]; then
  parallel+=(--headless --data-parallel-start-rank $((GEN_RANK * 2)))
fi
exec scripts/start_vllm_server.sh "${parallel[@]}" "$@"
