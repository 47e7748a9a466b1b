#!/usr/bin/env bash
# The replica-floor study on a GPU machine that has torch but no Rust and no network: the noise
# table (which schedule dimensions change a row's bits, per shape and dtype) and the seed-table
# reproduction under the state x schedule design, with the 1.5B zero-shot configuration also run
# under the eager engine.
#
# Build here, carry the binary and the models in pieces (an ignored folder gpu/ named in the
# device call's carry list), one call per step:
#   bash experiments/gpu-floor.sh setup        # gpu/bin/kvcredit.gz -> /tmp/kvcredit, start the driver
#   bash experiments/gpu-floor.sh piece        # take the model pieces in gpu/ship/, join complete models
#   bash experiments/gpu-floor.sh poll SECS    # wait up to SECS for the driver, pack results to $OUT
# Pieces are named MODEL.gguf.partNN (split -d -a 2) with MODEL.gguf.count holding their number.
# The driver (`drive`) runs in the background: the noise probes on the synthetic 0.5B and 1.5B
# shapes in bf16 and fp16 (no model needed), then, once the 1.5B model has arrived, the floor
# study's campaigns at once (each is latency-bound): experiments/floor-qwen15-{zs,cot}-bf16.toml
# with the default engine and the zero-shot one's first half of its problem groups (--shard 0/2) with --engine eager,
# then `kvcredit check` on each. Results: /tmp/R (packed to $OUT).
set -u
TORCH_LIB=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
export LD_LIBRARY_PATH=$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=${KVCREDIT_HOME:-/tmp/kvhome} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
M=/tmp/m
mkdir -p $R $M $KVCREDIT_HOME/models

join_models() {
  for c in $M/*.gguf.count; do
    [ -e "$c" ] || continue
    local name=$(basename $c .gguf.count)
    local f=$KVCREDIT_HOME/models/$name/$name.gguf
    [ -e $f ] && continue
    if [ "$(ls $M/$name.gguf.part* 2>/dev/null | wc -l)" = "$(cat $c)" ]; then
      mkdir -p $(dirname $f) && cat $M/$name.gguf.part* > $f.tmp && mv $f.tmp $f && rm -f $M/$name.gguf.part*
      echo "joined $name ($(stat -c %s $f) bytes)" | tee -a $R/steps.txt
    fi
  done
}

ensure_driver() {
  pgrep -f "gpu-floor.sh drive" > /dev/null && return
  echo "driver started $(date -u +%T)" >> $R/steps.txt
  (cd $P && setsid nohup bash experiments/gpu-floor.sh drive >> $R/driver.log 2>&1 < /dev/null &)
}

wait_model() { until [ -e $KVCREDIT_HOME/models/$1/$1.gguf ]; do sleep 2; done; }

campaign() { # name spec [extra args]: run one campaign into $R/repro/name, then check it
  local name=$1 spec=$2; shift 2
  local s=$(date +%s)
  $B campaign run $spec --out $R/repro/$name --quiet "$@" > $R/logs/$name.log 2>&1
  echo "$name: campaign exit $? in $(( $(date +%s) - s )) s" >> $R/steps.txt
  $B check $R/repro/$name > $R/logs/$name.check.txt 2>&1
  echo "$name: check exit $?" >> $R/steps.txt
}

case "${1:-}" in
setup)
  gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu --exclude=./.venv . | tar xf - -C $P
  cp gpu/ship/* $M/ 2>/dev/null
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  cat $R/env.txt
  ;;
piece)
  cp gpu/ship/* $M/ 2>/dev/null
  join_models
  ensure_driver
  tail -n 2 $R/steps.txt
  ;;
poll)
  ensure_driver
  end=$(( $(date +%s) + ${2:-60} ))
  while [ $(date +%s) -lt $end ] && [ ! -e $R/DONE ]; do sleep 5; done
  cat $R/steps.txt
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  for d in $R/repro/*; do [ -d $d ] && echo "$(basename $d): $(ls $d/shards 2>/dev/null | wc -l) shards"; done
  rm -rf /tmp/pack && mkdir -p /tmp/pack
  tar czf /tmp/pack/results.tgz --exclude='shards' -C /tmp R
  split -b 15M -d -a 1 /tmp/pack/results.tgz $OUT/results.tgz.part
  ls -la $OUT
  ;;
drive)
  mkdir -p $R/noise $R/logs $R/repro
  if [ ! -e $R/noise.ended ]; then
    for shape in qwen2.5-1.5b qwen2.5-0.5b; do
      for dtype in bf16 fp16; do
        timeout 300 $B bench noise --synthetic $shape --dtype $dtype --device cuda \
          --pads 1,3,4,7,8,16,64,256 --out $R/noise > $R/logs/noise-$shape-$dtype.log 2>&1
        echo "noise $shape $dtype: exit $?" >> $R/steps.txt
      done
    done
    touch $R/noise.ended
  fi
  wait_model qwen2.5-coder-1.5b-instruct
  campaign floor-qwen15-zs-bf16-eager experiments/floor-qwen15-zs-bf16.toml --engine eager --shard 0/2 &
  campaign floor-qwen15-zs-bf16 experiments/floor-qwen15-zs-bf16.toml &
  campaign floor-qwen15-cot-bf16 experiments/floor-qwen15-cot-bf16.toml &
  wait
  touch $R/DONE
  ;;
*)
  echo "usage: $0 setup | piece | poll SECS | drive" >&2
  exit 2
  ;;
esac
