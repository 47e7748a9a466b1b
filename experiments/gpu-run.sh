#!/usr/bin/env bash
# Run a job file on a GPU machine that has torch but no Rust and no network. Build here, put the
# binary and the models in an ignored folder gpu/ that travels with the working tree, and call
# this once per step (each call must return within the machine's per-call limit; a driver keeps
# the jobs running between calls):
#   bash experiments/gpu-run.sh JOBS setup       # gpu/bin/kvcredit.gz -> /tmp/kvcredit, start the driver
#   bash experiments/gpu-run.sh JOBS piece       # take the model pieces in gpu/ship/, join complete models
#   bash experiments/gpu-run.sh JOBS poll SECS   # wait up to SECS for the driver, pack results to $OUT
# JOBS is a bash file (experiments/gpu-jobs/*.sh) defining `run_jobs`, run once by the driver in the
# background with the helpers below; results go to /tmp/R and come back as $OUT/results.tgz.part*
# (run folders without their shards). Pieces are MODEL.gguf.partNN (split -d -a 2) beside
# MODEL.gguf.count holding their number; a model is joined into $KVCREDIT_HOME/models/ once all
# its pieces are there.
#
# Helpers for job files:
#   wait_model NAME                  block until the model has been joined
#   campaign NAME SPEC [ARGS...]     kvcredit campaign run SPEC --out $R/runs/NAME, then kvcredit check
#   step NAME CMD...                 run CMD with its output in $R/logs/NAME.log, exit code in steps.txt
set -u
JOBS=${1:?usage: $0 JOBS setup|piece|poll SECS|drive}
ACTION=${2:-}
TORCH_LIB=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
export LD_LIBRARY_PATH=$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=${KVCREDIT_HOME:-/tmp/kvhome} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
B=/tmp/kvcredit
R=/tmp/R
P=/tmp/repo
M=/tmp/m
mkdir -p $R/logs $R/runs $M $KVCREDIT_HOME/models

join_models() {
  for c in $M/*.gguf.count; do
    [ -e "$c" ] || continue
    local name=$(basename $c .gguf.count)
    local f=$KVCREDIT_HOME/models/$name/$name.gguf
    [ -e $f ] && continue
    if [ "$(ls $M/$name.gguf.part* 2>/dev/null | wc -l)" = "$(cat $c)" ]; then
      mkdir -p $(dirname $f) && cat $M/$name.gguf.part* > $f.tmp && mv $f.tmp $f && rm -f $M/$name.gguf.part*
      echo "joined $name ($(stat -c %s $f) bytes) $(date -u +%T)" | tee -a $R/steps.txt
    fi
  done
}

ensure_driver() {
  pgrep -f "gpu-run.sh .* drive" > /dev/null && return
  [ -e $R/DONE ] && return
  echo "driver started $(date -u +%T)" >> $R/steps.txt
  (cd $P && setsid nohup bash experiments/gpu-run.sh $JOBS drive >> $R/driver.log 2>&1 < /dev/null &)
}

wait_model() { until [ -e $KVCREDIT_HOME/models/$1/$1.gguf ]; do sleep 2; done; }

step() { # name cmd...: run cmd, log its output, record its exit code and seconds
  local name=$1 s=$(date +%s)
  shift
  "$@" > $R/logs/$name.log 2>&1
  echo "$name: exit $? in $(( $(date +%s) - s )) s" >> $R/steps.txt
}

campaign() { # name spec [extra args]: run one campaign into $R/runs/name, then check it
  local name=$1 spec=$2
  shift 2
  step $name $B campaign run $spec --out $R/runs/$name --quiet "$@"
  step $name.check $B check $R/runs/$name
}

case "$ACTION" in
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
  end=$(( $(date +%s) + ${3:-60} ))
  while [ $(date +%s) -lt $end ] && [ ! -e $R/DONE ]; do sleep 5; done
  cat $R/steps.txt
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  for d in $R/runs/*; do [ -d $d ] && echo "$(basename $d): $(ls $d/shards 2>/dev/null | wc -l) shards"; done
  rm -rf /tmp/pack && mkdir -p /tmp/pack
  tar czf /tmp/pack/results.tgz --exclude='shards' -C /tmp R
  split -b 15M -d -a 1 /tmp/pack/results.tgz $OUT/results.tgz.part
  ls -la $OUT
  ;;
drive)
  # shellcheck source=/dev/null
  source $JOBS
  run_jobs
  touch $R/DONE
  ;;
*)
  echo "usage: $0 JOBS setup | piece | poll SECS | drive" >&2
  exit 2
  ;;
esac
