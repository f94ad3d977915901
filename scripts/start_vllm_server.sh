#!/usr/bin/env bash
# Start a vLLM server for DAPOTrainer's `--use_vllm --vllm_mode server`.
#   MODEL_PATH=Qwen/Qwen2.5-32B TP=8 scripts/start_vllm_server.sh                  # NCCL weight sync (TRL default)
#   WEIGHT_SYNC=shared_storage MODEL_PATH=... scripts/start_vllm_server.sh        # --vllm_weight_sync shared_storage
# Then train with --use_vllm true --vllm_mode server --vllm_server_host THIS_HOST --vllm_server_port $PORT
# (plus --vllm_weight_sync shared_storage --vllm_weight_sync_dir DIR_BOTH_SIDES_READ for shared storage).
set -euo pipefail
MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the policy's initial weights (the trainer's --model_name_or_path)}"
HOST="${HOST:-0.0.0.0}"
PORT="${PORT:-8000}"
TP="${TP:-1}"                          # tensor parallel size (GPUs of this server)
DP="${DP:-1}"                          # data parallel replicas
DTYPE="${DTYPE:-auto}"                 # use float32 for a float32 checkpoint on CPU (auto would run bf16)
MAX_MODEL_LEN="${MAX_MODEL_LEN:-}"     # prompt + completion tokens, e.g. 22528 for DAPO's 2048 + 20480
GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-0.9}"
WEIGHT_SYNC="${WEIGHT_SYNC:-nccl}"

# Dev mode exposes /collective_rpc (weight reload) and /reset_prefix_cache, which weight sync needs.
export VLLM_SERVER_DEV_MODE=1
args=(serve "$MODEL_PATH" --host "$HOST" --port "$PORT" --tensor-parallel-size "$TP" --data-parallel-size "$DP"
      --dtype "$DTYPE" --logprobs-mode processed_logprobs --max-logprobs -1)
[[ -n "$MAX_MODEL_LEN" ]] && args+=(--max-model-len "$MAX_MODEL_LEN")
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  args+=(--gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")
else   # vLLM for CPU (scripts/setup_vllm_cpu.sh): keep start-up short and the KV cache small
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
  # Seeded requests (--rollout_streaming) crash vLLM-CPU 0.31 when a prefill is split in chunks ("CPU Generator does
  # not use offset"): prefill whole prompts instead.
  args+=(--enforce-eager --no-enable-chunked-prefill)
fi
if [[ "$WEIGHT_SYNC" == "nccl" ]]; then
  args+=(--weight-transfer-config '{"backend": "nccl"}')   # what TRL's NCCL broadcast talks to
fi
exec vllm "${args[@]}" "$@"
