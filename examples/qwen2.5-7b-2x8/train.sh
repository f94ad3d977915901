#!/usr/bin/env bash
# The training node of examples/qwen2.5-7b-2x8: 8 processes under ZeRO-3, generating on the vLLM server that serve.sh
# started on the other node. Run it second, from any directory:
#   VLLM_HOST=gen-node SHARED_DIR=/shared/dapo-7b examples/qwen2.5-7b-2x8/train.sh      (extra flags win)
# SHARED_DIR must be on a file system both nodes mount at the same path: the server reloads weights from
# SHARED_DIR/vllm_weights (mounted elsewhere there: VLLM_WEIGHT_SYNC_SERVER_DIR=its path on the server).
# Checkpoints go to SHARED_DIR too; the same command resumes from the newest complete one.
# SIGTERM or SIGUSR1 to this script saves a checkpoint and exits 0 (docs/reliability.md#preemption).
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_HOST="${VLLM_HOST:?set VLLM_HOST to the generation node running serve.sh}"
SHARED_DIR="${SHARED_DIR:?set SHARED_DIR to a folder both nodes see at this path}"
here=examples/qwen2.5-7b-2x8
extra=()
[[ -n "${VLLM_WEIGHT_SYNC_SERVER_DIR:-}" ]] && extra+=(--vllm_weight_sync_server_dir "$VLLM_WEIGHT_SYNC_SERVER_DIR")
until curl -sf "http://$VLLM_HOST:8000/health" > /dev/null; do
  echo "waiting for the vLLM server at http://$VLLM_HOST:8000 ..."; sleep 10
done
# torchrun passes SIGUSR1 on to the training processes and waits for their checkpoint (docs/reliability.md).
export TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-360}"   # preemption grace 300 s + 60
exec accelerate launch --config_file "$here/accelerate.yaml" train_dapo.py --config "$here/recipe.yaml" \
  --vllm_server_host "$VLLM_HOST" --output_dir "$SHARED_DIR" --resume_from_checkpoint latest "${extra[@]}" "$@"
