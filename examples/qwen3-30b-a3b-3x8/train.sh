#!/usr/bin/env bash
# One of the two training nodes of examples/qwen3-30b-a3b-3x8 (8 processes each, 16 under ZeRO-3), generating on
# the vLLM server that serve.sh started on the third node. Run it on both training nodes, from any directory:
#   NODE_RANK=0 MASTER_ADDR=train-0 VLLM_HOST=gen-node SHARED_DIR=/shared/dapo-30b examples/qwen3-30b-a3b-3x8/train.sh
#   NODE_RANK=1 MASTER_ADDR=train-0 VLLM_HOST=gen-node SHARED_DIR=/shared/dapo-30b examples/qwen3-30b-a3b-3x8/train.sh
# SHARED_DIR holds the checkpoints (both training nodes must see it); the same command resumes from the newest
# complete one. SIGTERM or SIGUSR1 to this script saves a checkpoint and exits 0 (docs/reliability.md#preemption).
set -euo pipefail
cd "$(dirname "$0")/../.."
NODE_RANK="${NODE_RANK:?set NODE_RANK to 0 on the first training node, 1 on the second}"
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the first training node (NODE_RANK=0)}"
MASTER_PORT="${MASTER_PORT:-29500}"
VLLM_HOST="${VLLM_HOST:?set VLLM_HOST to the generation node running serve.sh}"
SHARED_DIR="${SHARED_DIR:?set SHARED_DIR to a folder both training nodes see at this path}"
here=examples/qwen3-30b-a3b-3x8
until curl -sf "http://$VLLM_HOST:8000/health" > /dev/null; do
  echo "waiting for the vLLM server at http://$VLLM_HOST:8000 ..."; sleep 10
done
# torchrun passes SIGUSR1 on to the training processes and waits for their checkpoint (docs/reliability.md).
export TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-360}"   # preemption grace 300 s + 60
exec accelerate launch --config_file "$here/accelerate.yaml" --machine_rank "$NODE_RANK" \
  --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
  train_dapo.py --config "$here/recipe.yaml" \
  --vllm_server_host "$VLLM_HOST" --output_dir "$SHARED_DIR" --resume_from_checkpoint latest "$@"
