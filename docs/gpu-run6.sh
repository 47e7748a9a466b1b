#!/bin/bash
# The fourth 2026-12-01 H200 session, first lease: what the divergence study still lacked.
# One background driver, started in the first call, runs while later calls ship model pieces:
#   D  the 1.5B's fp16 and fp32 arms on all 100 problems (experiments/divergence-gpu-qwen15.toml,
#      one dtype per run dir, as two processes side by side);
#   H  the Hugging Face cache-ON/OFF reference (benches/hf_divergence.py, greedy, the first 16
#      problems, the same prompt ids): one process per model × dtype (the 1.5B's split in two
#      halves of 8 problems), for Gemma-3 and the 1.5B in fp16/bf16/fp32 and SmolLM2 in fp16/fp32
#      (the gaps the previous sessions left); the halves are joined with --merge when packing.
# Modes:
#   bash docs/gpu-run6.sh setup     # first call: binary, a private copy of the repo, start the driver
#   bash docs/gpu-run6.sh join      # piece calls: join finished models
#   bash docs/gpu-run6.sh poll SECS [final]  # wait while printing progress, then pack results into $OUT
#   bash docs/gpu-run6.sh drive     # (the driver itself)
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
declare -A PIECES=([smollm2-135m-instruct]=2 [gemma-3-270m]=5 [qwen2.5-coder-1.5b-instruct]=22)

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

ensure_driver() {
  if ! pgrep -f "gpu-run6.sh drive" > /dev/null; then
    echo "starting the driver $(date -u +%T)" >> $R/steps.txt
    (cd $P && setsid nohup bash docs/gpu-run6.sh drive >> $R/driver.log 2>&1 < /dev/null &)
  fi
}

div1() {  # the 1.5B study in one dtype, into its own run dir
  local d=$1
  sed "s/^dtypes = .*/dtypes = [\"$d\"]/; s/^name = \"\(.*\)\"/name = \"\1-$d\"/" experiments/divergence-gpu-qwen15.toml > $R/specs/divergence-gpu-qwen15-$d.toml
  step 1500 div-qwen15-$d $B divergence run $R/specs/divergence-gpu-qwen15-$d.toml --out $R/div-qwen15-$d
}

lane_d() {
  wait_model qwen2.5-coder-1.5b-instruct
  div1 fp16 &
  div1 fp32 &
  wait
  touch $R/lane-d.done
}

hf1() {  # model, short name, pairs.parquet, dtype, skip, count
  wait_model $1
  step 1500 hf-$2-$4-$5 python3 benches/hf_divergence.py --gguf $KVCREDIT_HOME/models/$1/$1.gguf \
    --pairs $3 --dtypes $4 --strategies greedy --skip $5 --problems $6 --out $R/hf/part-$2-$4-$5.json
}

lane_h() {
  export PYTHONPATH=/tmp/site
  mkdir -p $R/hf
  local q=docs/runs/h200-2026-12-01c/div-qwen15-bf16/pairs.parquet
  local g=docs/runs/h200-2026-12-01b/div-gemma3/pairs.parquet
  local s=docs/runs/h200-2026-12-01b/div-smollm2/pairs.parquet
  for d in bf16 fp16 fp32; do
    hf1 qwen2.5-coder-1.5b-instruct qwen15 $q $d 0 8 &
    hf1 qwen2.5-coder-1.5b-instruct qwen15 $q $d 8 8 &
    hf1 gemma-3-270m gemma3 $g $d 0 16 &
  done
  for d in fp16 fp32; do hf1 smollm2-135m-instruct smollm2 $s $d 0 16 & done
  wait
  touch $R/lane-h.done
}

pack() {
  for d in $R/div-*/; do
    [ -d $d/shards ] && $B divergence merge $d > ${d%/}.merge.log 2>&1
  done
  # One reference file per model from its parts (halves and dtypes).
  for s in qwen15 gemma3 smollm2; do
    ls $R/hf/part-$s-*.json > /dev/null 2>&1 || continue
    PYTHONPATH=/tmp/site python3 $P/benches/hf_divergence.py --merge $R/hf/part-$s-*.json --out $R/hf/hf-div-$s.json > $R/hf/merge-$s.log 2>&1
  done
  rm -rf /tmp/pack && mkdir -p /tmp/pack
  tar czf /tmp/pack/results.tgz -C /tmp --exclude=shards --exclude=drift.parquet R
  split -b 15M -d -a 1 /tmp/pack/results.tgz $OUT/results.tgz.part
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
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/bin/*.whl
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu . | tar xf - -C $P
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version;
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  sleep 2; cat $R/env.txt; pgrep -f "gpu-run6.sh drive"
  ;;
join)
  cp gpu/ship/* /tmp/m/ 2>/dev/null
  join_models
  echo "driver: $(pgrep -f 'gpu-run6.sh drive' | wc -l) processes"; ensure_driver; tail -n 3 $R/steps.txt 2>/dev/null
  ;;
drive)
  lane_d > $R/lane-d.log 2>&1 &
  lane_h > $R/lane-h.log 2>&1 &
  wait
  ;;
rehf)
  # The first Gemma-3/SmolLM2 references ran out of GPU memory beside the fp32 study (it held
  # ~92 GiB); the 1.5B's fp16 reference gave NaN logits that looked like agreement. Rerun those
  # with the script that records non-finite logits, now that memory is free.
  cp benches/hf_divergence.py $P/benches/ && cp docs/gpu-run6.sh $P/docs/
  for n in gemma3-bf16-0 gemma3-fp16-0 smollm2-fp16-0 smollm2-fp32-0 qwen15-fp16-0 qwen15-fp16-8; do
    rm -f $R/hf-$n.ended $R/hf/part-$n.json; mv $R/hf-$n.log $R/hf-$n.first.log 2>/dev/null
  done
  (cd $P && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid nohup bash docs/gpu-run6.sh lane_h >> $R/lane-h2.log 2>&1 < /dev/null &)
  sleep 2; pgrep -af hf_divergence | wc -l
  ;;
lane_h)
  rm -f $R/lane-h.done; lane_h
  ;;
poll)
  ensure_driver
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ]; do
    [ -e $R/lane-d.done ] && [ -e $R/lane-h.done ] && break
    sleep 10
  done
  cat $R/steps.txt; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  for f in $R/div-*.log $R/hf-*.log; do echo "== $f"; tail -n 2 $f; done 2>/dev/null | cut -c1-200
  pack ${3:-}
  ;;
esac
