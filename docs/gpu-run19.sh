#!/bin/bash
# The fused glue (kernels/glue.cu, #15) on the H200, one call, no model shipped: the 0.5B shape,
# bf16, graph engine, `kvcredit bench` with the glue's bitwise check, once with
# KVCREDIT_GLUE=aten and once with the default (fused); token digests must match across them.
#   bash docs/gpu-run19.sh        # carry ["gpu"]: gpu/bin/kvcredit.gz
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=/tmp/kvcredit
R=/tmp/R && rm -rf $R && mkdir -p $R
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
common="--synthetic qwen2.5-${SHAPE:-0.5b} --dtype bf16 --device cuda --quiet --engine graph --batches 1,64 --cont-batches 64"
for g in aten fused; do
  mkdir -p $R/$g
  KVCREDIT_GLUE=$g timeout ${BENCH_TIMEOUT:-200} $B bench $common --out $R/$g "$@" > $R/$g/bench.txt 2>&1 || echo "bench $g: exit $?" >> $R/$g/bench.txt
  tar czf $OUT/results.tgz -C /tmp R
done
for g in aten fused; do echo "== glue $g"; cat $R/$g/bench.txt; done
