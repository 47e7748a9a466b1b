#!/bin/bash
# Plan for the next H200 session (not yet run): the seed-table reproduction (#16) and the
# one-GPU N-shard byte-identity check (#17). Same pattern as docs/gpu-run6.sh: the first call
# starts a background driver, later calls ship GGUF pieces of 50 MiB (move tests/fixtures aside
# so tree + piece stay under 64 MiB), `poll` packs results into $OUT.
#   R  experiments/repro-run.sh over the four 0.5B specs as soon as the 0.5B has arrived
#      (REPRO_PARALLEL=4: each campaign is latency-bound), then over all eight specs once the
#      1.5B has arrived (finished run dirs resume at once), which also writes the one report.
#      Every run dir resumes on the next session's machine: copy the packed dirs back into
#      $R/repro before starting (docs/runs/<session>/repro/ once committed).
#   L  slurm/local-gpus.sh with GPUS=0 and 2 shards of experiments/gpu-bf16-bi.toml on the one
#      GPU, COMPARE against an unsharded run of the same spec (byte-identity under
#      batch_invariant), after lane R's 0.5B campaigns.
# Modes: setup | join | poll SECS [final] | drive (the driver itself).
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
declare -A PIECES=([qwen2.5-coder-0.5b-instruct]=10 [qwen2.5-coder-1.5b-instruct]=22)

SCRIPT=gpu-run7.sh
# shellcheck source=docs/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh"

lane_r() {
  wait_model qwen2.5-coder-0.5b-instruct
  local small="experiments/repro-qwen05-zs-bf16.toml experiments/repro-qwen05-cot-bf16.toml experiments/repro-qwen05-zs-bf16-bi.toml experiments/repro-qwen05-cot-bf16-bi.toml"
  REPRO_SPECS="$small" REPRO_PARALLEL=4 step 3600 repro-05b bash experiments/repro-run.sh $B $R/repro
  touch $R/repro-05b.done
  wait_model qwen2.5-coder-1.5b-instruct
  REPRO_PARALLEL=4 step 3600 repro-all bash experiments/repro-run.sh $B $R/repro
  touch $R/lane-r.done
}

lane_l() {
  until [ -e $R/repro-05b.done ]; do sleep 5; done
  step 900 bi-whole $B campaign run experiments/gpu-bf16-bi.toml --device cuda --out $R/local-whole --quiet
  GPUS=0 COMPARE=$R/local-whole KVCREDIT=$B step 900 bi-2shards bash slurm/local-gpus.sh experiments/gpu-bf16-bi.toml 2 $R/local-2
  touch $R/lane-l.done
}

pack() {
  rm -rf /tmp/pack && mkdir -p /tmp/pack
  tar czf /tmp/pack/results.tgz -C /tmp R
  split -b 15M -d -a 1 /tmp/pack/results.tgz $OUT/results.tgz.part
  ls -la $OUT
}

case "$1" in
setup)
  mkdir -p /tmp/bin /tmp/m $R $KVCREDIT_HOME/models
  cp gpu/bin/* /tmp/bin/ && cp gpu/ship/* /tmp/m/ 2>/dev/null
  gunzip -c /tmp/bin/kvcredit.gz > $B && chmod +x $B
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu . | tar xf - -C $P
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  sleep 2; cat $R/env.txt; pgrep -f "gpu-run7.sh drive"
  ;;
join)
  cp gpu/ship/* /tmp/m/ 2>/dev/null
  join_models
  ensure_driver; tail -n 3 $R/steps.txt 2>/dev/null
  ;;
drive)
  lane_r > $R/lane-r.log 2>&1 &
  lane_l > $R/lane-l.log 2>&1 &
  wait
  ;;
poll)
  ensure_driver
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ]; do
    [ -e $R/lane-r.done ] && [ -e $R/lane-l.done ] && break
    sleep 10
  done
  cat $R/steps.txt; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  tail -n 3 $R/repro/logs/*.log 2>/dev/null | cut -c1-200
  pack
  ;;
esac
