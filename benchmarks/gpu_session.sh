#!/usr/bin/env bash
# The first command of a session lent a GPU: the GPU check with the training-step profile, then Fashion-MNIST rows
# of the zoo for the minutes left, in one run of about 9.3 minutes (docs/benchmarks.md#gpu). It runs from the source
# tree with the machine's own python3 and PyTorch (nothing is installed), so it also works on a machine that cannot
# reach a package index:
#
#     bash benchmarks/gpu_session.sh OUT [MINUTES]        (or: make gpu-session)
#
# MINUTES (9.3) is the whole run's budget. The check gets CHECK_MINUTES (5) of it: `pytest -m cuda`, the profile
# (fp32, bf16, bf16 with the Triton kernels; batch 128 and 512), the routing benchmarks and the epoch table with and
# without CUDA graphs and the Triton kernels (no accuracy run). The epochs train on Fashion-MNIST when CAPSNET_DATA
# (default: .gpu-data beside this folder, if it exists) holds fashion-mnist/ with its four IDX files, else on
# generated images. With those files, benchmarks/gpu_zoo.py then trains the Fashion-MNIST rows that results/ lacks
# until the budget ends. OUT receives gpu_check.json, gpu_check.md, pytest.log, session.log and, from the rows,
# zoo/fashion-mnist.csv and zoo/logs.tgz (six files; the runs stay in /tmp).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_session.sh OUT [MINUTES]}
minutes=${2:-9.3}
check_minutes=${CHECK_MINUTES:-5}
start=$(date +%s)
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root" || exit 2
if [[ -z "${CAPSNET_DATA:-}" && -d .gpu-data ]]; then
    export CAPSNET_DATA="$root/.gpu-data"
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
    "$python" - <<'PY' 2>&1 || true
import importlib.util, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("triton", __import__("triton").__version__ if importlib.util.find_spec("triton") else None)
PY
    echo "CAPSNET_DATA=${CAPSNET_DATA:-}"
} | tee "$out/session.log"
"$python" benchmarks/gpu_check.py --out "$out" --minutes "$check_minutes" --profile \
    --profile-variants fp32 bf16 bf16+triton --no-accuracy \
    --variants fp32 bf16 bf16+graphs+triton bf16+graphs bf16+triton bf16+compile 2>&1 | tee -a "$out/session.log"
status=${PIPESTATUS[0]}
echo "gpu_check exit status: $status" | tee -a "$out/session.log"
if [[ $status -ne 2 && -d "${CAPSNET_DATA:-}/fashion-mnist" ]]; then
    left=$(awk -v m="$minutes" -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.2f", m - s / 60 }')
    "$python" benchmarks/gpu_zoo.py --out "$out/zoo" --work /tmp/capsnet-gpu-zoo --minutes "$left" \
        --dataset "$CAPSNET_DATA/fashion-mnist" 2>&1 | tee -a "$out/session.log"
fi
exit "$status"
