#!/usr/bin/env bash
# One device call: the Hugging Face baselines and `kvcredit bench` for the 0.5B and 1.5B shapes
# (bf16, CUDA), everything written under OUT. Run from the repository root:
#
#   bash benches/run_h200.sh ./gpu/kvcredit "$OUT"
#
# Each tool runs under a timeout so a failure or hang of one still leaves the others' results
# (about 4 minutes in all on the H200; the timeouts add up to under 10). Environment overrides,
# for trying it elsewhere: PYTHON, LD_LIBRARY_PATH, DEVICE, DTYPE, SHAPES, HF_ARGS, BENCH_ARGS,
# HF_TIMEOUT, BENCH_TIMEOUT (seconds per tool and shape).
set -u
BIN=${1:-./gpu/kvcredit}
OUT=${2:-${OUT:-bench-out}}
PY=${PYTHON:-/opt/torch/.venv/bin/python}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
SHAPES=${SHAPES:-"0.5b 1.5b"}
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
mkdir -p "$OUT"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1
  "$BIN" --version 2>&1
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)' 2>&1
} > "$OUT/env.txt"
for s in $SHAPES; do
  # shellcheck disable=SC2086  # HF_ARGS / BENCH_ARGS are word lists
  timeout "${HF_TIMEOUT:-120}" "$PY" benches/hf_generate.py --shape "qwen2.5-$s" --dtype "$DTYPE" --device "$DEVICE" \
    --batches 1,64 --out "$OUT/hf-$s.json" ${HF_ARGS:-} > "$OUT/hf-$s.txt" 2>&1 \
    || echo "hf_generate.py $s: exit $?" >> "$OUT/hf-$s.txt"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-170}" "$BIN" bench --synthetic "qwen2.5-$s" --dtype "$DTYPE" --device "$DEVICE" --quiet \
    --hf "$OUT/hf-$s.json" --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench-$s.txt" 2>&1 \
    || echo "kvcredit bench $s: exit $?" >> "$OUT/bench-$s.txt"
done
cat "$OUT/env.txt"
for s in $SHAPES; do cat "$OUT/hf-$s.txt" "$OUT/bench-$s.txt"; done
