#!/bin/bash
# The H200 session of 2026-12-01 (evening): the seed-table reproduction (#16) with pooled
# problems (#15), and the one-GPU two-shard byte-identity check (#17). Same pattern as
# docs/gpu-run6.sh (it replaces the unrun plan gpu-run7.sh): the first call starts a background driver, later
# calls ship GGUF pieces of 50 MiB (tests/fixtures moved aside so tree + piece stay under
# 64 MiB), `poll` packs results into $OUT.
#   S  pooled smoke on CUDA: a tiny batch_invariant campaign with pool_problems 1 and 4, whose
#      Parquet must be byte-identical; if the pooled one fails, the repro specs fall back to
#      pool_problems = 1 (recorded in steps.txt).
#   R  experiments/repro-run.sh over the four 0.5B specs (REPRO_PARALLEL=4) after S, and over
#      the four 1.5B specs (bf16 first) as soon as the 1.5B has arrived, side by side.
#      Unfinished run dirs resume on the next machine: copy them back into $R/repro first.
#   L  slurm/local-gpus.sh with GPUS=0 and 2 shards of experiments/gpu-bf16-bi.toml on the one
#      GPU, COMPARE against an unsharded run of the same spec (byte-identity under
#      batch_invariant), after S.
# Modes: setup | join | poll SECS [final] | drive (the driver itself).
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
declare -A PIECES=([qwen2.5-coder-0.5b-instruct]=10 [qwen2.5-coder-1.5b-instruct]=22)

SCRIPT=gpu-run8.sh
# shellcheck source=docs/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh"

# A tiny batch_invariant campaign of the 0.5B with pool_problems = $1.
smoke_spec() {
  sed -e "s/^name = .*/name = \"smoke-pool$1\"/" -e 's/^count = .*/count = 4/' \
    -e 's/^max_new_tokens = 320/max_new_tokens = 96/' -e 's/^max_new_tokens = 256/max_new_tokens = 48/' \
    -e 's/^max_per_rollout = .*/max_per_rollout = 2/' -e 's/^k = .*/k = 2/' \
    -e 's/^batch_size = .*/batch_size = 8/' -e 's/^replica_batch_size = .*/replica_batch_size = 3/' \
    -e "s/^pool_problems = .*/pool_problems = $1/" experiments/repro-qwen05-zs-bf16-bi.toml > $R/specs/smoke-pool$1.toml
}

lane_s() {
  wait_model qwen2.5-coder-0.5b-instruct
  mkdir -p $R/specs
  smoke_spec 1; smoke_spec 4
  step 600 smoke-pool1 $B campaign run $R/specs/smoke-pool1.toml --out $R/smoke/pool1 --quiet &
  step 600 smoke-pool4 $B campaign run $R/specs/smoke-pool4.toml --out $R/smoke/pool4 --quiet
  wait
  if grep -q "smoke-pool4: exit 0" $R/steps.txt; then
    (cd $R/smoke && for f in pool1/*.parquet; do cmp -s $f pool4/${f#pool1/} && echo "same ${f#pool1/}" || echo "DIFFERENT ${f#pool1/}"; done) > $R/smoke/compare.txt 2>&1
    echo "smoke: $(grep -c '^same' $R/smoke/compare.txt) same, $(grep -c DIFFERENT $R/smoke/compare.txt) different" >> $R/steps.txt
  else
    sed -i 's/^pool_problems = 8/pool_problems = 1/' experiments/repro-*.toml
    echo "smoke: pooled run failed; repro specs fall back to pool_problems = 1" >> $R/steps.txt
  fi
  touch $R/smoke.done
}

lane_r_small() {
  until [ -e $R/smoke.done ]; do sleep 2; done
  local small="experiments/repro-qwen05-zs-bf16.toml experiments/repro-qwen05-cot-bf16.toml experiments/repro-qwen05-zs-bf16-bi.toml experiments/repro-qwen05-cot-bf16-bi.toml"
  REPRO_SPECS="$small" REPRO_PARALLEL=4 step 3600 repro-05b bash experiments/repro-run.sh $B $R/repro
  touch $R/lane-rs.done
}

lane_r_large() {
  until [ -e $R/smoke.done ]; do sleep 2; done
  wait_model qwen2.5-coder-1.5b-instruct
  local large="experiments/repro-qwen15-zs-bf16.toml experiments/repro-qwen15-cot-bf16.toml experiments/repro-qwen15-zs-fp16.toml experiments/repro-qwen15-cot-fp16.toml"
  REPRO_SPECS="$large" REPRO_PARALLEL=4 step 3600 repro-15b bash experiments/repro-run.sh $B $R/repro15
  touch $R/lane-rl.done
}

lane_l() {
  until [ -e $R/smoke.done ]; do sleep 2; done
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

progress() {
  for d in $R/repro/repro-* $R/repro15/repro-*; do
    [ -d $d ] && echo "$(basename $d): $(ls $d/shards 2>/dev/null | wc -l) shard files"
  done
}

case "$1" in
setup)
  mkdir -p /tmp/bin /tmp/m $R $KVCREDIT_HOME/models
  cp gpu/bin/* /tmp/bin/ && cp gpu/ship/* /tmp/m/ 2>/dev/null
  gunzip -c /tmp/bin/kvcredit.gz > $B && chmod +x $B
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu . | tar xf - -C $P
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; nproc; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  sleep 2; cat $R/env.txt; pgrep -f "gpu-run8.sh drive"
  ;;
join)
  cp gpu/ship/* /tmp/m/ 2>/dev/null
  join_models
  ensure_driver; tail -n 3 $R/steps.txt 2>/dev/null
  ;;
drive)
  lane_s > $R/lane-s.log 2>&1 &
  lane_r_small > $R/lane-rs.log 2>&1 &
  lane_r_large > $R/lane-rl.log 2>&1 &
  lane_l > $R/lane-l.log 2>&1 &
  wait
  ;;
poll)
  ensure_driver
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ]; do
    [ -e $R/lane-rs.done ] && [ -e $R/lane-rl.done ] && [ -e $R/lane-l.done ] && break
    sleep 10
  done
  cat $R/steps.txt; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  progress; tail -n 2 $R/repro*/logs/*.log 2>/dev/null | cut -c1-200
  pack
  ;;
esac
