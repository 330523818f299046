#!/usr/bin/env bash
# The first command of a session lent a GPU: the GPU check with the training-step profile, in one run of about
# 9 minutes (docs/benchmarks.md#gpu). It runs from the source tree with the machine's own python3 and PyTorch
# (nothing is installed), so it also works on a machine that cannot reach a package index:
#
#     bash benchmarks/gpu_session.sh OUT [MINUTES]        (or: make gpu-session)
#
# OUT receives gpu_check.json, gpu_check.md, pytest.log and session.log (four files, one folder). MINUTES (8) is
# the check's budget: `pytest -m cuda`, the profile (fp32, bf16, bf16 with the Triton kernels; batch 128 and 512),
# the routing benchmarks and the epoch table with and without CUDA graphs and the Triton kernels (no Fashion-MNIST
# accuracy run). The epochs train on Fashion-MNIST when CAPSNET_DATA (default: .gpu-data beside this folder, if it
# exists) holds fashion-mnist/ with its four IDX files, else on generated images.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_session.sh OUT [MINUTES]}
minutes=${2:-8}
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
"$python" benchmarks/gpu_check.py --out "$out" --minutes "$minutes" --profile \
    --profile-variants fp32 bf16 bf16+triton --no-accuracy 2>&1 | tee -a "$out/session.log"
status=${PIPESTATUS[0]}
echo "gpu_check exit status: $status" | tee -a "$out/session.log"
exit "$status"
