#!/usr/bin/env bash
# The generation node of examples/qwen3-30b-a3b-3x8: vLLM serving Qwen3-30B-A3B on its 8 GPUs on port 8000, as vLLM
# runs a mixture of experts with data parallelism: the attention is data parallel (4 engines, each over 2 GPUs with
# tensor parallel 2, each scheduling its own requests) and the expert layers are one group over all 8 GPUs, every
# forward in lockstep. --enable-expert-parallel makes that group expert parallel (EP = DP x TP = 8: 16 whole experts
# of each layer per GPU) rather than tensor parallel; either way one copy of the experts is spread over the node:
# ~8.8 GB of bf16 weights per GPU (docs/figures.md#qwen3-30b-a3b-on-vllm), the rest KV cache. vLLM's NCCL
# weight-transfer engine is what TRL's weight sync talks to (WEIGHT_SYNC=nccl: --weight-transfer-config, dev mode).
# Run it first, from any directory:
#   examples/qwen3-30b-a3b-3x8/serve.sh            (extra arguments go to `vllm serve`)
# The training node 0 must reach this node, and this node the training node 0 (NCCL group, port 51216 by default).
# Routing replay (recipe: routing_replay true, with a smaller batch): VLLM_USE_V2_MODEL_RUNNER=1 in the environment
# and --enable-return-routed-experts as an argument (docs/moe.md#routing-replay---routing_replay).
set -euo pipefail
cd "$(dirname "$0")/../.."
export MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-30B-A3B-Base}"   # the recipe's model_name_or_path
export TP=2 DP=4                                            # 8 GPUs: attention 4 x TP 2, experts over all 8
export PORT=8000 MAX_MODEL_LEN=22528                        # 2048 prompt + 20480 response tokens
export WEIGHT_SYNC=nccl
exec scripts/start_vllm_server.sh --enable-expert-parallel "$@"
