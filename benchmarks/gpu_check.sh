#!/usr/bin/env bash
# GPU check: DAPOTrainer against TRL's GRPOTrainer on one CUDA GPU (a random-init Qwen2.5-0.5B, responses up to
# 4k and 16k tokens, padding-free against padded, activation checkpointing): tokens/s, peak GPU memory and whether
# packed forwards reached a varlen attention kernel, as a markdown table and <out>/results.json. What it measures,
# and how to install what a bare GPU image lacks (trl 1.16, datasets: pip wheels, no network needed), is in the
# header of benchmarks/gpu_check.py; this wrapper only caps the wall time at 10 minutes.
#
#   benchmarks/gpu_check.sh --out gpu-check-results             # arguments go to benchmarks/gpu_check.py
#   WHEELS=wheels benchmarks/gpu_check.sh --out results         # first: pip install --no-index from ./wheels
#
# Exit status: 0 checks passed, 1 a check or a run failed, 2 it cannot run here (no CUDA GPU, a missing package),
# 124 past the 10-minute cap (results.json then holds the runs that finished).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if [[ -n "${WHEELS:-}" ]]; then
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" "trl==1.16.0" datasets math-verify
fi
exec timeout --kill-after=20 600 "$PYTHON" benchmarks/gpu_check.py "$@"
