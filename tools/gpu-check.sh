#!/usr/bin/env bash
# The whole GPU check on a machine with one or more GPUs, in under 8 minutes on one GPU:
#   0. the Python packages the check needs, and the size of /dev/shm (stoker's ring lives there);
#   1. the GPU-marked tests that need one GPU (they stop, not skip, when nvidia-smi lists GPUs torch cannot see);
#   2. a short `stoker bench gpu` (resnet18, 2 interleaved repeats of each run, medians), figures in gpu-check/,
#      rewritten as each run ends;
#   3. with two GPUs or more, the two-GPU tests (after the benchmark: they are the longest).
# Each step runs whatever the others' status, under its own time limit; a step cut short keeps what it wrote.
# Usage: tools/gpu-check.sh [PYTHON]   (default: .venv/bin/python, else python3).
# Exit status: the worst step's (0 when every step passed; 2 when a package is missing, and nothing runs).
# The test suite runs this on a CPU with a fake nvidia-smi, through these settings (defaults in brackets):
#   GPU_CHECK_OUT [gpu-check]  GPU_CHECK_TESTS_S [250]  GPU_CHECK_BENCH_S [200]  GPU_CHECK_TWO_GPU_S [300]
#   GPU_CHECK_BENCH_ARGS [the resnet18 run below]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${GPU_CHECK_OUT:-gpu-check}
TESTS="tests/integration/test_gpu_paths.py tests/integration/test_gpu.py tests/unit/test_devices.py"
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---device cuda --models resnet18 --batch-size 128 --images 3840 --steps 30 --repeats 2}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

keep_worst() {  # the exit status of the step that just ended, if worse than the worst so far
  if [ "$1" -gt "$status" ]; then status=$1; fi
}

timed() {  # timed NAME LOG SECONDS COMMAND...: the command under a time limit, its output in LOG, its status kept
  local name=$1 log=$2 limit=$3 started rc
  shift 3
  started=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$log"
  rc=$?
  [ "$rc" -eq 124 ] && echo "$name: stopped at its limit of $limit s" | tee -a "$log"
  echo "$name: $(( $(date +%s) - started )) s, exit status $rc" | tee -a "$log"
  keep_worst "$rc"
}

missing=$("$PYTHON" - <<'EOF'
import importlib
# obstore and pycurl are not asked for: only remote sources use them, and this machine reads local files
names = "torch numpy PIL simplejpeg cv2 pydantic rich matplotlib setproctitle pytest pytest_timeout sklearn"
missing = []
for name in names.split():
    try:
        module = importlib.import_module(name)
    except Exception as error:  # an ImportError, or a module that fails as it loads (cv2 without libGL)
        missing.append(f"{name} ({type(error).__name__}: {error})")
        continue
    if name == "cv2" and not hasattr(module, "IMREAD_COLOR_RGB"):  # stoker reads it at import: OpenCV 4.11
        missing.append(f"cv2 (OpenCV {getattr(module, '__version__', '?')}: stoker needs 4.11 or later)")
print("; ".join(missing))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu-check: missing Python packages, nothing was run: $missing" | tee "$OUT/gpus.txt"
  echo "  install them first: make install (or pip install -e '.[test,bench]')" | tee -a "$OUT/gpus.txt"
  exit 2
fi

nvidia-smi -L | tee "$OUT/gpus.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU ')
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sees', torch.cuda.device_count(), 'GPUs')" \
  | tee -a "$OUT/gpus.txt"
# Docker's default is 64 MB; the benchmark's ring (batch 128, 224 px) needs about 77 MB, and says so if it lacks it.
df -h /dev/shm | tee -a "$OUT/gpus.txt"

# shellcheck disable=SC2086  # the lists are word-split on purpose
timed "GPU tests" "$OUT/gpu-tests.txt" "${GPU_CHECK_TESTS_S:-250}" \
  "$PYTHON" -m pytest -q -m "gpu and not two_gpus" -p no:cacheprovider $TESTS --junitxml "$OUT/gpu-tests.xml"

# shellcheck disable=SC2086
timed "bench gpu" "$OUT/bench-gpu.txt" "${GPU_CHECK_BENCH_S:-200}" \
  "$PYTHON" -m stoker bench gpu $BENCH_ARGS --json "$OUT/bench-gpu.json"

if [ "$gpus" -ge 2 ]; then
  # shellcheck disable=SC2086
  timed "two-GPU tests" "$OUT/two-gpu-tests.txt" "${GPU_CHECK_TWO_GPU_S:-300}" \
    "$PYTHON" -m pytest -q -m "gpu and two_gpus" -p no:cacheprovider $TESTS --junitxml "$OUT/two-gpu-tests.xml"
fi
echo "gpu-check: exit status $status (figures in $OUT/)"
exit "$status"
