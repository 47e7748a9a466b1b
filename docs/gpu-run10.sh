#!/bin/bash
# Ran 2026-12-02 (results and what happened: docs/runs/h200-2026-12-02b/README.md; the run dirs
# it names have moved there since, finished). It finished the seed-table reproduction (#16). The
# run dirs travel with the tree in the `setup` call and resume there: the twins (56/80, 40/80)
# and the 1.5B bf16 pair (64/80 each) from docs/runs/h200-2026-12-02/repro, the finished stock
# 0.5B pair from docs/runs/h200-2026-12-01e/repro (`campaign run` leaves a finished run dir as
# it is, shards deleted or not: that lease's rerun of them had recomputed deleted shards), and
# the fp16 pair (exit 2 again: non-finite logits at rollout step 0).
#   T  as soon as the 0.5B has arrived: the two twins side by side.
#   S  as soon as the 1.5B has arrived: its four specs (the bf16 pair finishes in ~2 pools).
#   A  after both: experiments/repro-run.sh over all eight (nothing left to run; it writes the
#      one report, $R/repro/report, and exits 2 for the fp16 pair).
# The tree is ~69 MB: the `setup` call carries gpu (the binary) with tests/fixtures and
# docs/runs/h200-2026-12-01{c,d} moved aside (~32 MB); the piece calls carry only gpu/ship,
# with docs/runs/h200-2026-12-01e and docs/runs/h200-2026-12-02 moved aside too (the machine
# keeps /tmp/repo from `setup`), so tree + a 50 MiB piece < 64 MiB. Commit nothing while moved.
# Never signal a campaign from a call: xargs in repro-run.sh exits at once when a child dies
# of a signal (gpu-run9's lease), leaving its siblings running unreported.
# Modes: setup | join | poll SECS | drive (the driver itself).
set -u
declare -A PIECES=([qwen2.5-coder-0.5b-instruct]=10 [qwen2.5-coder-1.5b-instruct]=22)

SCRIPT=gpu-run10.sh
# shellcheck source=docs/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh"

specs() { for s in "$@"; do printf 'experiments/repro-%s.toml ' "$s"; done; }

lane_t() {
  wait_model qwen2.5-coder-0.5b-instruct
  REPRO_SPECS="$(specs qwen05-zs-bf16-bi qwen05-cot-bf16-bi)" REPRO_PARALLEL=2 \
    step 3600 twins bash experiments/repro-run.sh $B $R/repro
  touch $R/twins.done
}

lane_s() {
  wait_model qwen2.5-coder-1.5b-instruct
  REPRO_SPECS="$(specs qwen15-zs-bf16 qwen15-cot-bf16 qwen15-zs-fp16 qwen15-cot-fp16)" REPRO_PARALLEL=4 \
    step 3600 qwen15 bash experiments/repro-run.sh $B $R/repro
  touch $R/qwen15.done
}

case "$1" in
setup)
  setup_session docs/runs/h200-2026-12-02/repro/repro-* docs/runs/h200-2026-12-01e/repro/repro-*
  ;;
join)
  join_session
  ;;
drive)
  lane_t > $R/lane-t.log 2>&1 &
  lane_s > $R/lane-s.log 2>&1 &
  wait
  step 600 all bash experiments/repro-run.sh $B $R/repro
  touch $R/all.done
  ;;
poll)
  poll_session "$2" all.done
  ;;
esac
