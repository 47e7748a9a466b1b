#!/bin/bash
# The fused batch-invariant kernels on the H200 (#15): two calls back to back, each with
# `carry ["gpu"]` (gpu/bin/kvcredit.gz: the release binary). No model ships: the checks run on
# the fixtures (tests/fixtures/hf, in the tree) and synthetic weights of the real shapes.
#   bash docs/gpu-run12.sh inv    # invariance (fused, every fixture architecture, bf16/fp16/fp32)
#                                 # + the stock negative control + the eager step/prefill cost
#   bash docs/gpu-run12.sh bench  # kvcredit bench, both shapes, stock and batch_invariant
# Results under $OUT (run12-inv.log, run12-bench/).
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=/tmp/kvcredit
F=tests/fixtures/hf
[ -x $B ] || { gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B; }
run() { # label, timeout, command...
  local label=$1 t=$2; shift 2
  echo "== $label"
  timeout "$t" "$@" 2>&1 | sed "s/^/[$label] /"
  echo "[$label] rc=${PIPESTATUS[0]}"
}
case "$1" in
inv)
  {
    date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; $B --version
    for m in llama qwen2 gemma2 gemma3 mistral_sw qwen3; do
      for d in bf16 fp16 fp32; do
        run "$m $d fused" 60 $B invariance --model $F/$m --device cuda --dtype $d --trials 3 --max-len 56
      done
      run "$m bf16 stock" 60 $B invariance --model $F/$m --device cuda --dtype bf16 --trials 3 --max-len 56 --policy stock
    done
    for s in qwen2.5-0.5b qwen2.5-1.5b; do
      run "$s bf16 fused" 90 $B invariance --synthetic $s --device cuda --dtype bf16 --trials 3 --max-len 300 --decode-steps 8
      run "$s bf16 stock" 90 $B invariance --synthetic $s --device cuda --dtype bf16 --trials 3 --max-len 300 --decode-steps 8 --policy stock
      run "$s bf16 fused bench" 90 $B invariance --synthetic $s --device cuda --dtype bf16 --bench --bench-only
    done
    run "qwen2.5-0.5b fp16 fused" 90 $B invariance --synthetic qwen2.5-0.5b --device cuda --dtype fp16 --trials 3 --max-len 300 --decode-steps 8
    run "qwen2.5-0.5b bf16 aten" 90 $B invariance --synthetic qwen2.5-0.5b --device cuda --dtype bf16 --trials 2 --max-len 300 --tiles kernels=aten
  } > $OUT/run12-inv.log 2>&1
  grep -E "rc=|vs stock|checks bitwise|decode step|prefill tok|error|Error" $OUT/run12-inv.log | head -120
  ;;
bench)
  mkdir -p $OUT/run12-bench
  H=docs/runs/h200-2026-12-01d/bench/hf-0.5b.json
  run "bench 0.5b" 280 $B bench --synthetic qwen2.5-0.5b --dtype bf16 --device cuda --quiet --hf $H --out $OUT/run12-bench > $OUT/run12-bench/bench-0.5b.txt
  run "bench 1.5b" 280 $B bench --synthetic qwen2.5-1.5b --dtype bf16 --device cuda --quiet --out $OUT/run12-bench > $OUT/run12-bench/bench-1.5b.txt
  cat $OUT/run12-bench/*.txt
  ;;
esac
