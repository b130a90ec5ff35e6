#!/usr/bin/env bash
# One-go GPU benchmark of SPEAR++ (issue #33): GPU and 16 CPU threads side by side, cell by
# cell, plus torch.profiler summaries of (20, 200) and (150, 4000). About 4-6 minutes on one
# H100/H200 with 16 cores; a hard stop at GPU_RUN_SECONDS (default 420 s) keeps what was
# measured (results.json is rewritten after every cell). Then the many-clients measurement:
# MANY_CLIENTS (default 100) clients' (20, 200) updates audited on the GPU with 1, 4 and 8
# attacks at once (OUT/many_clients; hard stop at MANY_CLIENTS_SECONDS, default 300 s;
# MANY_CLIENTS=0 skips it).
#
#   experiments/gpu_run.sh [OUT_DIR] [extra gpu_bench.py options]
#
# Run from the repository root. CIFAR-10 (the *_prefix.npz subset) is looked up in
# $FL_ATTACK_DATA, else ./gpu_data (holding cifar10/data_batch_{1..5}_prefix.npz and
# cifar10/batches.meta), else the usual places; without it the bundled photo patches are used
# and the table says so.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-outputs/gpu_bench}}"
shift || true
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${FL_ATTACK_DATA:-}" && -d "$PWD/gpu_data/cifar10" ]]; then
    export FL_ATTACK_DATA="$PWD/gpu_data"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-16}"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
    echo "cpu cores: $(nproc --all)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
status=0
timeout --signal=INT --kill-after=20 "${GPU_RUN_SECONDS:-420}" \
    python -u experiments/gpu_bench.py --out "$OUT" \
        --cpu-threads "${CPU_THREADS:-16}" --time-budget 120 --cell-budget 90 \
        --total-budget "${GPU_TOTAL_BUDGET:-330}" \
        --profile-cells 20x200,150x4000 --fallback-dataset photo-patches "$@" \
    2>&1 | tee "$OUT/log.txt" || status=$?
echo "gpu_run: exit status $status; outputs in $OUT" | tee -a "$OUT/log.txt"
if [[ "${MANY_CLIENTS:-100}" -gt 0 ]] && python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    mkdir -p "$OUT/many_clients"
    many_status=0
    timeout --signal=INT --kill-after=20 "${MANY_CLIENTS_SECONDS:-300}" \
        python -u experiments/gpu_bench.py --out "$OUT/many_clients" --cells none --devices cuda \
            --cpu-threads "${CPU_THREADS:-16}" --time-budget 60 \
            --clients "${MANY_CLIENTS:-100}" --workers ${MANY_WORKERS:-1 4 8} \
            --fallback-dataset photo-patches \
        2>&1 | tee "$OUT/many_clients/log.txt" || many_status=$?
    echo "gpu_run: many clients exit status $many_status; outputs in $OUT/many_clients" \
        | tee -a "$OUT/many_clients/log.txt"
    if [[ "$status" -eq 0 ]]; then status=$many_status; fi
fi
exit "$status"
