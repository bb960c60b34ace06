#!/usr/bin/env bash
# The GPU check, run on a machine with one or more NVIDIA GPUs before a change to the runner,
# the engines, the hub, the services or the placement lands:
#   1. every `gpu`-marked test (kernels, CUDA graphs, `specdec serve` on the GPU as a user
#      starts it, the services' mains with their devices named);
#   2. a short system benchmark through `specdec serve` (8B/1B-shaped random checkpoints,
#      batch 1 and 8, k = 4, synthetic L = 3, lock-step and draft-ahead at a synthetic hit
#      rate of 0.8, and draft-ahead with the BENCHMARKING ONLY draft stand-in at 0.8), a few
#      minutes.
# Writes bench/results/gpu_check_<GPU>.log (or under --out DIR): its first line is the commit
# it ran on, its last line the result. Needs the runtime dependencies, ray included, and
# pytest; run from the source tree (the script sets PYTHONPATH).
#
#   bash scripts/gpu_check.sh [--out DIR] [--skip-bench | --skip-tests] [pytest args...]
#
# --skip-bench and --skip-tests run one half each, e.g. the two halves at once on disjoint
# GPUs of one host (CUDA_VISIBLE_DEVICES=0,1 and =2,3, each with its own --out DIR, since both
# name their log after the GPUs, and its own RAY_TMPDIR); the check is both logs passing. On
# two H200s the tests half took 378 s and the benchmark half about 340 s (2026-11-28): a
# limit on the call must leave room for both.
# pytest args apply to the tests half only.
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench/results
bench=1
tests=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --skip-bench) bench=0; shift ;;
        --skip-tests) tests=0; shift ;;
        *) break ;;
    esac
done
if [[ $bench -eq 0 && $tests -eq 0 ]]; then
    echo "gpu_check: --skip-bench and --skip-tests leave nothing to run." >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L fails); run it on a GPU machine." >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the GPUs this run sees (CUDA_VISIBLE_DEVICES counts; nvidia-smi lists every GPU of the host)
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
visible=${CUDA_VISIBLE_DEVICES:-}
first=${visible%%,*}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i "${first:-0}" | tr -c 'A-Za-z0-9\n' '_')
[[ $gpus -gt 1 ]] && name="${name}_x${gpus}"
mkdir -p "$out"
log="$out/gpu_check_${name}.log"
# SPECDEC_COMMIT names the commit where the tree came without its own .git (a copied tree)
if [[ -n ${SPECDEC_COMMIT:-} ]]; then
    commit="$SPECDEC_COMMIT (given by SPECDEC_COMMIT)"
    dirty=0
else
    commit=$(git rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)")
    dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
fi
{
    echo "commit $commit$([[ $dirty -gt 0 ]] && echo " with $dirty modified tracked files")"
    echo "date $(date -u +%FT%TZ); $gpus x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i "${first:-0}")${visible:+ (CUDA_VISIBLE_DEVICES=$visible)}"
    python3 -c 'import torch, triton, grpc; print(f"torch {torch.__version__}, triton {triton.__version__}, grpcio {grpc.__version__}")'
} >"$log"
status=0
summary="not run (--skip-tests)"
if [[ $tests -eq 1 ]]; then
    echo "== pytest -m gpu" | tee -a "$log"
    python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | tee -a "$log"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" | tail -1 | tr -d '=' | xargs)
fi
if [[ $bench -eq 1 ]]; then
    echo "== bench/e2e_bench.py --serve (quick)" | tee -a "$log"
    python3 bench/e2e_bench.py --serve --out "$out/gpu_check_bench" \
        --cache "${SPECDEC_BENCH_CACHE:-/tmp/specdec-e2e-checkpoints}" \
        --batches 1 8 --lengths 3 --serve-lengths 3 --serve-hit-rates 0.8 --serve-stand-in 0.8 --warmup 8 --steps 32 --serve-steps 32 \
        --inprocess-iters 5 --ttft-repeats 2 2>&1 | tee -a "$log"
    bench_rc=${PIPESTATUS[0]}
    [[ $bench_rc -ne 0 ]] && status=1
    summary="$summary; e2e_bench --serve exit $bench_rc"
fi
if [[ $status -eq 0 ]]; then
    echo "RESULT PASS: gpu tests $summary" | tee -a "$log"
else
    echo "RESULT FAIL: gpu tests $summary" | tee -a "$log"
fi
exit $status
