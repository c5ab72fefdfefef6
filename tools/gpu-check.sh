#!/usr/bin/env bash
# The whole GPU check on a machine with one or more GPUs, in under 8 minutes on one GPU:
#   1. the GPU-marked tests (they stop, not skip, when nvidia-smi lists GPUs that torch cannot see);
#   2. a short `stoker bench gpu` (resnet18, 2 interleaved repeats of each run, medians), figures in gpu-check/.
# Usage: tools/gpu-check.sh [PYTHON]   (default: .venv/bin/python, else python3). Exit status: the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi -L | tee "$OUT/gpus.txt"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sees', torch.cuda.device_count(), 'GPUs')" \
  | tee -a "$OUT/gpus.txt"

started=$(date +%s)
timeout 330 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
  tests/integration/test_gpu_paths.py tests/integration/test_gpu.py tests/unit/test_devices.py \
  --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt"
echo "GPU tests: $(( $(date +%s) - started )) s" | tee -a "$OUT/gpu-tests.txt"

started=$(date +%s)
timeout 240 "$PYTHON" -m stoker bench gpu --device cuda --models resnet18 --batch-size 128 --images 5120 \
  --steps 30 --repeats 2 --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.txt"
echo "bench gpu: $(( $(date +%s) - started )) s" | tee -a "$OUT/bench-gpu.txt"
