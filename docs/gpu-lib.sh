#!/bin/bash
# Shared by the H200 session scripts from docs/gpu-run8.sh on (sourced; the earlier gpu-run*.sh
# are kept as the records of what ran). Expects KVCREDIT_HOME, R (results), P (the private copy
# of the repo), PIECES (model -> piece count) and SCRIPT (the session script's file name).

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
