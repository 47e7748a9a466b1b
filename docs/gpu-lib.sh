#!/bin/bash
# Shared by the H200 session scripts from docs/gpu-run8.sh on (sourced; the earlier gpu-run*.sh
# are kept as the records of what ran). Expects PIECES (model -> piece count) and SCRIPT (the
# session script's file name); KVCREDIT_HOME, B (the binary), R (results) and P (the private
# copy of the repo) default below.

# The machine's torch, the session's folders and the binary's path (from docs/gpu-run10.sh on
# the session scripts leave these to the library; earlier ones set them before sourcing it).
TORCH_LIB=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
# Prepended: the machine may set LD_LIBRARY_PATH itself (the driver's libraries), without torch's.
export LD_LIBRARY_PATH=$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=${KVCREDIT_HOME:-/tmp/kvhome} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
B=${B:-/tmp/kvcredit}
R=${R:-/tmp/R}
P=${P:-/tmp/repo}

# Join a model's pieces once all of them have arrived.
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

# Block until a model has been joined.
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

# Start the session's background driver unless it runs (a call's end may have taken it down).
ensure_driver() {
  if ! pgrep -f "$SCRIPT drive" > /dev/null; then
    echo "starting the driver $(date -u +%T)" >> $R/steps.txt
    (cd $P && setsid nohup bash docs/$SCRIPT drive >> $R/driver.log 2>&1 < /dev/null &)
  fi
}

# Pack $R into $OUT as 15 MiB pieces of one tarball (a call brings back at most 8 files).
pack() {
  rm -rf /tmp/pack && mkdir -p /tmp/pack
  tar czf /tmp/pack/results.tgz -C /tmp R
  split -b 15M -d -a 1 /tmp/pack/results.tgz $OUT/results.tgz.part
  ls -la $OUT
}

# The `setup` call (from docs/gpu-run10.sh on): unpack the binary to $B, copy the tree to $P
# (without gpu/), copy the run dirs given as arguments into $R/repro, record the machine, join
# what arrived and start the driver.
setup_session() {
  mkdir -p /tmp/bin /tmp/m $R/repro $KVCREDIT_HOME/models
  cp gpu/bin/* /tmp/bin/ && cp gpu/ship/* /tmp/m/ 2>/dev/null
  gunzip -c /tmp/bin/kvcredit.gz > $B && chmod +x $B
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu . | tar xf - -C $P
  [ $# -gt 0 ] && cp -a "$@" $R/repro/
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; } > $R/env.txt 2>&1
  join_models
  ensure_driver
  sleep 2; cat $R/env.txt; ls $R/repro
}

# A `poll` call: wait SECS seconds or until the file $R/DONE exists, then show the steps, GPU
# use and each run dir's shard count, and pack $R into $OUT.
poll_session() {
  local secs=$1 done=$2
  ensure_driver
  local end=$(( $(date +%s) + secs ))
  while [ $(date +%s) -lt $end ] && [ ! -e $R/$done ]; do sleep 10; done
  cat $R/steps.txt; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  for d in $R/repro/repro-*; do echo "$(basename $d): $(ls $d/shards 2>/dev/null | wc -l) shard dirs"; done
  pack
}

# A `join` call: take the piece this call carried, join what is complete, keep the driver up.
join_session() {
  cp gpu/ship/* /tmp/m/ 2>/dev/null
  join_models
  ensure_driver; tail -n 3 $R/steps.txt 2>/dev/null
}
