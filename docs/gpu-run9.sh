#!/bin/bash
# Plan for the next H200 session (not yet run): finish the seed-table reproduction (#16) from
# the run dirs of docs/runs/h200-2026-12-01e (they travel with the tree in the `setup` call and
# resume there), and time the pooled engine alone on the GPU (#15). Pattern of docs/gpu-run8.sh.
# The tree is ~39 MB with that folder: for the `join` calls move tests/fixtures AND
# docs/runs/h200-2026-12-01e aside (the machine keeps /tmp/repo from `setup`), so tree + a
# 50 MiB piece stay under 64 MiB.
#   B  as soon as the 0.5B has arrived, alone on the GPU: `bench campaign` of
#      experiments/bench-campaign-qwen05.toml with --pool-problems 1, then with 8 (the spec's).
#   R  after B: experiments/repro-run.sh over all eight specs into $R/repro (REPRO_PARALLEL=8;
#      the two finished 0.5B configs only record a resume; the twins and the 1.5B bf16 ones
#      continue from their shards once the 1.5B has arrived; the fp16 ones exit 2 again and
#      now record `failure` in their manifests), which also writes $R/repro/report.
# Modes: setup | join | poll SECS | drive (the driver itself).
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
PREV=docs/runs/h200-2026-12-01e
declare -A PIECES=([qwen2.5-coder-0.5b-instruct]=10 [qwen2.5-coder-1.5b-instruct]=22)

SCRIPT=gpu-run9.sh
# shellcheck source=docs/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh"

lane_b() {
  wait_model qwen2.5-coder-0.5b-instruct
  step 900 bench-pool1 $B bench campaign experiments/bench-campaign-qwen05.toml --out $R/bench/pool1 --pool-problems 1 --quiet
  step 900 bench-pool8 $B bench campaign experiments/bench-campaign-qwen05.toml --out $R/bench/pool8 --quiet
  touch $R/bench.done
}

lane_r() {
  until [ -e $R/bench.done ]; do sleep 2; done
  wait_model qwen2.5-coder-1.5b-instruct
  REPRO_PARALLEL=8 step 3600 repro bash experiments/repro-run.sh $B $R/repro
  touch $R/lane-r.done
}

case "$1" in
setup)
  mkdir -p /tmp/bin /tmp/m $R/repro $KVCREDIT_HOME/models
  cp gpu/bin/* /tmp/bin/ && cp gpu/ship/* /tmp/m/ 2>/dev/null
  gunzip -c /tmp/bin/kvcredit.gz > $B && chmod +x $B
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu . | tar xf - -C $P
  cp -a $PREV/repro/repro-* $PREV/repro15/repro-* $R/repro/
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  sleep 2; cat $R/env.txt; ls $R/repro
  ;;
join)
  cp gpu/ship/* /tmp/m/ 2>/dev/null
  join_models
  ensure_driver; tail -n 3 $R/steps.txt 2>/dev/null
  ;;
drive)
  lane_b > $R/lane-b.log 2>&1 &
  lane_r > $R/lane-r.log 2>&1 &
  wait
  ;;
poll)
  ensure_driver
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ]; do
    [ -e $R/lane-r.done ] && break
    sleep 10
  done
  cat $R/steps.txt; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  for d in $R/repro/repro-*; do echo "$(basename $d): $(ls $d/shards 2>/dev/null | wc -l) shard dirs"; done
  pack
  ;;
esac
