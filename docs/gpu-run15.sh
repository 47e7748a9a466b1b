#!/bin/bash
# The fused Gumbel-max sampler on the H200 (#15), one device call, no model shipped: for the
# Qwen2.5-0.5B and 1.5B shapes (bf16, synthetic weights), Hugging Face `generate` eager and with
# a static cache (compiled, CUDA graphs), then `kvcredit bench` with continuations under both
# samplers (the bitwise sampler check, and token digests that must match across samplers).
#   bash docs/gpu-run15.sh        # carry ["gpu"]: gpu/bin/kvcredit.gz
# Everything lands in $OUT/results.tgz (a call returns at most 8 files); the tables are printed.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
B=/tmp/kvcredit
PY=/opt/torch/.venv/bin/python
R=/tmp/R && rm -rf $R && mkdir -p $R
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; $B --version; } > $R/env.txt 2>&1
for s in ${SHAPES:-0.5b 1.5b}; do
  timeout ${HF_TIMEOUT:-200} $PY benches/hf_generate.py --shape qwen2.5-$s --dtype bf16 --batches 1,64 \
    --static --no-loop --out $R/hf-$s.json > $R/hf-$s.txt 2>&1 || echo "hf $s: exit $?" >> $R/hf-$s.txt
  timeout ${BENCH_TIMEOUT:-170} $B bench --synthetic qwen2.5-$s --dtype bf16 --device cuda --quiet \
    --engine graph --batches 1,64 --cont-batches 32,64 --samplers aten,fused \
    --hf $R/hf-$s.json --out $R > $R/bench-$s.txt 2>&1 || echo "bench $s: exit $?" >> $R/bench-$s.txt
  tar czf $OUT/results.tgz -C /tmp R
done
cat $R/env.txt
for s in ${SHAPES:-0.5b 1.5b}; do tail -5 $R/hf-$s.txt; cat $R/bench-$s.txt; done
