#!/bin/bash
# Continuous refill on the H200 (#15): the 0.5B zero-shot settings on 8 problems
# (experiments/bench-campaign-qwen05-8.toml), `kvcredit bench campaign` with --refill and
# without, back to back, alone on the GPU, as soon as the 0.5B has arrived. Calls: one `setup`
# (carry gpu: the binary), 10 `join` calls (carry gpu/ship, with tests/fixtures and docs/runs
# moved aside), then `poll SECS` until all.done. Modes: setup | join | poll SECS | drive.
set -u
declare -A PIECES=([qwen2.5-coder-0.5b-instruct]=10)

SCRIPT=gpu-run11.sh
# shellcheck source=docs/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh"

SPEC=experiments/bench-campaign-qwen05-8.toml

case "$1" in
setup)
  setup_session
  ;;
join)
  join_session
  ;;
drive)
  wait_model qwen2.5-coder-0.5b-instruct
  mkdir -p $R/bench
  step 300 refill $B bench campaign $SPEC --out $R/bench/refill --refill --quiet
  step 300 batches $B bench campaign $SPEC --out $R/bench/batches --quiet
  touch $R/all.done
  ;;
poll)
  poll_session "$2" all.done
  ;;
esac
