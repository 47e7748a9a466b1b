#!/bin/bash
# Where the batch-invariant decode step spends its GPU time (#15), on the H200, with
# `carry ["gpu"]` (gpu/bin/kvcredit.gz: the release binary). No model ships: synthetic weights
# of the real shapes.
#   bash docs/gpu-run13.sh profile   # GEMM shapes under each cuBLAS setting (benches/gemm_shapes.py)
#                                    # + `kvcredit bench --profile 1,64`, both shapes, both kernel sets
#   bash docs/gpu-run13.sh all       # invariance (docs/gpu-run12.sh inv), then kvcredit bench of
#                                    # both shapes with the device profiles at batch 1 and 64
# Results under $OUT.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PY=/opt/torch/.venv/bin/python
B=/tmp/kvcredit
[ -x $B ] || { gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B; }
run() { # label, timeout, command...
  local label=$1 t=$2; shift 2
  echo "== $label"
  timeout "$t" "$@" 2>&1 | sed "s/^/[$label] /"
  echo "[$label] rc=${PIPESTATUS[0]}"
}
prof() { # label, shape, extra args...
  local label=$1 s=$2; shift 2
  run "$label" 200 $B bench --synthetic $s --dtype bf16 --device cuda --quiet --no-continuations \
    --batches 1,64 --engine auto --profile 1,64 --out $OUT/$label "$@"
  gzip -f $OUT/$label/trace-*.json 2>/dev/null
}
bench() { # label, shape, extra args...: the whole bench plus the profiles at batch 1 and 64
  local label=$1 s=$2; shift 2
  mkdir -p $OUT/$label
  run "$label" 280 $B bench --synthetic $s --dtype bf16 --device cuda --quiet --profile 1,64 \
    --out $OUT/$label "$@" > $OUT/$label/bench.txt
  rm -f $OUT/$label/trace-*.json
}
H=docs/runs/h200-2026-12-01d/bench/hf-0.5b.json
case "$1" in
profile)
  {
    date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; $B --version
    run gemm 300 $PY benches/gemm_shapes.py --out $OUT/gemm.json
    prof prof-0.5b qwen2.5-0.5b
    prof prof-1.5b qwen2.5-1.5b
    prof prof-0.5b-aten qwen2.5-0.5b --tiles kernels=aten --policy batch_invariant
  } > $OUT/run13-profile.log 2>&1
  grep -E "rc=|GPU ms/step|^\[prof[^]]*\]  +[0-9]|M-invariant|error|Error" $OUT/run13-profile.log | head -150
  ;;
all)
  bash docs/gpu-run12.sh inv
  bench bench-0.5b qwen2.5-0.5b --hf $H
  bench bench-1.5b qwen2.5-1.5b
  grep -hE "GPU ms/step|graph +(1|64) |graph +64 +128|MET|MISSED|rc=" $OUT/bench-*/bench.txt
  ;;
esac
