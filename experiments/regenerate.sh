#!/usr/bin/env bash
# Regenerate one claim of results/ with one command:
#
#   bash experiments/regenerate.sh CLAIM [KVCREDIT]     # run the claim's jobs on this machine
#   bash experiments/regenerate.sh CLAIM --report       # only rebuild the report from results/CLAIM/runs
#   bash experiments/regenerate.sh --list               # the claims and where each runs
#
# CLAIM is a folder of results/ with a job list experiments/jobs/CLAIM.jobs (the same list
# experiments/gpu-run.sh ships to a remote GPU machine; docs/guide/gpu.md). The jobs run here
# through that script's driver, with KVCREDIT (default: the release build) as `kvcredit`; their
# output lands in $WORK/R (default /tmp/kvregen-CLAIM/R), to compare with results/CLAIM/ and copy
# over it. `--report` reruns only the analysis over the run folders committed in results/CLAIM.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A WHERE=(
  [replica-floor]="one CUDA GPU, ~10 min (H200) once the 1.5B model is cached"
  [divergence]="one CUDA GPU, ~1 h for the four models (H200)"
  [spectrum]="one CUDA GPU, ~10 min (H200) once the 1.5B model is cached"
  [spectrum-grids]="one CUDA GPU, ~1.5 h per model (H200; the packing runs on the CPU)"
  [spectrum-gpu]="one CUDA GPU, ~5 min (H100) once the three models are cached"
  [spectrum-cpu]="the CPU, ~2.5 h on 2 cores (one process per core)"
  [throughput]="one CUDA GPU with transformers installed, ~3 min"
  [new-architectures]="one CUDA GPU, ~2 min"
)

claim=${1:-}
if [ "$claim" = --list ] || [ -z "$claim" ]; then
  for c in "${!WHERE[@]}"; do printf '%-18s %s\n' "$c" "${WHERE[$c]}"; done | sort
  [ -n "$claim" ] || { echo "usage: $0 CLAIM [KVCREDIT | --report] | --list" >&2; exit 2; }
  exit 0
fi
jobs=experiments/jobs/$claim.jobs
[ -f "$jobs" ] || { echo "regenerate: no claim '$claim' (no $jobs); try --list" >&2; exit 2; }
bin=${2:-${CARGO_TARGET_DIR:-target}/release/kvcredit}

if [ "$bin" = --report ]; then
  bin=${CARGO_TARGET_DIR:-target}/release/kvcredit
  case $claim in
    replica-floor)
      r=results/replica-floor/runs
      "$bin" analyze $r/floor-qwen15-zs-bf16 $r/floor-qwen15-cot-bf16 --out results/replica-floor/report
      "$bin" analyze $r/floor-qwen15-zs-bf16-eager --out results/replica-floor/report-eager
      ;;
    *)
      echo "regenerate: results/$claim keeps no run folders; run the jobs: $0 $claim" >&2
      exit 2
      ;;
  esac
  exit 0
fi

[ -x "$bin" ] || { echo "regenerate: no binary at $bin (make build, or pass its path)" >&2; exit 2; }
bash experiments/gpu-run.sh check "$jobs" > /dev/null
export WORK=${WORK:-/tmp/kvregen-$claim}
rm -rf "$WORK/R" && mkdir -p "$WORK"
ln -sf "$(realpath "$bin")" "$WORK/kvcredit"
echo "regenerate $claim (${WHERE[$claim]:-}): jobs $jobs, output $WORK/R"
bash experiments/gpu-run.sh drive "$jobs"
cat "$WORK/R/steps.txt"
! grep -v ': exit 0 ' "$WORK/R/steps.txt" | grep -q . || { echo "regenerate: a job failed (see $WORK/R/logs)" >&2; exit 1; }
echo "regenerated $claim into $WORK/R: compare with results/$claim/"
