#!/usr/bin/env bash
# The whole GPU check, in under 8 minutes on one H100 (estimated: it has never run on a GPU), on a machine with
# no network:
#   0. preflight, in seconds: the Python packages (OpenCV 4.11 or later: stoker reads cv2.IMREAD_COLOR_RGB), torch
#      sees the GPUs nvidia-smi lists, /dev/shm's size (stoker's ring lives there), and a one-GPU NCCL smoke test
#      under `timeout` (the group's init bound to cuda:0, an all_reduce, the gloo side group the consumers make);
#   1. the GPU-marked tests that need one GPU (they stop, not skip, when nvidia-smi lists GPUs torch cannot see);
#   2. `stoker bench gpu` at resnet18 and resnet50, batch 128, each system timed from its steady state over 200
#      steps (--steps-ahead 3), its JPEGs written once, in parallel; then stoker alone on resnet18 at
#      --steps-ahead 2 (the design asks the first GPU run to compare 2 and 3: bench-gpu-*.json's "host" share);
#   3. with two GPUs or more, the two-GPU tests (after the benchmark: they are the longest; outside the 8 minutes).
# nvidia-smi is sampled every second throughout, each sample with the phase it was taken in (gpu-samples.csv), and
# summed up per phase at the end (gpu-phases.txt: mean and peak utilization, peak memory).
# Each step runs whatever the others' status, under its own time limit, its output written as it goes and kept
# when it ends (a step cut short keeps what it wrote). The last lines say what was not checked.
# Usage: tools/gpu-check.sh [PYTHON]   (default: .venv/bin/python, else python3).
# Exit status: the worst step's (0 when every step passed; 2 when a package is missing, and nothing runs).
# The test suite runs this on a CPU with a fake nvidia-smi, through these settings (defaults in brackets):
#   GPU_CHECK_OUT [gpu-check]  GPU_CHECK_TESTS_S [200]  GPU_CHECK_BENCH_S [150, each model]  GPU_CHECK_TWO_GPU_S
#   [300]  GPU_CHECK_DEVICE [cuda: cpu runs the benchmark and skips the NCCL smoke test]  GPU_CHECK_BENCH_ARGS
#   [--batch-size 128 --steps 200 --repeats 1]  GPU_CHECK_MODELS [resnet18 resnet50]  GPU_CHECK_SAMPLE_S [1]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${GPU_CHECK_OUT:-gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TESTS="tests/integration/test_gpu_paths.py tests/integration/test_gpu.py tests/unit/test_devices.py"
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---batch-size 128 --steps 200 --repeats 1}
MODELS=${GPU_CHECK_MODELS:-resnet18 resnet50}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
began=$(date +%s)
not_checked=()

keep_worst() {  # the exit status of the step that just ended, if worse than the worst so far
  if [ "$1" -gt "$status" ]; then status=$1; fi
}

timed() {  # timed NAME LOG SECONDS COMMAND...: the command under a time limit, its output in LOG, its status kept
  local name=$1 log=$2 limit=$3 started rc
  shift 3
  started=$(date +%s)
  echo "$name" > "$OUT/phase"
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

# nvidia-smi sampled throughout, each line with the phase it was taken in; stopped however the script ends
echo "preflight" > "$OUT/phase"
echo "phase,timestamp,index,utilization_gpu_pct,memory_used_mib,memory_total_mib" > "$OUT/gpu-samples.csv"
(
  while :; do
    phase=$(cat "$OUT/phase" 2>/dev/null)
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits \
      2>/dev/null | sed "s/^/$phase,/"
    sleep "${GPU_CHECK_SAMPLE_S:-1}"
  done >> "$OUT/gpu-samples.csv"
) &
sampler=$!
scratch=$(mktemp -d "${TMPDIR:-/tmp}/stoker-gpu-check-XXXXXX")
trap 'kill "$sampler" 2>/dev/null; rm -rf "$scratch"' EXIT

nvidia-smi -L | tee "$OUT/gpus.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU ')
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sees', torch.cuda.device_count(), 'GPUs')" \
  | tee -a "$OUT/gpus.txt"
# Docker's default is 64 MB; the benchmark's ring (batch 128, 224 px) needs about 77 MB, and says so if it lacks it.
df -h /dev/shm | tee -a "$OUT/gpus.txt"
if [ "$DEVICE" = cuda ]; then
  # One GPU's NCCL group as a consumer makes it (FileStore, device_id: eager init), its first collective, and the
  # gloo side group: a hang here would otherwise be a consumer that never starts (its start-up bound names it).
  timed "NCCL smoke test" "$OUT/nccl-smoke.txt" 60 "$PYTHON" - "$scratch/store" <<'EOF'
import sys
import torch
import torch.distributed as dist

assert torch.cuda.device_count() >= 1, "torch sees no GPU"
dist.init_process_group("nccl", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
total = torch.ones(4, device="cuda:0")
dist.all_reduce(total)
side = dist.new_group(backend="gloo")
dist.all_reduce(torch.ones(1), group=side)
torch.cuda.synchronize()
dist.destroy_process_group()
print("NCCL", ".".join(map(str, torch.cuda.nccl.version())), "one-GPU group: init, all_reduce, gloo side group: ok")
EOF
else
  not_checked+=("NCCL (GPU_CHECK_DEVICE=$DEVICE)")
fi

# shellcheck disable=SC2086  # the lists are word-split on purpose
timed "GPU tests" "$OUT/gpu-tests.txt" "${GPU_CHECK_TESTS_S:-200}" \
  "$PYTHON" -m pytest -q -m "gpu and not two_gpus" -p no:cacheprovider $TESTS --junitxml "$OUT/gpu-tests.xml"

for model in $MODELS; do  # the first run writes the JPEGs into $scratch/jpegs (in parallel); the others read them
  # shellcheck disable=SC2086
  timed "bench gpu $model" "$OUT/bench-gpu-$model.txt" "${GPU_CHECK_BENCH_S:-150}" \
    "$PYTHON" -m stoker bench gpu --device "$DEVICE" --models "$model" $BENCH_ARGS --steps-ahead 3 \
    --data "$scratch/jpegs" --json "$OUT/bench-gpu-$model.json"
done
first_model=${MODELS%% *}
# shellcheck disable=SC2086
timed "bench gpu $first_model steps-ahead 2" "$OUT/bench-gpu-$first_model-ahead2.txt" "${GPU_CHECK_BENCH_S:-150}" \
  "$PYTHON" -m stoker bench gpu --device "$DEVICE" --models "$first_model" $BENCH_ARGS --steps-ahead 2 \
  --runs stoker --data "$scratch/jpegs" --json "$OUT/bench-gpu-$first_model-ahead2.json"

if [ "$gpus" -ge 2 ]; then
  # shellcheck disable=SC2086
  timed "two-GPU tests" "$OUT/two-gpu-tests.txt" "${GPU_CHECK_TWO_GPU_S:-300}" \
    "$PYTHON" -m pytest -q -m "gpu and two_gpus" -p no:cacheprovider $TESTS --junitxml "$OUT/two-gpu-tests.xml"
else
  not_checked+=("the two-GPU paths (NCCL between GPUs, averaging, tests marked two_gpus): $gpus GPU listed")
fi
kill "$sampler" 2>/dev/null
"$PYTHON" - "$OUT/gpu-samples.csv" <<'EOF' | tee "$OUT/gpu-phases.txt"
import csv
import sys
from collections import defaultdict

phases = defaultdict(list)
with open(sys.argv[1]) as samples:
    for row in csv.DictReader(samples):
        try:
            phases[row["phase"]].append((float(row["utilization_gpu_pct"]), float(row["memory_used_mib"])))
        except (TypeError, ValueError):  # a sample cut short, or [N/A]
            continue
print(f"{'phase':40} {'samples':>7} {'util mean %':>11} {'util peak %':>11} {'memory peak MiB':>15}")
for phase, values in phases.items():
    utilization = [u for u, _ in values]
    print(f"{phase:40} {len(values):>7} {sum(utilization) / len(values):>11.0f} {max(utilization):>11.0f} "
          f"{max(m for _, m in values):>15.0f}")
EOF
elapsed=$(( $(date +%s) - began ))
echo "gpu-check: $elapsed s in all$( [ "$elapsed" -gt 480 ] && echo ' (over the 8 minutes it is meant to take)')"
for item in "${not_checked[@]}"; do
  echo "gpu-check: not checked: $item"
done
echo "gpu-check: exit status $status (figures in $OUT/)"
exit "$status"
