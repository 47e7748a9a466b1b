#!/bin/bash
# The third 2026-12-01 H200 session: one background driver, started in the first call, runs
# three lanes while later calls ship the model pieces (each lane waits for its models):
#   D  divergence: the OOM and CUDA NaN checks, then the fp32 arms (smollm2, qwen05, gemma3),
#      the 1.5B in bf16 (100 problems) and in fp32 (32 problems); one study at a time.
#   S  SpectrumKV grids per model (resuming the previous session's journals), then the 1.5B,
#      then the two-process TTFT (tiered, FP16, PDTrim; unlimited link and 1 Gbit/s).
#   H  the Hugging Face cache-ON/OFF reference (greedy, 16 problems) on the same prompts.
# Modes:
#   bash docs/gpu-run5.sh setup     # first call: binaries, a private copy of the repo, start the driver
#   bash docs/gpu-run5.sh join      # piece calls: join finished models
#   bash docs/gpu-run5.sh poll SECS [final]  # wait while printing progress, then pack results into $OUT
#   bash docs/gpu-run5.sh drive     # (the driver itself)
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
declare -A PIECES=([smollm2-135m-instruct]=3 [gemma-3-270m]=7 [qwen2.5-coder-0.5b-instruct]=13 [qwen2.5-coder-1.5b-instruct]=29)
OLD=docs/runs/h200-2026-12-01b

join_models() {
  mkdir -p /tmp/m
  for m in "${!PIECES[@]}"; do
    f=$KVCREDIT_HOME/models/$m/$m.gguf
    [ -e $f ] && continue
    n=$(ls /tmp/m/$m.gguf.part* 2>/dev/null | wc -l)
    if [ "$n" = "${PIECES[$m]}" ]; then
      mkdir -p $(dirname $f) && cat /tmp/m/$m.gguf.part* > $f.tmp && mv $f.tmp $f && rm -f /tmp/m/$m.gguf.part*
      echo "joined $m ($(stat -c %s $f) bytes)"
    fi
  done
}

wait_model() { until [ -e $KVCREDIT_HOME/models/$1/$1.gguf ]; do sleep 2; done; }
# A step that ended (any exit but a timeout or a kill) is not run again when the driver restarts.
step() {
  local t=$1 name=$2; shift 2; local s=$(date +%s)
  [ -e $R/$name.ended ] && return 0
  echo "$name: start $(date -u +%T)" >> $R/steps.txt
  timeout $t "$@" > $R/$name.log 2>&1
  local rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - s )) s" >> $R/steps.txt
  [ $rc != 124 ] && [ $rc != 137 ] && [ $rc != 143 ] && touch $R/$name.ended
  return 0
}

# Start the driver unless it runs (a call's end may have taken it down; every lane resumes).
ensure_driver() {
  if ! pgrep -f "gpu-run5.sh drive" > /dev/null; then
    echo "starting the driver $(date -u +%T)" >> $R/steps.txt
    (cd $P && setsid nohup bash docs/gpu-run5.sh drive >> $R/driver.log 2>&1 < /dev/null &)
  fi
}

lane_d() {
  wait_model smollm2-135m-instruct
  step 120 oom $B campaign run experiments/gpu-oom.toml --device cuda --allow-extrapolation --out $R/oom --quiet
  { echo "files after the OOM:"; ls -la $R/oom; cat $R/oom/manifest.json; } >> $R/oom.log 2>&1
  step 120 nan-cuda /tmp/hardening non_finite --nocapture
  fp32() {  # study $1 in fp32 only, into its own run dir (the report joins run dirs by model)
    local s=$1 count=${2:-}
    sed 's/^dtypes = .*/dtypes = ["fp32"]/; s/^name = "\(.*\)"/name = "\1-fp32"/' experiments/divergence-gpu-$s.toml > $R/specs/divergence-gpu-$s-fp32.toml
    [ -n "$count" ] && sed -i "s/^count = .*/count = $count/" $R/specs/divergence-gpu-$s-fp32.toml
    step 1500 div-$s-fp32 $B divergence run $R/specs/divergence-gpu-$s-fp32.toml --out $R/div-$s-fp32
  }
  fp32 smollm2
  wait_model qwen2.5-coder-0.5b-instruct
  fp32 qwen05
  wait_model qwen2.5-coder-1.5b-instruct
  sed 's/^dtypes = .*/dtypes = ["bf16"]/; s/^name = "\(.*\)"/name = "\1-bf16"/' experiments/divergence-gpu-qwen15.toml > $R/specs/divergence-gpu-qwen15-bf16.toml
  step 1500 div-qwen15-bf16 $B divergence run $R/specs/divergence-gpu-qwen15-bf16.toml --out $R/div-qwen15-bf16
  touch $R/qwen15-pairs.ready
  wait_model gemma-3-270m
  fp32 gemma3
  fp32 qwen15 32
  touch $R/lane-d.done
}

lane_s() {
  for m in smollm2-135m-instruct qwen2.5-coder-0.5b-instruct gemma-3-270m qwen2.5-coder-1.5b-instruct; do
    wait_model $m
    O=$R/spectrum-$m
    mkdir -p $O
    # The previous session's finished units (journals, probe) resume here.
    [ -d $OLD/spectrum-$m ] && cp -n $OLD/spectrum-$m/* $O/
    sed "s/^model = .*/model = \"$m\"/; s/^name = .*/name = \"spectrum-gpu-$m\"/" experiments/spectrum-gpu.toml > $O/spec.toml
    [ -e $O/probe.parquet ] || step 300 probe-$m $B spectrum probe $O/spec.toml --out $O
    step 1500 ppl-$m $B spectrum ppl $O/spec.toml --out $O
    step 1500 niah-$m $B spectrum niah $O/spec.toml --out $O
  done
  # TTFT (0.5B) once the divergence lane is done, so the stages are timed with the GPU to itself.
  for i in $(seq 600); do [ -e $R/lane-d.done ] && break; sleep 1; done
  m=qwen2.5-coder-0.5b-instruct; O=$R/spectrum-$m
  $B spectrum serve --model $m --dtype bf16 --device cuda --bind 127.0.0.1:7070 > $R/serve.log 2>&1 &
  local sp=$!
  for i in $(seq 90); do (: > /dev/tcp/127.0.0.1/7070) 2>/dev/null && break; sleep 1; done
  step 90 ttft $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --out $O/ttft.parquet
  step 90 ttft-1gbit $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --bandwidth-mbps 1000 --out $O/ttft-1gbit.parquet
  step 90 ttft-pdtrim $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --tier-policy pdtrim --out $O/ttft-pdtrim.parquet
  kill $sp
  touch $R/lane-s.done
}

lane_h() {
  export PYTHONPATH=/tmp/site
  hf() {  # model, short name, pairs.parquet, dtypes
    wait_model $1
    step 900 hf-div-$2 python3 benches/hf_divergence.py --gguf $KVCREDIT_HOME/models/$1/$1.gguf \
      --pairs $3 --dtypes $4 --strategies greedy --problems 16 --out $R/hf/hf-div-$2.json
  }
  mkdir -p $R/hf
  hf qwen2.5-coder-0.5b-instruct qwen05 $OLD/div-qwen05/pairs.parquet bf16,fp16,fp32
  hf smollm2-135m-instruct smollm2 $OLD/div-smollm2/pairs.parquet bf16,fp16,fp32
  hf gemma-3-270m gemma3 $OLD/div-gemma3/pairs.parquet bf16,fp32
  until [ -e $R/qwen15-pairs.ready ]; do sleep 2; done
  [ -e $R/div-qwen15-bf16/pairs.parquet ] && hf qwen2.5-coder-1.5b-instruct qwen15 $R/div-qwen15-bf16/pairs.parquet bf16,fp32
  touch $R/lane-h.done
}

pack() {
  # Divergence runs cut short: merge their finished shards into tables first.
  # (idempotent: a finished run's merge writes the tables it wrote itself).
  for d in $R/div-*/; do
    [ -d $d/shards ] && $B divergence merge $d > ${d%/}.merge.log 2>&1
  done
  rm -rf /tmp/pack && mkdir -p /tmp/pack
  tar czf /tmp/pack/results.tgz -C /tmp --exclude=shards --exclude=drift.parquet R
  split -b 15M -d -a 1 /tmp/pack/results.tgz $OUT/results.tgz.part
  # At most 8 files come back: drift tables (per-layer, large) only in the final pack, if they fit.
  if [ "${1:-}" = final ]; then
    (cd /tmp && tar czf /tmp/pack/drift.tgz $(ls R/div-*/drift.parquet 2>/dev/null) --files-from /dev/null)
    n=$(ls $OUT | wc -l)
    [ $(stat -c %s /tmp/pack/drift.tgz) -le $(( (8 - n) * 15 * 1048576 )) ] && split -b 15M -d -a 1 /tmp/pack/drift.tgz $OUT/drift.tgz.part
  fi
  ls -la $OUT
}

case "$1" in
setup)
  mkdir -p /tmp/bin /tmp/m $R/specs $KVCREDIT_HOME/models
  cp gpu/bin/* /tmp/bin/ && cp gpu/ship/* /tmp/m/ 2>/dev/null
  gunzip -c /tmp/bin/kvcredit.gz > $B && chmod +x $B
  gunzip -c /tmp/bin/hardening.gz > /tmp/hardening && chmod +x /tmp/hardening
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/bin/*.whl
  # A private copy of the tree: later calls re-copy the working tree under the driver's feet.
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu . | tar xf - -C $P
  mkdir -p /work && ln -sfn $P /work/main   # the test binary's CARGO_MANIFEST_DIR
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  sleep 2; cat $R/env.txt; pgrep -f "gpu-run5.sh drive"
  ;;
join)
  cp gpu/ship/* /tmp/m/ 2>/dev/null
  join_models
  echo "driver: $(pgrep -f 'gpu-run5.sh drive' | wc -l) processes"; ensure_driver; tail -n 3 $R/steps.txt 2>/dev/null
  ;;
drive)
  lane_d > $R/lane-d.log 2>&1 &
  lane_s > $R/lane-s.log 2>&1 &
  lane_h > $R/lane-h.log 2>&1 &
  wait
  ;;
par)
  # NIAH/PPL units are latency-bound (~15 s a haystack beside the divergence lane): the other
  # models' grids run side by side, each in its own process; lane S keeps SmolLM2 and the TTFT.
  cp docs/gpu-run5.sh $P/docs/
  for m in qwen2.5-coder-0.5b-instruct gemma-3-270m qwen2.5-coder-1.5b-instruct; do
    for s in probe ppl niah; do touch $R/$s-$m.ended; done
    (cd $P && setsid nohup bash docs/gpu-run5.sh spec1 $m >> $R/lane-par-$m.log 2>&1 < /dev/null &)
  done
  sleep 3; pgrep -af "gpu-run5.sh spec1"
  ;;
spec1)
  m=$2; O=$R/spectrum-$m; mkdir -p $O
  [ -d $OLD/spectrum-$m ] && cp -n $OLD/spectrum-$m/* $O/
  sed "s/^model = .*/model = \"$m\"/; s/^name = .*/name = \"spectrum-gpu-$m\"/" experiments/spectrum-gpu.toml > $O/spec.par.toml
  [ -e $O/probe.parquet ] || step 300 probe-par-$m $B spectrum probe $O/spec.par.toml --out $O
  step 1500 ppl-par-$m $B spectrum ppl $O/spec.par.toml --out $O
  step 1500 niah-par-$m $B spectrum niah $O/spec.par.toml --out $O
  touch $R/par-$m.done
  ;;
poll)
  ensure_driver
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ]; do
    [ -e $R/lane-d.done ] && [ -e $R/lane-s.done ] && [ -e $R/lane-h.done ] && break
    sleep 10
  done
  cat $R/steps.txt; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  for f in $R/ppl-*.log $R/niah-*.log $R/div-*.log; do echo "== $f"; tail -n 2 $f; done 2>/dev/null | cut -c1-200
  pack ${3:-}
  ;;
esac
