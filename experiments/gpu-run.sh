#!/usr/bin/env bash
# Run a list of kvcredit jobs on a GPU machine that has torch but no Rust toolchain and perhaps
# no network: build here, ship the binary and the models, run there, bring the results back.
#
#   bash experiments/gpu-run.sh setup JOBS     # unpack gpu/bin/kvcredit.gz, copy this tree, record
#                                              #   the environment, start the driver on JOBS
#   bash experiments/gpu-run.sh piece          # take the model pieces in gpu/ship/, join complete models
#   bash experiments/gpu-run.sh poll SECS      # wait up to SECS for the driver; print its steps;
#                                              #   pack the results (no shards/) into $OUT
#   bash experiments/gpu-run.sh check JOBS     # parse JOBS and print the jobs, running nothing
#
# Here, before the first call: `make build`, then
#   mkdir -p gpu/bin gpu/ship && gzip -c "$CARGO_TARGET_DIR/release/kvcredit" > gpu/bin/kvcredit.gz
#   split -b 40M -d -a 2 ~/.cache/kvcredit/models/M/M.gguf gpu/ship/M.gguf.part   # per model M
#   ls gpu/ship/M.gguf.part* | wc -l > gpu/ship/M.gguf.count
# and carry gpu/ (ignored by git) to the machine; pieces may arrive over several calls.
#
# JOBS is a text file (experiments/jobs/*.jobs), one job per line:
#   NAME MODEL COMMAND...      MODEL is a registry name the job waits for (- for none); COMMAND is
#                              evaluated by bash with `kvcredit` the shipped binary and $R the
#                              results folder; its output goes to $R/logs/NAME.log and its exit
#                              code to $R/steps.txt. A trailing `&` runs it in the background.
#   wait                       wait for the background jobs
# Blank lines and lines starting with # are ignored. The driver runs the file once, in order.
#
# Environment: TORCH_LIB (torch's lib folder; default: asked of PYTHON, default python3),
# KVCREDIT_HOME (default /tmp/kvhome), WORK (default /tmp/kvrun: binary, tree, results).
set -u
WORK=${WORK:-/tmp/kvrun}
B=$WORK/kvcredit
R=$WORK/R
P=$WORK/repo
M=$WORK/ship
export KVCREDIT_HOME=${KVCREDIT_HOME:-/tmp/kvhome}
# Torch's libraries for the binary (setup and drive only: asking python costs seconds).
find_torch() {
  if [ -z "${TORCH_LIB:-}" ]; then
    TORCH_LIB=$(${PYTHON:-python3} -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
  fi
  [ -n "${TORCH_LIB:-}" ] && export LD_LIBRARY_PATH=$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  return 0
}

die() { echo "gpu-run: $*" >&2; exit 2; }

# Print each job of $1 as "NAME<TAB>MODEL<TAB>BG<TAB>COMMAND"; a malformed line is an error.
parse_jobs() {
  local file=$1 n=0 line name model rest bg
  [ -f "$file" ] || die "no job file $file"
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line=${line%%$'\r'}
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    if [[ "$line" =~ ^[[:space:]]*wait[[:space:]]*$ ]]; then
      printf 'wait\t-\t-\t-\n'
      continue
    fi
    read -r name model rest <<< "$line"
    [ -n "$rest" ] || die "$file line $n: expected NAME MODEL COMMAND"
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "$file line $n: bad job name '$name'"
    bg=0
    if [[ "$rest" =~ [[:space:]]\&[[:space:]]*$ ]]; then
      bg=1
      rest=${rest%&*}
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$model" "$bg" "$rest"
  done < "$file"
}

join_models() {
  local c name f
  for c in $M/*.gguf.count; do
    [ -e "$c" ] || continue
    name=$(basename "$c" .gguf.count)
    f=$KVCREDIT_HOME/models/$name/$name.gguf
    [ -e "$f" ] && continue
    if [ "$(ls $M/$name.gguf.part* 2>/dev/null | wc -l)" = "$(cat "$c")" ]; then
      mkdir -p "$(dirname "$f")" && cat $M/$name.gguf.part* > "$f.tmp" && mv "$f.tmp" "$f" && rm -f $M/$name.gguf.part*
      echo "joined $name ($(stat -c %s "$f") bytes)" | tee -a $R/steps.txt
    fi
  done
}

ensure_driver() {
  [ -e $R/DONE ] && return
  # setsid may fork, so a recorded pid is not the driver's: look for the process itself.
  pgrep -f "[g]pu-run.sh drive" > /dev/null && return
  echo "driver started $(date -u +%T)" >> $R/steps.txt
  (cd $P && setsid nohup bash experiments/gpu-run.sh drive "$(cat $R/jobs.path)" >> $R/driver.log 2>&1 < /dev/null &)
}

wait_model() { until [ -e "$KVCREDIT_HOME/models/$1/$1.gguf" ]; do sleep 2; done; }

run_job() { # name model command
  local name=$1 model=$2 cmd=$3 s
  [ "$model" = - ] || wait_model "$model"
  s=$(date +%s)
  (kvcredit() { "$B" "$@"; }; export R; eval "$cmd") > $R/logs/$name.log 2>&1
  echo "$name: exit $? in $(( $(date +%s) - s )) s" >> $R/steps.txt
}

case "${1:-}" in
check)
  parse_jobs "${2:-}" || exit 2
  ;;
setup)
  jobs=${2:-}
  parse_jobs "$jobs" > /dev/null || exit 2
  find_torch
  [ -n "${TORCH_LIB:-}" ] && [ -d "$TORCH_LIB" ] || die "torch not found: set TORCH_LIB to torch's lib folder"
  mkdir -p $WORK $R/logs $M $KVCREDIT_HOME/models
  gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
  rm -rf $P && mkdir -p $P && tar cf - --exclude=./gpu --exclude=./.venv --exclude=./target . | tar xf - -C $P
  echo "$jobs" > $R/jobs.path
  cp "$jobs" $R/jobs.txt
  cp gpu/ship/* $M/ 2>/dev/null
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version;
    echo "torch lib: $TORCH_LIB"; } > $R/env.txt 2>&1
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
  [ -e $R/DONE ] && echo DONE
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv 2>/dev/null
  [ -n "${OUT:-}" ] || die "OUT is not set: nowhere to pack the results"
  rm -rf $WORK/pack && mkdir -p $WORK/pack
  tar czf $WORK/pack/results.tgz --exclude='shards' -C $WORK R
  split -b 15M -d -a 1 $WORK/pack/results.tgz "$OUT/results.tgz.part"
  ls -la "$OUT"
  ;;
drive)
  find_torch
  mkdir -p $R/logs
  while IFS=$'\t' read -r name model bg cmd; do
    if [ "$name" = wait ]; then wait; continue; fi
    if [ "$bg" = 1 ]; then run_job "$name" "$model" "$cmd" & else run_job "$name" "$model" "$cmd"; fi
  done < <(parse_jobs "${2:-}")
  wait
  touch $R/DONE
  ;;
*)
  echo "usage: $0 setup JOBS | piece | poll SECS | check JOBS" >&2
  exit 2
  ;;
esac
