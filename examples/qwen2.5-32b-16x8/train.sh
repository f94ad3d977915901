#!/usr/bin/env bash
# One of the 8 training nodes of examples/qwen2.5-32b-16x8 (8 processes each, 64 under ZeRO-3), generating on the
# vLLM endpoint of generation node 0 (serve.sh). Run it on all 8 training nodes, from any directory:
#   NODE_RANK=0 MASTER_ADDR=train-0 GEN_HEAD=gen-0 SHARED_DIR=/shared/dapo-32b examples/qwen2.5-32b-16x8/train.sh
#   NODE_RANK=1 ... up to NODE_RANK=7, with the same MASTER_ADDR, GEN_HEAD and SHARED_DIR
# SHARED_DIR must be on a file system all 16 nodes mount at the same path: the replicas reload weights from
# SHARED_DIR/vllm_weights (mounted elsewhere there: VLLM_WEIGHT_SYNC_SERVER_DIR=its path on the generation nodes).
# Checkpoints go to SHARED_DIR too; the same command resumes from the newest complete one.
# SIGTERM or SIGUSR1 to this script saves a checkpoint and exits 0 (docs/reliability.md#preemption).
set -euo pipefail
cd "$(dirname "$0")/../.."
NODE_RANK="${NODE_RANK:?set NODE_RANK to the index of this training node, 0-7}"
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to training node 0 (NODE_RANK=0)}"
MASTER_PORT="${MASTER_PORT:-29500}"
GEN_HEAD="${GEN_HEAD:?set GEN_HEAD to generation node 0, whose serve.sh runs the vLLM endpoint}"
SHARED_DIR="${SHARED_DIR:?set SHARED_DIR to a folder all nodes see at this path}"
here=examples/qwen2.5-32b-16x8
extra=()
[[ -n "${VLLM_WEIGHT_SYNC_SERVER_DIR:-}" ]] && extra+=(--vllm_weight_sync_server_dir "$VLLM_WEIGHT_SYNC_SERVER_DIR")
until curl -sf "http://$GEN_HEAD:8000/health" > /dev/null; do
  echo "waiting for the vLLM endpoint at http://$GEN_HEAD:8000 ..."; sleep 10
done
# torchrun passes SIGUSR1 on to the training processes and waits for their checkpoint (docs/reliability.md); a save
# of this model (~460 GB: docs/figures.md) takes minutes: give it PREEMPTION_GRACE_SECONDS (the sbatch sets 780).
grace="${PREEMPTION_GRACE_SECONDS:-300}"
export TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((grace + 60))}"
exec accelerate launch --config_file "$here/accelerate.yaml" --machine_rank "$NODE_RANK" \
  --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
  train_dapo.py --config "$here/recipe.yaml" --preemption_grace_seconds "$grace" \
  --vllm_server_host "$GEN_HEAD" --output_dir "$SHARED_DIR" --resume_from_checkpoint latest "${extra[@]}" "$@"
